// Skinny (decode) block-scaled FP8 GEMM for sm_90a, bound by reading the weights once.
//
// Swap-AB: a CTA owns kRows weight rows (wgmma's M side) and a tile of BT tokens (wgmma's N
// side, 8..128), so no tensor-core work pads a handful of tokens up to 64 rows. 128 rows: the
// two math warpgroups take 64 each; 64 rows (twice the CTAs for the same weights, so fewer K
// splits): the two warpgroups take alternate K blocks of the same rows and add their partials
// in shared memory. Split-K: blockIdx.z takes a contiguous range of 128-wide K blocks, so
// every SM streams weights even when N is small.
//   producer warp:   TMA of 128x128 weight tiles into a `stages`-deep ring (evict-first: read
//                    once), started before griddepcontrol.wait so it overlaps the previous
//                    kernel's tail under programmatic dependent launch;
//   math warpgroups: (fused) quantize this CTA's whole activation slice, bf16 -> fp8 +
//                    per-token scales (the numerics of fp8linear.quant.quantize_activation), into a
//                    resident shared-memory tile per K block, all 8 warps at once while the
//                    weight ring fills; then per K block: 4 wgmmas, promotion with weight-row
//                    x token scales.
// Reduction over splits is deterministic, in split order: every split writes its partial to
// an fp32 workspace; the last CTA to arrive at the tile's counter sums them.
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda.h>

#include "common/ptx.cuh"
#include "common/wgmma.cuh"
#include "sm90/api.h"  // kIn* codes
#include "sm90/moe_route.cuh"
#include "sm90/operands.cuh"
#include "sm90/quant.cuh"

