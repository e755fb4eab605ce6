// The decode kernel's launch (shared memory plan, tensor maps, grid), one template for the
// dense instantiations (sm90/decode.cu) and the grouped expert ones (sm90/moe.cu).
#pragma once
#include <string>

#include "common/launch.h"
#include "common/tma.h"
#include "sm90/api.h"
#include "sm90/tables.h"
#include "sm90/decode_kernel.cuh"

namespace fp8l {
namespace decode_launch {

// Dynamic shared memory a CTA may use at one, two or three CTAs an SM (sm90/tables.def)
constexpr int smem_limit(int ctas_per_sm) {
  return ctas_per_sm == 1   ? kSmemOneCtaPerSm
         : ctas_per_sm == 2 ? kSmemTwoCtasPerSm
                            : kSmemThreeCtasPerSm;
}
// 128 KB of weights in flight per CTA (8 stages of 128 rows, 16 of 64) saturates HBM
constexpr int kMaxWeightBytesInFlight = 8 * kDecodeMaxRows * kBlockK;

inline int pick_stages(int rows, int bt, int kbs, bool per_row, bool fused, bool row_step, bool relay,
                int limit, bool row_tokens = false) {
  const DecodeLayout none =
      decode_layout(rows, bt, kbs, 0, per_row, fused, row_step, relay, row_tokens);
  // bytes one more stage costs: its ring slot and its barriers (two, or three with a relay)
  const int per_stage =
      decode_layout(rows, bt, kbs, 1, per_row, fused, row_step, relay, row_tokens).total -
      none.total + 16;
  const int max_stages = kMaxWeightBytesInFlight / (rows * kBlockK);
  int stages = (limit - none.total - 1024) / per_stage;
  stages = stages < max_stages ? stages : max_stages;
  stages = stages < kbs ? stages : kbs;  // never deeper than the work
  // 64 rows: the warpgroups take alternate K blocks, so with an even ring every stage belongs
  // to one warpgroup. With an odd one a stage alternates between them, and a warpgroup that
  // runs a lap ahead waits for the parity of a phase two ahead of the barrier's, which reads
  // as complete (mbarrier parity waits see one phase back): stale tiles, a broken ring.
  if (rows == 64 && kbs > 1) stages &= ~1;
  return stages;
}

// Weight stages a CTA keeps in flight (0: the whole ring). 128-row CTAs two an SM (or three)
// have the most weight bytes in flight an SM (two rings of ~96 KB), and every SM's requests
// queue in the memory system ahead of the loads each kernel's critical path waits for
// (activations, the quant kernel's reads, the split reduction): 2 stages (32 KB) a CTA keep
// HBM busy without that queue. Other plans lose with a window (docs/tuning.md:
// decode-weight-window).
// `forced` >= 0: the window a plan asked for (DecodeArgs::window; the MoE plans, tests).
inline int window_stages(int rows, int ctas_per_sm, int stages, int forced = -1) {
  const int w = forced >= 0 ? forced : rows == kDecodeMaxRows && ctas_per_sm >= 2 ? 2 : 0;
  return w < stages ? w : 0;
}

// Weight stages requested before the activations (0: the whole ring). Unsplit 64-row plans
// over up to 64 K blocks in one wave request 8 stages (64 KB a CTA), then the activations,
// then the rest of the ring: the activations, on the critical path once the previous kernel
// is done, would queue behind every weight request already issued. Other plans lose with it
// (docs/tuning.md: decode-first-stages).
inline int first_stages(int rows, int splits, int kbs, int ctas, int slots) {
  return rows == 64 && splits == 1 && kbs <= 64 && ctas <= slots ? 8 : 0;
}

// 64-row CTAs two an SM with split K (the 15-17 MB weights: 2112x7168, 4096^2) relay their
// weights (kRelay) with 4 stages (32 KB) in flight: the window from the start, while the
// previous kernel runs, without holding the activations back. Unsplit 64-row plans lose with
// it, hence split K only (docs/tuning.md: decode-relay).
inline bool relay_plan(int rows, int ctas_per_sm, int splits) {
  return rows == 64 && ctas_per_sm == 2 && splits > 1;
}
// (the relay needs 1 <= window < stages: see the kernel)
inline int relay_stages(int stages) {
  constexpr int kRelayStages = 4;
  return kRelayStages < stages ? kRelayStages : stages > 1 ? stages - 1 : 1;
}

template <int BT, int kRows, bool kPerRow, typename OutT, int kCtasPerSM, bool kRowStep,
          bool kRelay, bool kGrouped = false, bool kSlots = false>
std::string launch(const DecodeArgs& d, cudaStream_t stream) {
  constexpr int kSmemLimit = smem_limit(kCtasPerSM);
  const int num_kb = (d.K + kBlockK - 1) / kBlockK;
  const int kbs = (num_kb + d.splits - 1) / d.splits;
  const bool fused = d.x_dtype != kInFP8;
  const bool row_tokens = decode_row_tokens(kGrouped, kSlots, fused);
  const int stages =
      pick_stages(kRows, BT, kbs, kPerRow, fused, kRowStep, kRelay, kSmemLimit, row_tokens);
  const DecodeLayout layout =
      decode_layout(kRows, BT, kbs, stages, kPerRow, fused, kRowStep, kRelay, row_tokens);
  if (stages < 1 || (kRows == 64 && kbs > 1 && stages < 2) || layout.total + 1024 > kSmemLimit)
    return "decode config does not fit in shared memory (token tile " + std::to_string(BT) +
           ", " + std::to_string(kbs) + " K blocks per split): use more splits";
  const int smem = layout.total + 1024;
  // 64 rows: the warpgroups' exchange, BT / 2 floats a thread, passes through the ring
  if (kRows == 64 && BT * 128 * 2 > stages * layout.stage)
    return "the warpgroups' partials do not fit in the ring (64 rows)";
  // kRowStep: the CTA owns d.rows < 128 rows (a multiple of 8), loaded as a box of that many
  const int row_step = kRowStep ? d.rows : kRows;
  CUtensorMap tw;
  // (grouped: the experts' weights [E, N, K] as one [E * N, K] matrix)
  std::string e = make_tensor_map_2d(&tw, d.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1,
                                     uint64_t(d.N) * (kGrouped ? d.experts : 1), d.K, d.K,
                                     row_step, kBlockK, CU_TENSOR_MAP_SWIZZLE_128B);
  if (!e.empty()) return e;
  // fp8 activations: tiles swizzled for wgmma (fused, the kernel reads the 16-bit rows itself)
  CUtensorMap tx{};
  if (!fused &&
      !(e = make_tensor_map_2d(&tx, d.x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, d.M, d.K, d.K, BT,
                               kBlockK, CU_TENSOR_MAP_SWIZZLE_128B)).empty())
    return e;
  constexpr auto kernel =
      fp8_decode_kernel<BT, kRows, kPerRow, OutT, kCtasPerSM, kRowStep, kRelay, kGrouped, kSlots>;
  cudaError_t err = ensure_smem_limit<kernel>(smem);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  // (kSlots: a tile a (token, slot) pair)
  const dim3 grid((d.N + row_step - 1) / row_step, kSlots ? d.M : (d.M + BT - 1) / BT, d.splits);
  // (first_stages leaves out the row-step CTAs, 128 rows, and the relaying ones, split K)
  DecodeParams p{d.x,         d.x_dtype,     kSlots ? d.top_k : d.route_top_k,
                 {d.x_scale},  d.xs_stride_m, d.xs_stride_kb, d.w_scale, {d.bias}, d.bias_f32,
                 d.ids_int64 != 0, d.ids_ready != 0, d.silu_in != 0, d.experts, d.out, d.workspace,
                 d.counters,  d.M,           d.N,  d.K,  num_kb,  d.splits,  stages,
                 d.pdl && d.early_trigger ? 1 : 0, {row_step},
                 kRelay ? relay_stages(stages) : window_stages(kRows, kCtasPerSM, stages, d.window),
                 first_stages(kRows, d.splits, kbs, grid.x * grid.y, kCtasPerSM * d.num_sms),
                 d.tile_expert};
  // the unions' other members (DecodeParams): the grouped kernels take no bias
  if (kGrouped) p.route_ids = d.route_ids;
  if (kGrouped && !kSlots) p.route_slots = d.route_slots;
  if (row_tokens) p.row_token = d.row_token;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(decode_threads(kCtasPerSM));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  int n_attr = 0;
  if (d.pdl) attr[n_attr++] = pdl_attribute();
  cfg.attrs = attr;
  cfg.numAttrs = n_attr;
  err = cudaLaunchKernelEx(&cfg, kernel, tw, tx, p);
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace decode_launch
}  // namespace fp8l
