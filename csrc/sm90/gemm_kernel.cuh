// Large-M block-scaled FP8 GEMM for sm_90a: C[M,N] = sum_kb (A_kb . B_kb^T) * sa[m,kb] * sb[n,kb].
//
// One persistent CTA per SM walks output tiles of BM x BN. Warp specialization:
//   math warpgroups (one for BM = 64, else two): each owns 64 rows of every 128-row wave of
//     the tile (BM = 256: two waves, so two 64-row totals a thread); per 128-wide K block and
//     wave it issues four m64nBNk32 fp8 wgmmas into a fresh fp32 partial, waits, and promotes
//     the partial into the fp32 total with the two scales (DeepSeek-V3 numerics);
//   the producer warpgroup (last, registers given back via setmaxnreg): warp 0 issues TMA
//     loads of A, B and the A scales into a STAGES-deep ring, warp 1 copies the B scales of
//     each stage into shared memory (128x128-block or per-row granularity).
// CLUSTER = 2: two CTAs on neighbouring SMs take adjacent tiles in lockstep and share one
// operand tile: vertically adjacent tiles share the weight (B) tile, each CTA loading half of
// it and multicasting it to both; or with kShareA horizontally adjacent ones share the
// activation (A) tile, each CTA loading half its rows for both. The L2 -> SM traffic
// per tile drops by half the shared tile (256x128 pairs sharing A: a third).
// Epilogue: registers -> swizzled shared memory (128B, or 64B for 32-column boxes) -> TMA store
// (clipped at M/N edges), while the producer already streams the next tile.
#pragma once
#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/ptx.cuh"
#include "common/wgmma.cuh"
#include "sm90/gemm_walk.cuh"
#include "sm90/operands.cuh"
#include "sm90/quant.cuh"

namespace fp8l {

// bias[n], bias[n + 1] as floats, from the output dtype or fp32
template <typename OutT>
__device__ __forceinline__ float2 load_bias2(const void* bias, bool f32, int n) {
  if (f32) return *reinterpret_cast<const float2*>(static_cast<const float*>(bias) + n);
  return OutTraits<OutT>::load2(static_cast<const OutT*>(bias) + n);
}

// kLean (64-row tiles of <= 64 columns): built for at most 128 registers a thread (they use
// 42-112), without the setmaxnreg split, so that a CTA fits beside the previous kernel's CTAs
// on an SM and starts under PDL while they run; built for the split (232 registers a thread
// for the math warpgroup: 59K of the SM's 64K) it waits for them to leave the SM
// (docs/tuning.md: gemm-lean).
// kQueueNext: two math warpgroups keep two partial accumulators as one does (below).
// kGrouped (the prefill expert GEMM of a mixture-of-experts layer, sm90/gemm.cu): A holds the
// tokens sorted by expert in M blocks of BM rows, B [experts * N, K] every expert's weights;
// M block mb multiplies expert tile_expert[mb]'s N rows, blocks of -1 are skipped by every
// role alike (pairs along M: GroupedUnit). A 192-column tile past N (N % 192 != 0) reads
// the next expert's rows or TMA's zeros, with zero scales, into columns never stored.
// kSwiglu (grouped gate_up, N = 2I: gate rows [0, I), up rows [I, 2I)): the output is
// h = SiLU(gate) * up quantized per 128 channels (swiglu_quant's numerics, gate and up rounded
// to OutT first as a stored gate_up would be): fp8 [M, I] in tmap_c and its scales in
// out_scale_t. A unit is (M block, 128 h channels) run as two K loops, one per 64 channels,
// whose B tile is gate rows [n0, n0 + 64) over up rows [I + n0, +64): a thread then holds
// gate and up of the same channels (columns c and c + 64), from two weight-scale blocks.
template <int BM, int BN, int STAGES, int CLUSTER, bool kShareA, bool kPerRowB, bool kLean,
          bool kQueueNext, bool kSplitTail, typename OutT, bool kGrouped = false,
          bool kSwiglu = false>
__global__ void __launch_bounds__(GemmSmem<BM, BN, STAGES>::kThreads, kLean ? 2 : 1)
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,   // [M, K] fp8
                    const __grid_constant__ CUtensorMap tmap_b,   // [N, K] fp8
                    const __grid_constant__ CUtensorMap tmap_sa,  // [num_kb, Mpad] fp32
                    const __grid_constant__ CUtensorMap tmap_c,   // [M, N] OutT
                    const GemmParams p) {
  using L = GemmSmem<BM, BN, STAGES, kSplitTail>;
  constexpr int kMathWG = L::kMathWG;
  constexpr int kWaves = L::kWaves;
  static_assert((BN % 32 == 0 && BN <= 192) || BN == 16 || (BN == 48 && BM == 64),
                "BN: 64- or 32-column store boxes (<= 96 regs), or one narrow box of 16 / 48");
  static_assert(BM == 64 || BM == 128 || (BM == 256 && BN == 128),
                "one or two math warpgroups; two waves only with 64 registers a partial");
  static_assert(CLUSTER == 1 || CLUSTER == 2, "pairs of CTAs at most");
  static_assert(CLUSTER == 2 || !kShareA, "sharing A needs a pair");
  static_assert(!kLean || (BM == 64 && BN <= 64), "lean: one math warpgroup, narrow tiles");
  static_assert(!kQueueNext || (BM == 128 && BN <= 128), "queued K blocks: 64 registers a partial");
  static_assert(!kSplitTail || (BM == 128 && CLUSTER == 1 && !kQueueNext),
                "split tail: single CTAs, one 64-row wave a warpgroup, one partial");
  static_assert(!kGrouped || (BM == 128 && (BN == 128 || BN == 192) && !kShareA && !kPerRowB &&
                              !kSplitTail && !kLean),
                "grouped: 128-row tiles of 128 or 192 columns, pairs along M, block scales");
  static_assert(!kSwiglu || kGrouped, "SiLU-and-mul in the epilogue: the grouped gate_up only");
  // K loops a unit runs (kSwiglu: one a 64-channel half)
  constexpr int kHalves = kSwiglu ? 2 : 1;
  // 128x128 weight-scale blocks: a BN-column tile lies in one block when BN divides 128,
  // else (BN = 48, 96, 160, 192) it can straddle two; the boundary falls on a 32-column
  // multiple (64 for BN = 192; 16 or 32 for BN = 48).
  constexpr bool kTwoBlocks = !kPerRowB && (128 % BN != 0 || kSwiglu);
  // BN = 48 / 96 / 160: the boundary is a constant of the tile's K loop (one loop per case, picked
  // at the tile's start, as DeepGEMM does): a run-time select per 8 columns cost those tiles
  // 10-15% (docs/tuning.md: gemm-static-boundary). BN = 192 selects once per K block (two
  // cases, below).
  constexpr bool kStaticBoundary = kTwoBlocks && BN != 192;
  constexpr int kBoxCols = L::kBoxCols;
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment (128B swizzle atoms) as an offset into smem_raw: the compiler keeps
  // knowing the pointers are shared (32-bit addresses, LDS), which it does not through a
  // rounded integer
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint8_t* sA = smem + L::kA;
  uint8_t* sB = smem + L::kB;
  uint8_t* sOut = smem + L::kOut;
  float* sSA = reinterpret_cast<float*>(smem + L::kSA);
  float* sSB = reinterpret_cast<float*>(smem + L::kSB);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBar);
  uint64_t* empty = full + STAGES;

  // warp-uniform as far as the compiler can tell (a shuffle from lane 0): the operand
  // descriptors derived from it then live in uniform registers, computed off the math path
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  // Work units: CLUSTER adjacent tiles (along N when they share A, else along M), one per CTA
  // of the cluster. Computed in each role after its register reallocation: values live
  // across setmaxnreg are spilled (the kernel starts at 168 registers a thread).