namespace fp8l {

constexpr int kDecodeMaxRows = 128;  // weight rows per CTA: 128, or 64

// Threads a CTA: two math warpgroups and a producer warpgroup; three CTAs an SM (the slot
// tiles, moe-slot-three) keep one producer warp, so that 72 registers a thread fit.
__host__ __device__ constexpr int decode_threads(int ctas_per_sm) {
  return ctas_per_sm == 3 ? 288 : 384;
}

// Whether the CTA reads its sorted rows' tokens itself (grouped sorted tiles of 16-bit x:
// row_token or the ids, DecodeParams), and so keeps their tokens in shared memory (the
// layout's `tok`): host and kernel agree through this one test.
__host__ __device__ constexpr bool decode_row_tokens(bool grouped, bool slots, bool fused) {
  return grouped && !slots && fused;
}

struct DecodeLayout {
  int stage, x, xs, ws, bar, flag, tok, total;
};
// Shared-memory layout (bytes from a 1024-aligned base); host and device agree on it.
// Each ring stage carries its K block's weight tile and (fp8 input) its activation tile,
// swizzled for wgmma; fused, the quantized activations stay resident after the ring, one
// [BT x 128] fp8 tile per K block of the CTA's range.
__host__ __device__ inline DecodeLayout decode_layout(int rows, int bt, int kbs, int stages,
                                                      bool per_row, bool fused,
                                                      bool row_step = false, bool relay = false,
                                                      bool row_tokens = false) {
  DecodeLayout l;
  l.stage = rows * kBlockK + (fused ? 0 : bt * kBlockK);  // multiples of 1024 (bt >= 8)
  l.x = stages * l.stage;
  l.xs = l.x + (fused ? kbs * bt * kBlockK : 0);
  l.ws = l.xs + kbs * bt * 4;            // per-token scales [kbs][BT]
  // weight scales [kbs][rows] per row, or [kbs][1 or 2] of the 128-row block(s) the rows lie in
  l.bar = l.ws + kbs * (per_row ? rows : row_step ? 2 : 1) * 4;
  l.bar = (l.bar + 7) & ~7;
  l.flag = l.bar + (relay ? 3 : 2) * stages * 8;  // full, empty (and relay: landed)[stages]
  l.tok = l.flag + 16;  // row_tokens: the token of each of the tile's rows [BT]
  l.total = l.tok + (row_tokens ? bt * 4 : 0);
  return l;
}

// (128 bytes: the slot tiles' fields fill the padding, as a larger struct changes the code
// the compiler makes of every instantiation)
struct DecodeParams {
  const void* x;
  int x_dtype;           // kInBF16 / kInFP16, or kInFP8 (already quantized; scales in x_scale)
  int top_k;             // kSlots (below)
  union {
    const float* x_scale;  // scale of (m, kb) at x_scale[m * xs_stride_m + kb * xs_stride_kb]
    const long long* row_token;  // kGrouped sorted, 16-bit x: each sorted row's token (below)
  };
  int xs_stride_m, xs_stride_kb;
  const float* w_scale;
  union {
    const void* bias;    // output dtype, or fp32 (bias_f32: added without rounding first)
    const void* route_ids;  // kGrouped (no bias): route_slots (below)
  };
  bool bias_f32;
  bool ids_int64, ids_ready, silu_in;  // kSlots; ids_int64 also route_slots (below)
  int experts;           // kSlots, route_slots (below)
  void* out;
  float* workspace;
  int* counters;
  int M, N, K, num_kb, splits, stages;
  int early_trigger;     // PDL: let the next kernel launch at our start, not after the prologue
  union {
    int row_step;        // kRowStep: the weight rows a CTA owns, 72..120 (a multiple of 8), so
                         // that N / row_step CTAs fill the SMs (backends/sm90/plan.py: _decode_rows)
    int route_slots;     // kGrouped sorted tiles (below)
  };
  int window;            // weight stages in flight at most (0: the whole ring; kRelay: 1 ..
                         // stages - 1; decode.cu)
  int first_stages;      // weight stages requested before the activations at most (0: the ring)
  // kGrouped (mixture of experts): the weights are [E * N, K], the scales [E, ...] likewise,
  // and token tile y runs expert tile_expert[y] (-1: an unused tile, the CTA exits)
  // kSlots (few tokens, no routing): tile y is (token, slot) pair y alone, y / top_k its token,
  // its expert topk_ids[y] (tile_expert points at topk_ids, int64 where ids_int64; ids outside
  // 0..experts-1 leave the row unwritten); ids_ready: written before the previous kernel (else
  // read after griddepcontrol.wait). silu_in: x holds [M, 2K] gate | up rows of this tile's
  // pair, SiLU-and-mul before the quantization.
  // Sorted tiles, route_slots > 0: route_ids holds the route_slots (token, slot) expert ids
  // (int64 where ids_int64), written before the previous kernel, and the first wave's CTAs
  // find their tile's expert from them (tile_expert_from_ids), so that their weights stream
  // before the routing kernel is done; later CTAs, starting after it, read tile_expert.
  // Sorted tiles, 16-bit x (the tokens [M', K], not sorted rows): row r of the sorted rows is
  // token row_token[r] (-1: padding), read and quantized in the kernel (no gather); with
  // route_slots, top_k the slots a token and the first wave finds its rows' tokens from the ids
  // too, reading x before griddepcontrol.wait (written before the routing's first kernel).
  const int* tile_expert;
};
static_assert(sizeof(DecodeParams) == 128, "see above");

// kRowStep: a 128-row CTA owning only p.row_step rows (a box of that many lands in its stage;
// the other rows' results are never stored), its own instantiation so that every other plan
// runs exactly the code it ran before (these kernels move by 1-2% on small changes).
// kRelay: weights land on their own barriers (`landed`), and the weight warp, keeping at most
// p.window stages in flight, passes each landed stage on to `full` (one arrival); activations
// (fp8 input) come from a second producer warp straight onto `full`. So the weights stream at
// the window's pace while the previous kernel runs, and the math warps still wait on one
// barrier a stage (a second wait there cost 2-11%; docs/tuning.md: decode-relay).
// kGrouped: the grouped expert GEMM of a mixture-of-experts layer (sm90/moe.cu): each token
// tile belongs to one expert, whose weight rows and scales the CTA reads; fp8 input.
// kSlots (with kGrouped): one (token, slot) pair a tile, read and quantized in the kernel, no
// routing (DecodeParams); 16-bit input.
template <int BT, int kRows, bool kPerRow, typename OutT, int kCtasPerSM, bool kRowStep,
          bool kRelay = false, bool kGrouped = false, bool kSlots = false>
__global__ void __launch_bounds__(decode_threads(kCtasPerSM), kCtasPerSM)
    fp8_decode_kernel(const __grid_constant__ CUtensorMap tmap_w,
                      const __grid_constant__ CUtensorMap tmap_x,  // fp8 activations (kInFP8)
                      const DecodeParams p) {
  static_assert(!kGrouped || (!kRowStep && !kRelay), "grouped: plain 128/64-row CTAs");
  static_assert(!kSlots || kGrouped, "slot tiles are grouped");
  // (grouped) this tile's expert: its first row in the [E * N, K] weights and its scales.
  // The routing that wrote tile_expert finished before the kernel before us let us launch.
  extern __shared__ uint8_t smem_raw[];
  // aligned as an offset into smem_raw, so that the pointers stay shared ones (LDS; see
  // gemm_kernel.cuh)
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const bool fused = p.x_dtype != kInFP8;
  const bool row_tokens = decode_row_tokens(kGrouped, kSlots, fused);
  const DecodeLayout L = decode_layout(kRows, BT, (p.num_kb + p.splits - 1) / p.splits,
                                       p.stages, kPerRow, fused, kRowStep, kRelay, row_tokens);
  int* tokens = reinterpret_cast<int*>(smem + L.tok);
  int live_rows = 0;           // row_tokens: the tile's rows that hold a token
  bool x_ready = false;        // x written before the routing (no wait before reading it)
  int wrow0 = 0;
  const float* w_scale = p.w_scale;
  if constexpr (kGrouped) {
    int e;
    if constexpr (kSlots) {
      if (!p.ids_ready) pdl_wait();  // (the weights stream once the ids are known)
      const long long id = p.ids_int64
                               ? __ldg(reinterpret_cast<const long long*>(p.tile_expert) + blockIdx.y)
                               : __ldg(p.tile_expert + blockIdx.y);
      e = id >= 0 && id < p.experts ? int(id) : -1;
    } else if (p.route_slots > 0 && first_wave_cta<kCtasPerSM>()) {
      const RouteIds ids{p.route_ids, p.ids_int64, p.route_slots, p.experts, p.top_k};
      e = tile_expert_from_ids<BT>(ids, reinterpret_cast<int*>(smem),
                                   row_tokens ? tokens : nullptr, &live_rows);
      x_ready = row_tokens;
    } else {
      // (route_slots: a later CTA starts as an earlier one ends, the routing done by then)
      if (p.route_slots > 0) pdl_wait();
      e = __ldg(p.tile_expert + blockIdx.y);
      if (row_tokens) {  // (padding rows last: the live ones are those before the first -1)
        const int tok = threadIdx.x < BT ? int(__ldg(p.row_token + blockIdx.y * BT + threadIdx.x))
                                         : -1;
        if (threadIdx.x < BT) tokens[threadIdx.x] = tok;
        live_rows = __syncthreads_count(tok >= 0);
      }
    }
    if (e < 0) return;
    wrow0 = e * p.N;
    w_scale += size_t(e) * (kPerRow ? p.N : (p.N + kDecodeMaxRows - 1) / kDecodeMaxRows) *
               p.num_kb;
  }
  // this CTA's K range: splits as even as possible, the first `rem` one block longer
  const int base = p.num_kb / p.splits, rem = p.num_kb % p.splits;
  const int split = blockIdx.z;
  const int kb0 = split * base + min(split, rem);
  const int kbs = base + (split < rem ? 1 : 0);
  // 64 rows: warpgroup w takes the K blocks i = w mod 2 of the range (its own wgmma chain)
  constexpr bool kSplitWG = kRows == 64;
  static_assert(kRows == 128 || (kRows == 64 && BT <= 64), "64-row CTAs: token tiles <= 64");
  constexpr int kWTile = kRows * kBlockK;  // bytes of one weight stage
  uint8_t* sW = smem;            // stage s at sW + s * L.stage: weights, then (fp8) activations
  uint8_t* sX = smem + L.x;      // fused: resident quantized tiles, K block i at i * BT * 128
  float* sXS = reinterpret_cast<float*>(smem + L.xs);
  float* sWS = reinterpret_cast<float*>(smem + L.ws);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L.bar);
  uint64_t* empty = full + p.stages;
  uint64_t* landed = empty + p.stages;  // (kRelay) the stage's weights have landed
  int* flag = reinterpret_cast<int*>(smem + L.flag);

