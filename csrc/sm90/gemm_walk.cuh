// The large-M kernel's contract with its host launch (sm90/gemm.cu): the parameters, the
// shared-memory layout and the tile walk (work units, tile order, the split tail), which both
// sides compute alike.
#pragma once
#include <cstdint>

#include "sm90/operands.cuh"

namespace fp8l {

struct GemmParams {
  int M, N, K, num_kb;
  const float* w_scale;  // [ceil(N/128), num_kb] blocks or [N, num_kb] per row
  const void* bias;      // [N] in the output dtype, or fp32 (bias_f32), or nullptr
  bool bias_f32;         // an fp32 bias is added as is, not rounded to the output type first
  uint32_t stage_bytes;  // TMA bytes a stage receives (less than A + B + scales when M < BM)
  int early_b;           // first-tile weight stages requested before griddepcontrol.wait
  int group_m;           // tile order: M units a group walks before the next N unit
  int a_half;            // kShareA: rows of A each CTA of the pair loads and multicasts
  float* workspace;      // kSplitTail: fp32 partial tiles, one slot a CTA
  int* counters;         // kSplitTail: one per tile, zero between launches (the last CTA resets)
  const int* tile_expert;  // kGrouped: the expert of each BM-row M block, -1: unused
  const int64_t* row_token;  // kGrouped: each row's token, -1: padding (after the expert's rows)
  float* out_scale_t;  // kSwiglu: h's scales [N / 256, out_scale_ld] (token-minor)
  int out_scale_ld;
};

template <int BM, int BN, int STAGES, bool kSplitTail = false>
struct GemmSmem {
  static constexpr int kMathWG = BM == 64 ? 1 : 2;
  static constexpr int kWaves = BM / (64 * kMathWG);  // 64-row waves per math warpgroup
  static constexpr int kThreads = (kMathWG + 1) * 128;
  static constexpr int kABytes = BM * kBlockK;
  static constexpr int kBBytes = BN * kBlockK;
  static constexpr int kOutBytes = BM * BN * 2;  // 16-bit outputs
  // Output boxes (the kernel's smem layout and the host's tensor map must agree): 64 columns
  // with the 128-byte swizzle, or (BN = 96 / 160) 32 columns with the 64-byte swizzle, or one
  // unswizzled box for BN <= 32 and BN = 48 (96-byte rows).
  static constexpr bool kOneBox = BN <= 32 || BN == 48;
  static constexpr int kBoxCols = kOneBox ? BN : BN % 64 == 0 ? 64 : 32;
  static constexpr int kA = 0;
  static constexpr int kB = kA + STAGES * kABytes;
  static constexpr int kOut = kB + STAGES * kBBytes;
  static constexpr int kSA = kOut + kOutBytes;
  static constexpr int kSB = kSA + STAGES * BM * 4;
  static constexpr int kBar = kSB + STAGES * BN * 4;  // BN floats: per-row B scales
  static constexpr int kFlag = kBar + 2 * STAGES * 8;  // kSplitTail: "this CTA sums the tile"
  static constexpr int kBytes = kFlag + (kSplitTail ? 16 : 0);
  static constexpr int kAlloc = kBytes + 1024;  // slack to align the base to 1024 B
};

// First row of M block mb. A last block that would run past M is moved up to end at row M
// (when M >= BM): its boxes then lie in bounds instead of being zero-filled by TMA, which on
// narrow tiles cost up to a third of the GEMM (docs/tuning.md: gemm-moved-last-block). The
// row is rounded up to a multiple of 4: it is also the inner coordinate of the fp32
// activation-scale box, which TMA needs 16-byte aligned (a few rows past M are then
// zero-filled). The rows it shares with the block before are computed by both CTAs from the
// same operands in the same order, so both write the same bits (checked for every
// configuration by tests/backends/test_gemm_gpu.py).
template <int BM>
__device__ __forceinline__ int tile_row0(int mb, int M) {
  const int r = mb * BM;
  return (r + BM > M && M >= BM) ? min(r, (M - BM + 3) & ~3) : r;
}

// Tile order: bands of group_m M-blocks, N-blocks inside, so that CTAs running at the same
// time share A rows and B columns in L2 (backends/sm90/launch.py: gemm_group_m picks the band).
__device__ __forceinline__ void tile_coords(int t, int num_m, int num_n, int group_m, int& mb,
                                            int& nb) {
  const int per_group = group_m * num_n;
  const int g = t / per_group;
  const int first_m = g * group_m;
  const int gm = min(num_m - first_m, group_m);
  const int r = t - g * per_group;
  mb = first_m + r % gm;
  nb = r / gm;
}

// The work units of a launch (the kernel's tile walk and the host's grid size): M and N
// blocks, a SiLU-and-mul block taking 2 * BN rows of B (BN gate over BN up), and CLUSTER
// adjacent tiles a unit (along N when they share A, else along M).
struct Units {
  int num_m, num_n, num_um, num_un;
  __host__ __device__ __forceinline__ Units(int M, int N, int BM, int BN, int cluster,
                                            bool share_a, bool swiglu) {
    num_m = (M + BM - 1) / BM;
    num_n = swiglu ? N / (2 * BN) : (N + BN - 1) / BN;
    num_um = share_a ? num_m : (num_m + cluster - 1) / cluster;
    num_un = share_a ? (num_n + cluster - 1) / cluster : num_n;
  }
  __host__ __device__ __forceinline__ int count() const { return num_um * num_un; }
};

// kGrouped: what a CTA runs of a unit. Pairs along M run in lockstep (each arrives on the
// other's barriers), so a pair skips a unit only where neither M block holds an expert; an M
// block of none (or past the last) runs its peer's expert idle (the loads, no MMAs, no
// stores), and the pair multicasts the weight tile where both blocks hold one expert, else
// each CTA loads its whole tile.
struct GroupedUnit {
  int expert;   // the expert whose weights the CTA loads; -1: the unit is skipped
  bool own;     // the CTA's M block holds that expert (else it runs idle)
  bool shared;  // a pair multicasts the weight tile
};
// the dense kernel's unit: expert 0, its own, a pair sharing the weight tile
__device__ __forceinline__ GroupedUnit dense_unit() { return {0, true, true}; }
__device__ __forceinline__ GroupedUnit grouped_unit(const int* tile_expert, int um, int num_m,
                                                    int cluster, int rank) {
  if (cluster == 1) return {__ldg(tile_expert + um), true, false};
  const int m0 = um * 2;
  const int e0 = __ldg(tile_expert + m0);
  const int e1 = m0 + 1 < num_m ? __ldg(tile_expert + m0 + 1) : -1;
  const int mine = rank ? e1 : e0, peer = rank ? e0 : e1;
  return {mine >= 0 ? mine : peer, mine >= 0, e0 == e1 || e0 < 0 || e1 < 0};
}

// Split tail (kSplitTail): where whole tiles would leave the last wave ragged, its tiles are
// split along K so that the last wave fills the SMs: each CTA walks whole tiles as without
// it (every ctas-th from its own) up to dp_end, then at most one part of a tail tile: tail
// tile t in `parts` K ranges, part s taken by CTA s * tail + t, all parts of all tail tiles
// in one wave (tail * parts <= ctas). Each part goes to its CTA's workspace slot and counts
// at the tile's counter; the last to count sums the parts in part order (bitwise
// deterministic: the order does not depend on who arrives last), stores the tile and
// resets the counter. Nobody waits for another CTA, and the parts of a tile run side by
// side over their own K ranges, as the whole tiles do, so CTAs running together still
// share operand tiles in L2. (Stream-K puts the CTAs at scattered K offsets, where they stop
// sharing the weights in L2; docs/tuning.md: gemm-split-tail.)
// (Also the host's: launch() sizes the grid with it, so both sides agree on the split.)
struct SplitTail {
  int dp_end;  // tiles below it: whole
  int tail;    // the tiles from dp_end on
  int parts;   // K ranges a tail tile is split into (1: whole)
  __host__ __device__ __forceinline__ SplitTail(int units, int num_kb, int ctas) {
    tail = units <= ctas ? units : units % ctas;
    dp_end = units - tail;
    parts = tail == 0 ? 1 : num_kb < ctas / tail ? num_kb : ctas / tail;
  }
  // part s of a tail tile: K blocks [kb(s), kb(s + 1))
  __host__ __device__ __forceinline__ int kb(int s, int num_kb) const {
    return s * (num_kb / parts) + min(s, num_kb % parts);
  }
};

}  // namespace fp8l