#define FP8L_TILE_WALK                                                            \
  const Units units_(p.M, p.N, BM, BN, CLUSTER, kShareA, kSwiglu);                \
  const int num_m = units_.num_m, num_n = units_.num_n;                           \
  const int num_um = units_.num_um, num_un = units_.num_un;                       \
  const int num_units = units_.count();                                           \
  const int rank = CLUSTER > 1 ? int(cluster_ctarank()) : 0;                      \
  const int first_unit = blockIdx.x / CLUSTER;                                    \
  const int unit_stride = gridDim.x / CLUSTER;                                    \
  /* what this CTA runs of unit u (GroupedUnit; dense: dense_unit()) */           \
  [[maybe_unused]] auto unit_expert = [&](int u) {                                \
    int um, un;                                                                   \
    tile_coords(u, num_um, num_un, p.group_m, um, un);                            \
    return kGrouped ? grouped_unit(p.tile_expert, um, num_m, CLUSTER, rank)       \
                    : dense_unit();                                               \
  };                                                                              \
  /* kGrouped: M block mb is an expert's last tile whose rows from 64 on are */   \
  /* padding (row_token -1): it needs only the first 64 rows' loads and MMAs */   \
  [[maybe_unused]] auto half_tile = [&](int mb) {                                 \
    return kGrouped && __ldg(p.row_token + size_t(mb) * BM + 64) < 0;             \
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // the TMA thread's expect_tx + every thread that wrote B scales into the stage (each
      // writer arrives itself, so its writes are ordered before the consumers' reads)
      mbar_init(&full[s], kPerRowB ? 1 + 32 : 2);
      // Frees a stage: one arrival per math lane of this CTA (each read the stage's B scales
      // itself, and arrives itself so its reads are ordered before the refill), plus one per
      // math warp of the peer where the peer's data lands in our ring from our loads: the half
      // of the shared tile (B, or A with kShareA) we multicast.
      const int remote = CLUSTER > 1 ? kMathWG * 4 : 0;
      mbar_init(&empty[s], kMathWG * 4 * 32 + remote);
    }
    fence_barrier_init();
    tma_prefetch_desc(&tmap_a);
    tma_prefetch_desc(&tmap_b);
    tma_prefetch_desc(&tmap_sa);
    tma_prefetch_desc(&tmap_c);
  }
  // The peer multicasts into our ring and arrives on our barriers: they must exist first.
  if constexpr (CLUSTER > 1) cluster_sync();
  else __syncthreads();

  if (wg == kMathWG) {
    // ------------------------------------------------------------------ producer warpgroup
    if constexpr (!kLean) reg_dealloc<40>();
    FP8L_TILE_WALK
    if (warp_in_wg == 0) {
      if (elect_one()) {
        // Activation tiles are re-read by every CTA of their row of tiles: keep them in L2
        // (measured: evict_normal 10-30% slower at M = 64-256). A weight tile is re-read by
        // the units of the other M blocks; with at most two M units (a unit is a pair where
        // pairs multicast the weight tile) those are neighbours in the tile order and run at
        // the same time, so the weights need no protection, and marking them evict-last only
        // pushes the activations out. With more M units the re-reads come later and the
        // weights keep evict-last (docs/tuning.md: gemm-l2-policy).
        const uint64_t keep = l2_policy_evict_last();
        const bool few_m_units = num_um <= 2;
        const uint64_t keep_b = few_m_units ? l2_policy_evict_first() : keep;
        int s = 0;
        uint32_t phase = 0;
        constexpr uint16_t kBoth = uint16_t((1 << CLUSTER) - 1);
        // A CTA whose tile lies past M or N (odd tile count) still carries its half of the
        // shared tile for the peer; it reads a valid tile of its own and stores nothing.
        auto unit_mn = [&](int u, int& mb, int& nb) {
          int um, un;
          tile_coords(u, num_um, num_un, p.group_m, um, un);
          mb = kShareA ? um : min(um * CLUSTER + rank, num_m - 1);
          nb = kShareA ? min(un * CLUSTER + rank, num_n - 1) : un;
        };
        auto load_b = [&](int st, int kb, int nb, const GroupedUnit& gu, int half) {
          uint8_t* dst = sB + st * L::kBBytes;
          const int row = gu.expert * p.N + nb * BN;
          if constexpr (!kSwiglu && (CLUSTER == 1 || kShareA)) {
            tma_load_2d(dst, &tmap_b, &full[st], kb * kBlockK, row, keep_b);
          } else {
            // two boxes of BN / 2 rows: kSwiglu's gate rows of the half over its up rows, or
            // a pair's halves of the tile; a pair sharing the tile multicasts one box a CTA
            constexpr int kBox = BN / 2;
            auto box_row = [&](int i) {
              return kSwiglu ? row + half * kBox + i * (p.N / 2) : row + i * kBox;
            };
            if (CLUSTER > 1 && gu.shared) {
              tma_load_2d_multicast(dst + rank * kBox * kBlockK, &tmap_b, &full[st],
                                    kb * kBlockK, box_row(rank), kBoth, keep_b);
            } else {
              tma_load_2d(dst, &tmap_b, &full[st], kb * kBlockK, box_row(0), keep_b);
              tma_load_2d(dst + kBox * kBlockK, &tmap_b, &full[st], kb * kBlockK, box_row(1),
                          keep_b);
            }
          }
        };
        // Weights are not written by the previous kernel: the first tile's first early_b
        // stages of weights are requested before griddepcontrol.wait (the stages are free:
        // nothing ran yet; their full barriers count these bytes once the arrival below
        // expects them). Activations (and their scales) wait for the previous kernel.
        int early = 0;
        if (!kSplitTail && !kGrouped && p.early_b > 0 && first_unit < num_units) {
          int mb, nb;
          unit_mn(first_unit, mb, nb);
          early = min(min(STAGES, p.num_kb), p.early_b);
          for (int kb = 0; kb < early; ++kb) load_b(kb, kb, nb, dense_unit(), 0);
        }
        pdl_wait();
        // K block kb of the tile at row0 / nb into the next stage (its weights too unless they
        // went out early)
        auto stage = [&](int kb, int row0, int nb, const GroupedUnit& gu, int half,
                         bool with_b, int a_boxes) {
          mbar_wait(&empty[s], phase ^ 1);
          if constexpr (kGrouped) {
            // 64-row boxes: an expert's last tile whose rows from 64 on are padding (its
            // second math warpgroup runs no MMAs) loads one, a CTA running idle none
            for (int i = 0; i < a_boxes; ++i)
              tma_load_2d(sA + s * L::kABytes + i * 64 * kBlockK, &tmap_a, &full[s],
                          kb * kBlockK, row0 + i * 64, keep);
          } else if constexpr (CLUSTER == 1 || !kShareA) {
            tma_load_2d(sA + s * L::kABytes, &tmap_a, &full[s], kb * kBlockK, row0, keep);
          } else {
            // each CTA loads half the shared activation tile's rows for both: two TMA units
            // share the pair's A traffic (docs/tuning.md: gemm-split-a-multicast).
            tma_load_2d_multicast(sA + s * L::kABytes + rank * p.a_half * kBlockK, &tmap_a,
                                  &full[s], kb * kBlockK, row0 + rank * p.a_half, kBoth, keep);
          }
          if (with_b) load_b(s, kb, nb, gu, half);
          tma_load_2d(sSA + s * BM, &tmap_sa, &full[s], row0, kb, keep);
          // The copies go out first, then the arrival that expects their bytes (the barrier
          // cannot complete before it): faster than arriving first (docs/tuning.md:
          // gemm-arrive-after-copies).
          mbar_arrive_expect_tx(&full[s], p.stage_bytes - (2 - a_boxes) * 64 * kBlockK);
          if (++s == STAGES) { s = 0; phase ^= 1; }
        };
        // whole tiles (with kSplitTail those below dp_end; it requests no early stages: it runs
        // from 512 tokens, where the heuristic asks for none)
        const SplitTail st(num_units, p.num_kb, gridDim.x);
        const int dp_end = kSplitTail ? st.dp_end : num_units;
        for (int u = first_unit; u < dp_end; u += unit_stride) {
          int mb, nb;
          unit_mn(u, mb, nb);
          const GroupedUnit gu = unit_expert(u);
          if (gu.expert < 0) continue;
          const int row0 = kSplitTail || kGrouped ? mb * BM : tile_row0<BM>(mb, p.M);
          const int a_boxes = !kGrouped ? 2 : !gu.own ? 0 : half_tile(mb) ? 1 : 2;
          for (int half = 0; half < kHalves; ++half)
            for (int kb = 0; kb < p.num_kb; ++kb)
              stage(kb, row0, nb, gu, half, u != first_unit || kb >= early, a_boxes);
        }
        if (kSplitTail && int(blockIdx.x) < st.tail * st.parts) {  // this CTA's tail part
          const int part = blockIdx.x / st.tail;
          int mb, nb;
          unit_mn(st.dp_end + blockIdx.x % st.tail, mb, nb);
          for (int kb = st.kb(part, p.num_kb); kb < st.kb(part + 1, p.num_kb); ++kb)
            stage(kb, mb * BM, nb, dense_unit(), 0, true, 2);
        }
        // PDL (a no-op without it): the next kernel may launch once every CTA of ours has
        // issued its last loads (one thread's call counts for its CTA); it waits for our
        // completion (griddepcontrol.wait) before reading our output. Triggering right after
        // the prologue instead, or never, was slower (docs/tuning.md: gemm-late-trigger).
        pdl_launch_dependents();
      }
    } else if (warp_in_wg == 1) {
      // B scales into each stage's slot. A global load is an L2 round trip (~1 us under a
      // full GEMM's traffic, more when it misses), longer than a few stages last, so it must
      // never sit between "stage free" and "stage full": block scales are fetched 32 K blocks
      // at a time into registers (lane i holds K block kb0 + i) and handed out per stage by
      // shuffles, each batch fetched one batch ahead (the next tile's first batch during
      // this tile's last). (docs/tuning.md: gemm-scale-reads)
      int s = 0;
      uint32_t phase = 0;
      const int num_nblk = (p.N + 127) / 128;
      // the tile's weight-scale block column (block scales) or first weight row (per row); a
      // tile past N (odd tile count) reads, and ignores, the last valid tile's scales: never
      // a row of w_scale past its end
      auto tile_nb = [&](int u) {
        int um, un;
        tile_coords(u, num_um, num_un, p.group_m, um, un);
        return kShareA ? min(un * CLUSTER + rank, num_n - 1) : un;
      };
      if constexpr (kPerRowB) {
        // per-row scales (tensor-parallel shards not on the 128 grid): BN values per stage,
        // loaded in place (a rarer, slower path)
        auto row_scales = [&](int nb, int kb) {
          mbar_wait(&empty[s], phase ^ 1);
          for (int i = lane; i < BN; i += 32) {
            const int n = nb * BN + i;
            sSB[s * BN + i] = n < p.N ? __ldg(p.w_scale + size_t(n) * p.num_kb + kb) : 0.f;
          }
          mbar_arrive(&full[s]);
          if (++s == STAGES) { s = 0; phase ^= 1; }
        };
        const SplitTail st(num_units, p.num_kb, gridDim.x);
        const int dp_end = kSplitTail ? st.dp_end : num_units;
        for (int u = first_unit; u < dp_end; u += unit_stride)
          for (int kb = 0; kb < p.num_kb; ++kb) row_scales(tile_nb(u), kb);
        if (kSplitTail && int(blockIdx.x) < st.tail * st.parts) {
          const int part = blockIdx.x / st.tail, u = st.dp_end + blockIdx.x % st.tail;
          for (int kb = st.kb(part, p.num_kb); kb < st.kb(part + 1, p.num_kb); ++kb)
            row_scales(tile_nb(u), kb);
        }
      } else {
        // a unit's stages: its K blocks (kSwiglu: twice, once a half, with the same scales)
        const int unit_kbs = kHalves * p.num_kb;
        // lane i's scales of the unit's stage kb0 + i of unit u (zeros past its stages or the
        // units)
        auto fetch = [&](int u, int kb0, float& lo, float& hi) {
          lo = hi = 0.f;
          int kb = kb0 + lane;
          if (u < num_units && kb < unit_kbs) {
            if (kSwiglu && kb >= p.num_kb) kb -= p.num_kb;
            // the first 128-row block, and the next (kSwiglu: the up rows' block, I / 128 on)
            const int blk = tile_nb(u) * BN / 128;
            const int blk_hi = kSwiglu ? blk + num_nblk / 2 : blk + 1;
            const float* ws = p.w_scale;
            if constexpr (kGrouped) ws += size_t(unit_expert(u).expert) * num_nblk * p.num_kb;
            lo = __ldg(ws + size_t(blk) * p.num_kb + kb);
            if (kTwoBlocks && blk_hi < num_nblk)
              hi = __ldg(ws + size_t(blk_hi) * p.num_kb + kb);
          }
        };
        // stage s's block scales from lane j of (lo, hi)
        auto hand_out = [&](int j, float lo, float hi) {
          mbar_wait(&empty[s], phase ^ 1);
          const float vlo = __shfl_sync(0xffffffffu, lo, j);
          const float vhi = __shfl_sync(0xffffffffu, hi, j);
          if (lane == 0) {
            sSB[s * BN] = vlo;
            if constexpr (kTwoBlocks) sSB[s * BN + 1] = vhi;
            mbar_arrive(&full[s]);
          }
          if (++s == STAGES) { s = 0; phase ^= 1; }
        };
        // whole tiles (with kSplitTail those below dp_end)
        const SplitTail st(num_units, p.num_kb, gridDim.x);
        const int dp_end = kSplitTail ? st.dp_end : num_units;
        // kGrouped: the next unit from u on that is not skipped
        auto next_unit = [&](int u) {
          if constexpr (kGrouped)
            while (u < num_units && unit_expert(u).expert < 0) u += unit_stride;
          return u;
        };
        int u = next_unit(first_unit), kb0 = 0;
        float lo, hi;
        fetch(u, kb0, lo, hi);
        while (u < dp_end) {
          int nu = u, nkb0 = kb0 + 32;
          if (nkb0 >= unit_kbs) nu = next_unit(nu + unit_stride), nkb0 = 0;
          float nlo, nhi;
          fetch(nu, nkb0, nlo, nhi);  // in flight while this batch is handed out
          const int kb_end = min(kb0 + 32, unit_kbs);
          for (int kb = kb0; kb < kb_end; ++kb) hand_out(kb - kb0, lo, hi);
          u = nu, kb0 = nkb0, lo = nlo, hi = nhi;
        }
        if (kSplitTail && int(blockIdx.x) < st.tail * st.parts) {
          // this CTA's tail part, in batches of 32 K blocks
          const int part = blockIdx.x / st.tail, tu = st.dp_end + blockIdx.x % st.tail;
          const int kb_end = st.kb(part + 1, p.num_kb);
          for (int kb0 = st.kb(part, p.num_kb); kb0 < kb_end; kb0 += 32) {
            fetch(tu, kb0, lo, hi);
            for (int kb = kb0; kb < min(kb0 + 32, kb_end); ++kb) hand_out(kb - kb0, lo, hi);
          }
        }
      }
    }
  } else {
    // ---------------------------------------------------------------------- math warpgroups
    if constexpr (!kLean) reg_alloc<232>();
    pdl_wait();  // (our output may still be read by the previous kernel)
    FP8L_TILE_WALK
    using Mma = WgmmaFp8<BN>;
    constexpr int kRegs = Mma::kRegs;
    // Two partials with one math warpgroup (BM = 64): K block kb+1's wgmmas are issued before
    // kb's partial is promoted, so the tensor cores never wait for a promotion. With two math
    // warpgroups each one's promotion runs while the other's wgmmas do, and a single partial
    // (in the unrolled loop below) is faster, and one partial with BM = 64 slower
    // (docs/tuning.md: gemm-partials). Except over short K loops at 512-1024 tokens
    // (kQueueNext, config 13: two-partials-short-k). Per-row B scales keep one (their
    // promotion needs the registers: ptxas spills otherwise); BN = 192 and two
    // waves (BM = 256) have two warpgroups anyway.
    constexpr bool kTwoPartials = (kMathWG == 1 || kQueueNext) && 3 * kRegs <= 192 && !kPerRowB;
    static_assert(!kSplitTail || !kTwoPartials, "split tail: the one-partial K loop");
    float acc[kWaves][kRegs];
    float part0[kRegs];
    float part1[kRegs];  // unused (and compiled away) with one partial
    const int row_in_wg = warp_in_wg * 16 + lane / 4;  // and +8
    const int col_q = 2 * (lane % 4);                  // + 8*j, and +1
    // first tile row of this warpgroup's 64 rows in wave w
    auto wave_row = [&](int w) { return (w * kMathWG + wg) * 64; };
    int s = 0;
    uint32_t phase = 0;

    // Operand descriptors of stage 0 (wave 0); others differ only in the start address
    // field (bytes / 16, no carry out of its 14 bits: shared memory ends below 256 KB).
    const uint64_t desc_a0 = make_smem_desc_sw128(sA + wave_row(0) * kBlockK);
    const uint64_t desc_b0 = make_smem_desc_sw128(sB);
    // Four m64nBNk32 wgmmas over stage st's 128-wide K block (wave w's rows) into P
    // (overwritten), committed as one group.
    auto issue = [&](float(&P)[kRegs], int st, int w) {
      const uint64_t da =
          desc_a0 + uint32_t((st * L::kABytes + w * kMathWG * 64 * kBlockK) >> 4);
      const uint64_t db = desc_b0 + uint32_t((st * L::kBBytes) >> 4);
#pragma unroll
      for (int i = 0; i < kRegs; ++i) fence_operand(P[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 32; ++kk) {
        // +32 bytes along K inside the swizzle atom == +2 in the descriptor's address field
        Mma::mma(P, da + 2 * kk, db + 2 * kk, kk > 0);
      }
      wgmma_commit();
      // (no operand fence here: touching P before its wgmma.wait makes ptxas serialise the
      // wgmmas, C7514; step() fences it after the wait)
    };
    // Stage st is read (wgmmas done, scales in registers): let the producer(s) refill it.
    // Every lane read the stage's B scales with ordinary loads and arrives itself, which orders
    // its read before the B-scale warp's next write of the slot. (One arrival a warp after
    // __syncwarp is as correct, but compute-sanitizer's racecheck does not follow the warp
    // barrier and flagged that write in every configuration when forced onto the sanitizer's
    // cases; per-lane arrivals cost 0.1-0.3%; docs/tuning.md: gemm-lane-release.)
    // In a pair each CTA multicasts half of the shared tile (A or B) into the peer's ring, so
    // each also tells the peer's producer when it has read the stage.
    const bool tell_peer = CLUSTER > 1;
    auto release = [&](int st) {
      mbar_arrive(&empty[st]);
      if (tell_peer && lane == 0) mbar_arrive_cluster(&empty[st], rank ^ 1);
    };
    // acc += P * sa[row] * sb[col] with the stage's scales (DeepSeek-V3 promotion).
    auto promote = [&](float(&acc)[kRegs], const float(&P)[kRegs], int st, float sa0, float sa1,
                       float lo, float hi, int boundary) {
      if constexpr (kPerRowB) {
        promote_scaled(acc, P, sa0, sa1, sSB + st * BN, col_q);
      } else {
        const float s0lo = sa0 * lo, s1lo = sa1 * lo, s0hi = sa0 * hi, s1hi = sa1 * hi;
        // BN = 192 tiles start at multiples of 192, so the boundary is 128 (even tiles) or 64
        // (odd): columns [0, 64) use the first block, [128, 192) the second, and only the
        // middle 64 depend on the tile. One select for them, not one per 8 columns (ptxas
        // turned those into 48 multiplies between the wgmma wait and the promotion).
        const bool wide = boundary > 64;
        const float m0 = wide ? s0lo : s0hi, m1 = wide ? s1lo : s1hi;
#pragma unroll
        for (int j = 0; j < kRegs / 4; ++j) {
          float s0 = s0lo, s1 = s1lo;
          if constexpr (kStaticBoundary) {
            if (8 * j >= boundary) s0 = s0hi, s1 = s1hi;  // a literal per K loop (below)
          } else if constexpr (kTwoBlocks) {
            static_assert(BN == 192, "boundary cases derived for BN = 192");
            if (8 * j >= 128) s0 = s0hi, s1 = s1hi;
            else if (8 * j >= 64) s0 = m0, s1 = m1;
          }
          acc[4 * j + 0] = fmaf(P[4 * j + 0], s0, acc[4 * j + 0]);
          acc[4 * j + 1] = fmaf(P[4 * j + 1], s0, acc[4 * j + 1]);
          acc[4 * j + 2] = fmaf(P[4 * j + 2], s1, acc[4 * j + 2]);
          acc[4 * j + 3] = fmaf(P[4 * j + 3], s1, acc[4 * j + 3]);
        }
      }
    };
    // 128x128 block scales of stage s are warp-uniform: every lane reads them (one broadcast
    // load). (A lane-0 load and a shuffle cost 5-8%; docs/tuning.md: gemm-scale-reads.)
    auto block_scales = [&](float& lo, float& hi) {
      if constexpr (!kPerRowB) {
        lo = sSB[s * BN];
        if constexpr (kTwoBlocks) hi = sSB[s * BN + 1];
      }
    };
    // One K block. kNext: block kb+1's wgmmas go into Pn first (two partials); then wait for
    // block kb (in Pc), free its stage and promote it. No branch between issue and wait:
    // ptxas serialises wgmmas (C7514) when it cannot see which group a register belongs to.
    // (kNext is a literal at every call: the branches fold away once inlined)
    auto step = [&](const bool kNext, float(&Pc)[kRegs], float(&Pn)[kRegs], int boundary) {
      const int sn = s + 1 == STAGES ? 0 : s + 1;
      const uint32_t phn = sn == 0 ? phase ^ 1 : phase;
      if (kNext) {
        mbar_wait(&full[sn], phn);
        issue(Pn, sn, 0);
      }
      // the scales are read while the tensor cores work
      const float sa0 = sSA[s * BM + wg * 64 + row_in_wg];
      const float sa1 = sSA[s * BM + wg * 64 + row_in_wg + 8];
      float lo = 0.f, hi = 0.f;
      block_scales(lo, hi);
      if (kNext) wgmma_wait<1>();
      else wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kRegs; ++i) fence_operand(Pc[i]);
      // Block scales are in registers now: free the stage before promoting, so the producer
      // refills it one promotion earlier. Per-row B scales are read during the promotion.
      if constexpr (!kPerRowB) release(s);
      promote(acc[0], Pc, s, sa0, sa1, lo, hi, boundary);
      if constexpr (kPerRowB) release(s);
      s = sn;
      phase = phn;
    };
    // One K block with one partial: per wave, four wgmmas, wait, promote (the other
    // warpgroup's wgmmas keep the tensor cores busy meanwhile).
    auto step_waves = [&](int boundary) {
      mbar_wait(&full[s], phase);
      float lo = 0.f, hi = 0.f;
      block_scales(lo, hi);
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
        // Two waves (256x128): the wave's A scales are read before its wgmmas. Read after the
        // first one (as before), the two scale FMULs that ptxas places between the wgmmas
        // waited for the loads and held back wgmmas 2-4 (ncu: short-scoreboard stalls there,
        // where DeepGEMM reads them first). One-wave tiles were slower with it, so they keep
        // the order (docs/tuning.md: gemm-scales-before-wgmma).
        float sa0 = 0.f, sa1 = 0.f;
        auto read_sa = [&] {
          sa0 = sSA[s * BM + wave_row(w) + row_in_wg];
          sa1 = sSA[s * BM + wave_row(w) + row_in_wg + 8];
        };
        if constexpr (kWaves > 1) read_sa();
        issue(part0, s, w);
        if constexpr (kWaves == 1) read_sa();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kRegs; ++i) fence_operand(part0[i]);
        if (!kPerRowB && w == kWaves - 1) release(s);
        promote(acc[w], part0, s, sa0, sa1, lo, hi, boundary);
      }
      if constexpr (kPerRowB) release(s);
      if (++s == STAGES) { s = 0; phase ^= 1; }
    };
    constexpr bool kIssueNext = true, kLast = false;

    // Tiles u: all K blocks of every unit_stride-th unit from first_unit; with kSplitTail those
    // below dp_end, then this CTA's part of a tail tile (nkb of its K blocks).
    // (the split is recomputed where it is used: kept live it cost the per-row tiles a spill)
    int dp_end = num_units;
    bool tail_part = false;
    if constexpr (kSplitTail) {
      const SplitTail st(num_units, p.num_kb, gridDim.x);
      dp_end = st.dp_end;
      tail_part = int(blockIdx.x) < st.tail * st.parts;
    }
    for (int u = first_unit; kSplitTail ? u < dp_end || tail_part : u < num_units;
         u += unit_stride) {
      int nkb = p.num_kb;
      if constexpr (kSplitTail) {
        if (u >= dp_end) {  // whole tiles done: this CTA's tail part
          const SplitTail st(num_units, p.num_kb, gridDim.x);
          u = st.dp_end + blockIdx.x % st.tail;
          const int part = blockIdx.x / st.tail;
          nkb = st.kb(part + 1, p.num_kb) - st.kb(part, p.num_kb);
          tail_part = false;
        }
      }
      int um, un;
      tile_coords(u, num_um, num_un, p.group_m, um, un);
      const int mb = kShareA ? um : um * CLUSTER + rank;
      const int nb = kShareA ? un * CLUSTER + rank : un;
      const GroupedUnit gu = unit_expert(u);
      if (gu.expert < 0) continue;  // (kGrouped: a skipped unit)
      // columns [0, boundary) of this tile use the first weight-scale block, the rest the next
      const int boundary = 128 * (nb * BN / 128 + 1) - nb * BN;
#pragma unroll
      for (int w = 0; w < kWaves; ++w)
#pragma unroll
        for (int i = 0; i < kRegs; ++i) acc[w][i] = 0.f;

      // The tile's K loop, for the boundary `bnd`.
      auto k_loop = [&](int bnd) {
        if constexpr (kTwoPartials) {
          mbar_wait(&full[s], phase);
          issue(part0, s, 0);
          int kb = 0;
          for (; kb + 2 < p.num_kb; kb += 2) {
            step(kIssueNext, part0, part1, bnd);
            step(kIssueNext, part1, part0, bnd);
          }
          if (kb + 1 < p.num_kb) {
            step(kIssueNext, part0, part1, bnd);
            step(kLast, part1, part0, bnd);
          } else {
            step(kLast, part0, part1, bnd);
          }
        } else {
          // Unrolled so that ptxas moves each K block's full-barrier wait and scale loads up
          // into the previous block's promotion (as in DeepGEMM's unroll-8 loop); rolled, the
          // wait, its branch and ~30 descriptor instructions sat between the promotion and the
          // next wgmmas (docs/tuning.md: gemm-partials; unrolled by 8: no better).
#pragma unroll 4
          for (int kb = 0; kb < (kSplitTail ? nkb : p.num_kb); ++kb) step_waves(bnd);
        }
      };
      // kGrouped: a half tile keeps only the first math warpgroup's MMAs: the second waits
      // out and frees each stage, and stores nothing (padding rows may hold anything;
      // moe_routing.Stages); a CTA running idle in a pair (GroupedUnit) does so with both
      if (kGrouped && (!gu.own || (wg == 1 && half_tile(mb)))) {
        for (int kb = 0; kb < kHalves * p.num_kb; ++kb) {
          mbar_wait(&full[s], phase);
          release(s);
          if (++s == STAGES) { s = 0; phase ^= 1; }
        }
        continue;
      }
      // kSwiglu: the unit (M block mb, h channels [128 nb, +128)): its two K loops, h of each
      // half packed (OutT pairs: channels 64 t + 8 j + col_q, +1 of rows row_in_wg + 8 r), the
      // rows' amax over the 128 channels (this thread's 32 and its quad's), then fp8 h through
      // shared memory to a TMA store and the rows' scales to out_scale_t. The first half's h
      // waits in the upper half of sOut (fp8 h takes the lower), each thread's own words: kept
      // in registers through the second K loop, they spilled.
      if constexpr (kSwiglu) {
        constexpr bool kFp16 = std::is_same_v<OutT, __half>;
        uint32_t* stash = reinterpret_cast<uint32_t*>(sOut + BM * BN) + threadIdx.x;
        uint32_t h1[8][2];
        for (int t = 0; t < 2; ++t) {  // (rolled: one copy of the K loop)
#pragma unroll
          for (int i = 0; i < kRegs; ++i) acc[0][i] = 0.f;
          k_loop(BN / 2);  // gate columns [0, 64): the first scale block, up the second
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float g[2], v[2];
              word_to_floats<OutT>(OutTraits<OutT>::pack(acc[0][4 * j + 2 * r],
                                                         acc[0][4 * j + 2 * r + 1]), g);
              word_to_floats<OutT>(OutTraits<OutT>::pack(acc[0][4 * (j + 8) + 2 * r],
                                                         acc[0][4 * (j + 8) + 2 * r + 1]), v);
              const uint32_t w = OutTraits<OutT>::pack(silu_mul1(g[0], v[0], kFp16),
                                                       silu_mul1(g[1], v[1], kFp16));
              if (t == 0) stash[(2 * j + r) * kMathWG * 128] = w;
              else h1[j][r] = w;
            }
        }
        const bool wg_leader = threadIdx.x % 128 == 0;
        if (wg_leader) tma_store_wait_read();  // the previous unit's store has left smem
        named_barrier(1 + wg, 128);
        uint8_t* box = sOut + wg * 64 * 128;  // this warpgroup's 64 rows x 128 fp8 channels
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // |h| as 16-bit magnitudes: an integer max is the amax (NaN propagating)
          uint32_t m = 0, h0[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            h0[j] = stash[(2 * j + r) * kMathWG * 128];
            m = max_u16x2(m, max_u16x2(h0[j] & kAbsBits16x2, h1[j][r] & kAbsBits16x2));
          }
          m = max_u16x2(m, m >> 16);
          m = max_u16x2(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = max_u16x2(m, __shfl_xor_sync(0xffffffffu, m, 2));
          const GroupScale gs = group_scale(bits16_to_float(m, kFp16));
          const int row = row_in_wg + 8 * r;
#pragma unroll
          for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              float v[2];
              word_to_floats<OutT>(t == 0 ? h0[j] : h1[j][r], v);
              const __nv_fp8x2_storage_t q = quantize2(v[0], v[1], gs);
              const int c = 64 * t + 8 * j + col_q;  // byte in the 128-byte row: 128B swizzle
              *reinterpret_cast<__nv_fp8x2_storage_t*>(box + row * 128 +
                                                      (((c / 16) ^ (row % 8)) * 16) + c % 16) = q;
            }
          if (lane % 4 == 0)
            p.out_scale_t[size_t(nb) * p.out_scale_ld + mb * BM + wg * 64 + row] = gs.scale();
        }
        fence_proxy_async_smem();
        named_barrier(1 + wg, 128);
        if (wg_leader) {
          tma_store_2d(&tmap_c, box, nb * BN, mb * BM + wg * 64);
          tma_store_commit();
        }
        continue;
      }
      if constexpr (kStaticBoundary && BN == 48) {
        // BN = 48 tiles (starting at multiples of 48): the boundary is 16, 32 or >= 48 (every
        // column in the first block)
        if (boundary == 16) k_loop(16);
        else if (boundary == 32) k_loop(32);
        else k_loop(128);
      } else if constexpr (kStaticBoundary) {
        // BN = 96 / 160 tiles: the boundary is 32, 64, 96 or >= 128 (every column in the first
        // block); each call inlines the loop with its literal, so the promotion's per-column
        // scale choice folds away. (Generic lambdas crash nvcc 13.0's front end here.)
        if (boundary == 32) k_loop(32);
        else if (boundary == 64) k_loop(64);
        else if (boundary == 96) k_loop(96);
        else k_loop(128);
      } else {
        k_loop(boundary);
      }
      // kSplitTail, a part of tail tile u (nkb < num_kb K blocks): into this CTA's workspace
      // slot; the last part to arrive sums the tile's parts in part order into acc and stores
      // the tile, the others are done. The CTA that sums resets the tile's counter.
      if constexpr (kSplitTail) {
        if (nkb < p.num_kb) {
          const SplitTail st(num_units, p.num_kb, gridDim.x);
          const int t = u - st.dp_end;  // part s of tail tile t: CTA s * tail + t
          auto slot = [&](int s) {
            return reinterpret_cast<float4*>(p.workspace) +
                   size_t(s * st.tail + t) * (kRegs / 4) * 256;
          };
          const int tid = threadIdx.x;  // 0..255: the math threads
          float4* mine = slot(blockIdx.x / st.tail);
#pragma unroll
          for (int v = 0; v < kRegs / 4; ++v)
            mine[v * 256 + tid] = make_float4(acc[0][4 * v], acc[0][4 * v + 1], acc[0][4 * v + 2],
                                              acc[0][4 * v + 3]);
          // One acq_rel atomic orders the CTA's part (the barrier before it puts every math
          // thread's stores before it) before the count and, for the last CTA, the other parts
          // before its reads (the barrier after it), as in the decode kernel's split reduction.
          volatile int* flag = reinterpret_cast<volatile int*>(smem + L::kFlag);
          named_barrier(3, 256);
          if (tid == 0) *flag = atom_add_acq_rel_gpu(&p.counters[u], 1) == st.parts - 1;
          named_barrier(3, 256);
          if (!*flag) continue;  // summed by another part's CTA
          // (its own part read back too: fewer registers live than keeping it aside)
          for (int s = 0; s < st.parts; ++s) {
            const float4* part = slot(s);
#pragma unroll
            for (int v = 0; v < kRegs / 4; ++v) {
              const float4 x = __ldcg(part + v * 256 + tid);
              if (s == 0) {
                acc[0][4 * v] = x.x, acc[0][4 * v + 1] = x.y;
                acc[0][4 * v + 2] = x.z, acc[0][4 * v + 3] = x.w;
              } else {
                acc[0][4 * v] += x.x, acc[0][4 * v + 1] += x.y;
                acc[0][4 * v + 2] += x.z, acc[0][4 * v + 3] += x.w;
              }
            }
          }
          if (tid == 0) p.counters[u] = 0;  // ready for the next launch (and graph replay)
        }
      }

      // ------------------------------------------------------------------------ epilogue
      const bool wg_leader = threadIdx.x % 128 == 0;
      if (wg_leader) tma_store_wait_read();  // the previous tile's store has left smem
      named_barrier(1 + wg, 128);
      // The tile into shared memory; with a bias its two values a column pair, fetched per
      // column (a literal at each call: without one, as for most LLM layers, no adds and no
      // per-column branch: the epilogue runs while the tensor cores wait)
      auto stage_tile = [&](const bool kBias) {
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
          uint8_t* my_out = sOut + wave_row(w) * BN * 2;  // BN/64 boxes of 64 rows
#pragma unroll
          for (int j = 0; j < kRegs / 4; ++j) {
            const int c = 8 * j + col_q;  // column inside the tile
            float b0 = 0.f, b1 = 0.f;
            const int n = nb * BN + c;
            if (kBias && n < p.N) {
              const float2 bb = load_bias2<OutT>(p.bias, p.bias_f32, n);
              b0 = bb.x;
              b1 = bb.y;
            }
            // box = kBoxCols columns x 64 rows. 64 columns (128 B rows): the 16-byte chunk
            // index XOR (row % 8) is the 128-byte swizzle; 32 columns (64 B rows): chunk XOR
            // ((row / 2) % 4), the 64-byte swizzle. Narrow tiles (BN = 16/32/48): one
            // unswizzled box.
            uint8_t* box = my_out + (c / kBoxCols) * 64 * kBoxCols * 2;
            const int chunk = (c % kBoxCols) / 8;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int r = row_in_wg + 8 * h;
              const float v0 = acc[w][4 * j + 2 * h], v1 = acc[w][4 * j + 2 * h + 1];
              const uint32_t v = kBias ? OutTraits<OutT>::pack(v0 + b0, v1 + b1)
                                       : OutTraits<OutT>::pack(v0, v1);
              if constexpr (L::kOneBox)
                *reinterpret_cast<uint32_t*>(box + r * BN * 2 + c * 2) = v;
              else if constexpr (kBoxCols == 32)
                *reinterpret_cast<uint32_t*>(box + r * 64 + ((chunk ^ ((r >> 1) & 3)) * 16) +
                                             (col_q * 2)) = v;
              else
                *reinterpret_cast<uint32_t*>(box + r * 128 + ((chunk ^ (r % 8)) * 16) +
                                             (col_q * 2)) = v;
            }
          }
        }
      };
      if (p.bias != nullptr) stage_tile(true);
      else stage_tile(false);
      fence_proxy_async_smem();
      named_barrier(1 + wg, 128);
      if (wg_leader && mb < num_m && nb < num_n) {
#pragma unroll
        for (int w = 0; w < kWaves; ++w)
#pragma unroll
          for (int cb = 0; cb < BN / kBoxCols; ++cb)
            tma_store_2d(&tmap_c, sOut + wave_row(w) * BN * 2 + cb * 64 * kBoxCols * 2,
                         nb * BN + cb * kBoxCols,
                         (kSplitTail || kGrouped ? mb * BM : tile_row0<BM>(mb, p.M)) +
                             wave_row(w));
        tma_store_commit();
      }
    }
    if (threadIdx.x % 128 == 0) tma_store_wait_all();
  }
  // No CTA may exit while its peer can still multicast into it or arrive on its barriers.
  if constexpr (CLUSTER > 1) cluster_sync();
}
#undef FP8L_TILE_WALK

}  // namespace fp8l