  static_assert(!kRowStep || (kRows == 128 && kCtasPerSM == 1), "row steps: 128-row CTAs");
  const int row_step = kRowStep ? p.row_step : kRows;
  const int n0 = blockIdx.x * row_step;
  // (kSlots: the output row of the tile's one pair, whose token row the fused quantization reads)
  const int m0 = kSlots ? blockIdx.y : blockIdx.y * BT;
  const int wg = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      // (kRelay, fp8 input: the weight warp's relay and the activation warp's expect_tx)
      mbar_init(&full[s], kRelay && !fused ? 2 : 1);
      mbar_init(&empty[s], kSplitWG ? 4 : 8);  // the math warps that read stage s
      if constexpr (kRelay) mbar_init(&landed[s], 1);
    }
    fence_barrier_init();
    tma_prefetch_desc(&tmap_w);
    if (!fused) tma_prefetch_desc(&tmap_x);  // (unset when fused)
  }
  __syncthreads();
  // The next kernel waits for our completion (griddepcontrol.wait) before it reads our output,
  // so letting it launch early is always safe: its CTAs only take the SM room ours leave.
  if (p.early_trigger) pdl_launch_dependents();

  if (wg == 2) {
    // ------------------------------------------------------------------ producer warpgroup
    if constexpr (kCtasPerSM == 1) reg_dealloc<40>();
    if (kRelay && warp == 8 && elect_one()) {
      // Weights are not written by the previous kernel: streamed from the start, p.window
      // stages ahead of the last one that landed (stage j is handed on once j + window is due:
      // the consumers never wait for a hand-on they could not get, as window < stages).
      const uint64_t once = l2_policy_evict_first();
      const uint32_t wbytes = kRowStep ? row_step * kBlockK : kWTile;
      auto hand_on = [&](int j) {
        mbar_wait(&landed[j % p.stages], (j / p.stages) & 1);
        mbar_arrive(&full[j % p.stages]);
      };
      for (int i = 0; i < kbs; ++i) {
        const int s = i % p.stages;
        mbar_wait(&empty[s], ((i / p.stages) & 1) ^ 1);
        if (i >= p.window) hand_on(i - p.window);
        mbar_arrive_expect_tx(&landed[s], wbytes);
        tma_load_2d(sW + s * L.stage, &tmap_w, &landed[s], (kb0 + i) * kBlockK, n0, once);
      }
      for (int j = kbs > p.window ? kbs - p.window : 0; j < kbs; ++j) hand_on(j);
    } else if (kRelay && warp == 9 && !fused && elect_one()) {
      // the activation tiles, written by the previous kernel (rows past M read as zero)
      const uint64_t keep = l2_policy_evict_last();  // read by every row CTA
      pdl_wait();
      for (int i = 0; i < kbs; ++i) {
        const int s = i % p.stages;
        mbar_wait(&empty[s], ((i / p.stages) & 1) ^ 1);
        mbar_arrive_expect_tx(&full[s], BT * kBlockK);
        tma_load_2d(sW + s * L.stage + kWTile, &tmap_x, &full[s], (kb0 + i) * kBlockK, m0,
                    keep);
      }
    } else if (!kRelay && warp == 8 && elect_one()) {
      // Weights are not written by the previous kernel: stream them before griddepcontrol.wait.
      const uint64_t once = l2_policy_evict_first();
      const uint64_t keep = l2_policy_evict_last();  // activations: read by every row CTA
      // (with a window, only its stages go out before the activations: the pacing below
      // waits for stage i - window, whose activations must be requested by then)
      int first = kbs < p.stages ? kbs : p.stages;
      if (p.window > 0 && p.window < first) first = p.window;
      if (p.first_stages > 0 && p.first_stages < first) first = p.first_stages;
      // (a CTA of fewer rows than kRows loads a row_step-row box; the stage's other rows are
      // stale, and their results are never stored)
      const uint32_t bytes = kRowStep ? row_step * kBlockK + (fused ? 0 : BT * kBlockK) : L.stage;
      for (int i = 0; i < kbs; ++i) {
        const int s = i % p.stages;
        mbar_wait(&empty[s], ((i / p.stages) & 1) ^ 1);
        if (p.window > 0 && i >= p.window) {
          // at most p.window stages in flight: wait for stage i - window to land
          const int j = i - p.window;
          mbar_wait(&full[j % p.stages], (j / p.stages) & 1);
        }
        mbar_arrive_expect_tx(&full[s], bytes);
        tma_load_2d(sW + s * L.stage, &tmap_w, &full[s], (kb0 + i) * kBlockK, wrow0 + n0, once);
        if (fused) continue;  // the math warps read and quantize the activations themselves
        if (i == first - 1) {
          // The first stages' weights are on their way; the activations were written by the
          // previous kernel, so wait for it before loading them (rows past M read as zero).
          pdl_wait();
          for (int j = 0; j < first; ++j)
            tma_load_2d(sW + j * L.stage + kWTile, &tmap_x, &full[j],
                        (kb0 + j) * kBlockK, m0, keep);
        } else if (i >= first) {
          tma_load_2d(sW + s * L.stage + kWTile, &tmap_x, &full[s], (kb0 + i) * kBlockK,
                      m0, keep);
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------------ math warpgroups
  // (two CTAs an SM: 80 registers a thread suffice for token tiles <= 32, no reallocation)
  if constexpr (kCtasPerSM == 1) reg_alloc<232>();
  const int tid = threadIdx.x;  // 0..255
  // the weight scales of this K range: not written by the previous kernel, so loaded before
  // waiting for it
  if constexpr (kPerRow) {
    for (int e = tid; e < kbs * kRows; e += 256) {
      const int i = e / kRows, r = e % kRows;
      sWS[e] = n0 + r < p.N ? __ldg(w_scale + size_t(n0 + r) * p.num_kb + kb0 + i) : 0.f;
    }
  } else {
    if constexpr (kRowStep) {
      // the scales of the two 128-row blocks the CTA's rows may straddle: [kbs][2]
      const int num_nblk = (p.N + kDecodeMaxRows - 1) / kDecodeMaxRows;
      for (int e = tid; e < 2 * kbs; e += 256) {
        const int blk = n0 / kDecodeMaxRows + e % 2;
        sWS[e] = blk < num_nblk ? __ldg(p.w_scale + size_t(blk) * p.num_kb + kb0 + e / 2) : 0.f;
      }
    } else {
      for (int i = tid; i < kbs; i += 256)
        sWS[i] = __ldg(w_scale + size_t(n0 / kDecodeMaxRows) * p.num_kb + kb0 + i);
    }
  }
  if (!x_ready) pdl_wait();     // activations come from the previous kernel
  if (fused) {
    // The CTA's activation slice, quantized once into resident tiles while the producer fills
    // the weight ring: (token, K block) groups of 128 channels spread over the 8 warps.
    // Padding tokens' rows and scales are zero.
    const int live = kSlots ? 1 : row_tokens ? live_rows : min(BT, p.M - m0);
    for (int e = tid; e < (BT - live) * kbs * 8; e += 256) {  // 16-byte chunks of padding rows
      const int row = e / 8, t = live + row % (BT - live), i = row / (BT - live);
      uint8_t* chunk = sX + (i * BT + t) * kBlockK + (e % 8) * 16;
      *reinterpret_cast<uint4*>(chunk) = make_uint4(0, 0, 0, 0);
    }
    for (int e = tid; e < (BT - live) * kbs; e += 256)
      sXS[(e / (BT - live)) * BT + live + e % (BT - live)] = 0.f;
    const uint16_t* xr = static_cast<const uint16_t*>(p.x);
    const bool fp16 = p.x_dtype == kInFP16;
    const int groups = live * kbs;
    // A group's 128 channels are a half-warp's 16-byte loads (8 channels a lane): one load
    // instruction of a warp serves two groups, a batch of kLoads loads 16 x kLoads groups of
    // the CTA, all in flight at once. Issued while the weight ring streams, each batch waits
    // behind the queued weight tiles (2-4 us; a probe whose log was lost), so few batches keep
    // the prologue short. (16 loads a lane at one CTA an SM: ~1 us slower at M = 1-2, ditto.)
    // Three CTAs an SM: 4 (8 spill at 72 registers), each group its own scale below.
    constexpr int kLoads = kCtasPerSM == 3 ? 4 : 8;
    const int half = lane / 16, hl = lane % 16;
    for (int gw = warp; gw < groups; gw += 16 * kLoads) {  // warp-uniform (shuffles)
      const int g0 = gw + 8 * half;
      uint4 bits[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int g = g0 + 16 * u, t = g / kbs, k = (kb0 + g % kbs) * kBlockK + hl * 8;
        bits[u] = make_uint4(0, 0, 0, 0);  // channels past K (K % 16 == 0: a lane's 8 are
                                           // all in or all out)
        if constexpr (kSlots) {  // (t == 0: the pair's one row)
          if (g < groups && k < p.K) {
            if (p.silu_in) {
              const uint16_t* row = xr + size_t(m0) * 2 * p.K + k;
              bits[u] = silu_mul8(*reinterpret_cast<const uint4*>(row),
                                  *reinterpret_cast<const uint4*>(row + p.K), fp16);
            } else {
              bits[u] = *reinterpret_cast<const uint4*>(xr + size_t(m0 / p.top_k) * p.K + k);
            }
          }
        } else if (g < groups && k < p.K) {
          const size_t row = row_tokens ? size_t(tokens[t]) : size_t(m0 + t);
          bits[u] = *reinterpret_cast<const uint4*>(xr + row * p.K + k);
        }
      }
      // The quant kernel's numerics (quant.cuh: amax over the group, scale = amax / 448, x /
      // scale rounded to e4m3) in fewer instructions, as this runs after griddepcontrol.wait,
      // on the critical path back to back: the amax on the 16-bit bits (max.u16x2 of the
      // magnitudes), two groups a word through the half-warp's shuffle reduction; and where a
      // lane has 4 or more live groups, one scale division a lane (lane hl: group hl % 8 of
      // the batch) shared by shuffles instead of one a group (with fewer, the shuffles'
      // latency costs more than the divisions they save).
      // Row t of a K block's [BT x 128] tile, 128B-swizzled like a TMA box: chunk c at
      // c ^ (t % 8); a lane's 8 bytes are half of chunk hl / 2.
      uint32_t amax2[kLoads / 2];  // groups 2i (low half) and 2i + 1 (high half)
#pragma unroll
      for (int i = 0; i < kLoads / 2; ++i) {
        const uint32_t a = amax_bits8(bits[2 * i]), b = amax_bits8(bits[2 * i + 1]);
        amax2[i] = max_u16x2(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632));
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1)
#pragma unroll
        for (int i = 0; i < kLoads / 2; ++i)
          amax2[i] = max_u16x2(amax2[i], __shfl_xor_sync(0xffffffffu, amax2[i], o));
      auto amax_of = [&](int u) {  // (u: a literal once unrolled)
        return bits16_to_float((u & 1) ? amax2[u / 2] >> 16 : amax2[u / 2], fp16);
      };
      auto emit = [&](int u, const GroupScale& gs) {
        const int g = g0 + 16 * u, t = g / kbs, i = g % kbs;
        float v[8];
        unpack8(bits[u], fp16, v);
        uint2 packed;
        quantize<8>(v, gs, &packed.x);
        *reinterpret_cast<uint2*>(sX + (i * BT + t) * kBlockK + (((hl / 2) ^ (t % 8)) * 16) +
                                  (hl % 2) * 8) = packed;
        if (hl == 0) sXS[i * BT + t] = gs.scale();
      };
      auto emit_each = [&] {  // one scale division a group
#pragma unroll
        for (int u = 0; u < kLoads; ++u)
          if (g0 + 16 * u < groups) emit(u, group_scale(amax_of(u)));
      };
      if constexpr (kLoads != 8) {
        emit_each();
      } else if (gw + 8 + 16 * 3 < groups) {  // warp-uniform: every lane has >= 4 live groups
        const int j = hl % 8;
        const uint32_t wj = (j & 4) ? ((j & 2) ? amax2[3] : amax2[2])
                                    : ((j & 2) ? amax2[1] : amax2[0]);
        const GroupScale mine = group_scale(bits16_to_float((j & 1) ? wj >> 16 : wj, fp16));
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int src = (lane & 16) | u;
          const GroupScale gs = {__shfl_sync(0xffffffffu, mine.div, src),
                                 __shfl_sync(0xffffffffu, mine.rcp, src)};
          if (g0 + 16 * u < groups) emit(u, gs);
        }
      } else {
        emit_each();
      }
    }
  } else {
    // the tiles come by TMA with the weights; the scales here
    for (int e = tid; e < BT * kbs; e += 256) {
      const int t = e % BT, i = e / BT, m = m0 + t;
      sXS[e] = m < p.M ? p.x_scale[size_t(m) * p.xs_stride_m + size_t(kb0 + i) * p.xs_stride_kb]
                       : 0.f;
    }
  }
  fence_proxy_async_smem();  // the fp8 tiles are read by wgmma (async proxy)
  named_barrier(1, 256);
  if (!p.early_trigger) pdl_launch_dependents();  // the next kernel may stream its weights

  // 2. main loop
  using Mma = WgmmaFp8<BT>;
  constexpr int kRegs = Mma::kRegs;
  float acc[kRegs], part[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) acc[i] = 0.f;
  const int r0 = (warp % 4) * 16 + lane / 4;  // accumulator rows r0, r0 + 8 (weight rows)
  const int cq = 2 * (lane % 4);              // accumulator cols 8j + cq, +1 (tokens)
  const int wrow = kSplitWG ? 0 : wg * 64;    // this warpgroup's first row of the CTA's
  // kRowStep: the block-scale slot (the CTA's first or second 128-row block) of rows r0, r0 + 8
  const int blk0 = kRowStep ? (n0 + wrow + r0) / kDecodeMaxRows - n0 / kDecodeMaxRows : 0;
  const int blk1 = kRowStep ? (n0 + wrow + r0 + 8) / kDecodeMaxRows - n0 / kDecodeMaxRows : 0;
  for (int i = kSplitWG ? wg : 0; i < kbs; i += kSplitWG ? 2 : 1) {
    const int s = i % p.stages;
    mbar_wait(&full[s], (i / p.stages) & 1);
    const uint64_t da = make_smem_desc_sw128(sW + s * L.stage + wrow * kBlockK);
    const uint64_t db = make_smem_desc_sw128(fused ? sX + i * BT * kBlockK
                                                   : sW + s * L.stage + kWTile);
#pragma unroll
    for (int r = 0; r < kRegs; ++r) fence_operand(part[r]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 32; ++kk) Mma::mma(part, da + 2 * kk, db + 2 * kk, kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int r = 0; r < kRegs; ++r) fence_operand(part[r]);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
    float w0, w1;
    if constexpr (kPerRow) {
      w0 = sWS[i * kRows + wrow + r0];
      w1 = sWS[i * kRows + wrow + r0 + 8];
    } else if constexpr (kRowStep) {
      w0 = sWS[2 * i + blk0];
      w1 = sWS[2 * i + blk1];
    } else {
      w0 = w1 = sWS[i];
    }
    promote_scaled(acc, part, w0, w1, sXS + i * BT, cq);
  }

  // 64 rows: warpgroup 0 adds warpgroup 1's partial (same rows, alternate K blocks), passed
  // through the ring (free once both have read their last stage), and alone writes the result
  // below; warpgroup 1 still takes part in the barriers and the final reductions.
  const bool writer = !kSplitWG || wg == 0;
  if constexpr (kSplitWG) {
    float* x = reinterpret_cast<float*>(smem) + (tid % 128);  // [kRegs][128 threads]
    named_barrier(1, 256);
    if (wg == 1) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) x[r * 128] = acc[r];
    }
    named_barrier(1, 256);
    if (wg == 0) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) acc[r] += x[r * 128];
    }
  }

  // (x_ready: our completion tells the kernels after us that the routing is done too)
  if (x_ready) pdl_wait();
  // 3. epilogue
  OutT* out = static_cast<OutT*>(p.out);
  const OutT* bias = kGrouped ? nullptr : static_cast<const OutT*>(p.bias);
  auto bias_at = [&](int n) {
    return p.bias_f32 ? static_cast<const float*>(p.bias)[n] : to_f(bias[n]);
  };
  if (p.splits == 1) {
    if (!writer) return;
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wrow + r0 + (e >= 2 ? 8 : 0);
        const int n = n0 + r;
        const int c = 8 * j + cq + (e & 1), m = m0 + c;
        if (m < p.M && n < p.N && (!kRowStep || r < row_step) && (!kSlots || c == 0)) {
          const float b = bias != nullptr ? bias_at(n) : 0.f;
          out[size_t(m) * p.N + n] = OutTraits<OutT>::from(acc[4 * j + e] + b);
        }
      }
    }
    return;
  }
  // 4 consecutive weight rows (n, N % 8: all 4 or none) of token row c of the tile, reduced
  auto store4 = [&](int e4, float4 sum) {
    const int e = e4 * 4;
    const int c = e / kRows, r = e % kRows;
    const int m = m0 + c, n = n0 + r;
    // (row_step % 8 == 0: 4 rows all in or all out)
    if (m >= p.M || n >= p.N || (kRowStep && r >= row_step) || (kSlots && c > 0)) return;
    float o[4] = {sum.x, sum.y, sum.z, sum.w};
    if (bias != nullptr) {
#pragma unroll
      for (int q = 0; q < 4; ++q) o[q] += bias_at(n + q);
    }
    uint2 packed;
    packed.x = OutTraits<OutT>::pack(o[0], o[1]);
    packed.y = OutTraits<OutT>::pack(o[2], o[3]);
    *reinterpret_cast<uint2*>(out + size_t(m) * p.N + n) = packed;
  };
  constexpr int kTile4 = BT * kRows / 4;  // float4s of a partial tile
  // this split's partial tile [BT tokens][kRows] into dst (shared or global memory)
  auto write_partial = [&](float* dst) {
    if (!writer) return;
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dst[(8 * j + cq + (e & 1)) * kRows + wrow + r0 + (e >= 2 ? 8 : 0)] = acc[4 * j + e];
    }
  };
  const int tiles = gridDim.x * gridDim.y;
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  write_partial(p.workspace + (size_t(split) * tiles + tile) * BT * kRows);
  // One acq_rel atomic orders the CTA's partial (the barrier before it makes every thread's
  // stores precede it) before the count, and, for the last CTA, the other splits' partials
  // before its reads (the barrier after it): no fence from every thread.
  named_barrier(1, 256);
  if (tid == 0) *flag = atom_add_acq_rel_gpu(&p.counters[tile], 1) == p.splits - 1;
  named_barrier(1, 256);
  if (!*flag) return;
  // Sum the splits in split order (bitwise deterministic). float4 loads, kUnroll x 4 of them
  // in flight per thread: the partials sit in L2, and one round trip per element would add
  // microseconds to every decode step.
  constexpr int kUnroll = 2;
  const float4* parts = reinterpret_cast<const float4*>(p.workspace) + size_t(tile) * kTile4;
  const size_t split_stride4 = size_t(tiles) * kTile4;
  for (int base = tid; base < kTile4; base += 256 * kUnroll) {
    float4 sum[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) sum[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < p.splits; s0 += 4) {
      float4 v[4][kUnroll];
#pragma unroll
      for (int ds = 0; ds < 4; ++ds)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int e4 = base + 256 * u;
          v[ds][u] = s0 + ds < p.splits && e4 < kTile4
                         ? __ldcg(parts + (s0 + ds) * split_stride4 + e4)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
      for (int ds = 0; ds < 4; ++ds)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          sum[u].x += v[ds][u].x; sum[u].y += v[ds][u].y;
          sum[u].z += v[ds][u].z; sum[u].w += v[ds][u].w;
        }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 256 * u < kTile4) store4(base + 256 * u, sum[u]);
  }
  if (tid == 0) p.counters[tile] = 0;  // ready for the next launch (and graph replay)
}

}  // namespace fp8l
