// Instantiations and launch of the decode kernel (decode_kernel.cuh).
#include "common/launch.h"
#include "common/tma.h"
#include "sm90/api.h"
#include "sm90/tables.h"
#include "sm90/decode_kernel.cuh"

namespace fp8l {
namespace {

// Dynamic shared memory a CTA may use at one or two CTAs an SM (sm90/tables.def)
constexpr int smem_limit(int ctas_per_sm) {
  return ctas_per_sm == 1 ? kSmemOneCtaPerSm : kSmemTwoCtasPerSm;
}
// 128 KB of weights in flight per CTA (8 stages of 128 rows, 16 of 64) saturates HBM
constexpr int kMaxWeightBytesInFlight = 8 * kDecodeMaxRows * kBlockK;

int pick_stages(int rows, int bt, int kbs, bool per_row, bool fused, bool row_step, bool relay,
                int limit) {
  const DecodeLayout none = decode_layout(rows, bt, kbs, 0, per_row, fused, row_step, relay);
  // bytes one more stage costs: its ring slot and its barriers (two, or three with a relay)
  const int per_stage =
      decode_layout(rows, bt, kbs, 1, per_row, fused, row_step, relay).total - none.total + 16;
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

// Weight stages a CTA keeps in flight (0: the whole ring). 128-row CTAs two an SM have the
// most weight bytes in flight an SM (two rings of ~96 KB), and every SM's requests queue in
// the memory system ahead of the loads each kernel's critical path waits for (activations,
// the quant kernel's reads, the split reduction): 2 stages (32 KB) a CTA keep HBM busy
// without that queue. Other plans lose with a window (docs/tuning.md: decode-weight-window).
int window_stages(int rows, int ctas_per_sm, int stages) {
  const int w = rows == kDecodeMaxRows && ctas_per_sm == 2 ? 2 : 0;
  return w < stages ? w : 0;
}

// Weight stages requested before the activations (0: the whole ring). Unsplit 64-row plans
// over up to 64 K blocks in one wave request 8 stages (64 KB a CTA), then the activations,
// then the rest of the ring: the activations, on the critical path once the previous kernel
// is done, would queue behind every weight request already issued. Other plans lose with it
// (docs/tuning.md: decode-first-stages).
int first_stages(int rows, int splits, int kbs, int ctas, int slots) {
  return rows == 64 && splits == 1 && kbs <= 64 && ctas <= slots ? 8 : 0;
}

// 64-row CTAs two an SM with split K (the 15-17 MB weights: 2112x7168, 4096^2) relay their
// weights (kRelay) with 4 stages (32 KB) in flight: the window from the start, while the
// previous kernel runs, without holding the activations back. Unsplit 64-row plans lose with
// it, hence split K only (docs/tuning.md: decode-relay).
bool relay_plan(int rows, int ctas_per_sm, int splits) {
  return rows == 64 && ctas_per_sm == 2 && splits > 1;
}
// (the relay needs 1 <= window < stages: see the kernel)
int relay_stages(int stages) {
  constexpr int kRelayStages = 4;
  return kRelayStages < stages ? kRelayStages : stages > 1 ? stages - 1 : 1;
}

template <int BT, int kRows, bool kPerRow, typename OutT, int kCtasPerSM, bool kRowStep,
          bool kRelay>
std::string launch(const DecodeArgs& d, cudaStream_t stream) {
  constexpr int kSmemLimit = smem_limit(kCtasPerSM);
  const int num_kb = (d.K + kBlockK - 1) / kBlockK;
  const int kbs = (num_kb + d.splits - 1) / d.splits;
  const bool fused = d.x_dtype != kInFP8;
  const int stages = pick_stages(kRows, BT, kbs, kPerRow, fused, kRowStep, kRelay, kSmemLimit);
  const DecodeLayout layout =
      decode_layout(kRows, BT, kbs, stages, kPerRow, fused, kRowStep, kRelay);
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
  std::string e = make_tensor_map_2d(&tw, d.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, d.N, d.K, d.K,
                                     row_step, kBlockK, CU_TENSOR_MAP_SWIZZLE_128B);
  if (!e.empty()) return e;
  // fp8 activations: tiles swizzled for wgmma (fused, the kernel reads the 16-bit rows itself)
  CUtensorMap tx{};
  if (!fused &&
      !(e = make_tensor_map_2d(&tx, d.x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, d.M, d.K, d.K, BT,
                               kBlockK, CU_TENSOR_MAP_SWIZZLE_128B)).empty())
    return e;
  constexpr auto kernel =
      fp8_decode_kernel<BT, kRows, kPerRow, OutT, kCtasPerSM, kRowStep, kRelay>;
  cudaError_t err = ensure_smem_limit<kernel>(smem);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const dim3 grid((d.N + row_step - 1) / row_step, (d.M + BT - 1) / BT, d.splits);
  // (first_stages leaves out the row-step CTAs, 128 rows, and the relaying ones, split K)
  DecodeParams p{d.x,         d.x_dtype,  d.x_scale, d.xs_stride_m, d.xs_stride_kb,
                 d.w_scale,   d.bias,     d.bias_f32, d.out,     d.workspace,   d.counters,
                 d.M,         d.N,        d.K,       num_kb,        d.splits,
                 stages,      d.pdl && d.early_trigger ? 1 : 0,
                 row_step,
                 kRelay ? relay_stages(stages) : window_stages(kRows, kCtasPerSM, stages),
                 first_stages(kRows, d.splits, kbs, grid.x * grid.y, kCtasPerSM * d.num_sms)};
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(384);
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

template <int BT, int R, int C, bool S = false, bool Y = false>
std::string dispatch_types(const DecodeArgs& d, cudaStream_t stream) {
  if (d.out_dtype == kOutBF16)
    return d.w_scale_per_row ? launch<BT, R, true, __nv_bfloat16, C, S, Y>(d, stream)
                             : launch<BT, R, false, __nv_bfloat16, C, S, Y>(d, stream);
  return d.w_scale_per_row ? launch<BT, R, true, __half, C, S, Y>(d, stream)
                           : launch<BT, R, false, __half, C, S, Y>(d, stream);
}

template <int BT, int R>
std::string dispatch_ctas(const DecodeArgs& d, cudaStream_t stream) {
  if (d.ctas_per_sm == 1) return dispatch_types<BT, R, 1>(d, stream);
  if constexpr (BT <= 32) {
    if (d.ctas_per_sm == 2) {
      if constexpr (R == 64) {
        if (relay_plan(R, 2, d.splits))
          return dispatch_types<BT, R, 2, false, true>(d, stream);
      }
      return dispatch_types<BT, R, 2>(d, stream);
    }
  }
  return "ctas_per_sm must be 1, or 2 with token tiles <= 32";
}

template <int BT>
std::string dispatch_rows(const DecodeArgs& d, cudaStream_t stream) {
  if (d.rows == 128) return dispatch_ctas<BT, 128>(d, stream);
  if (d.rows % 8 == 0 && d.rows > 64 && d.rows < 128) {  // 128-row CTAs owning fewer rows
    if (d.ctas_per_sm != 1) return "decode CTAs owning 72..120 rows run one an SM";
    return dispatch_types<BT, 128, 1, true>(d, stream);
  }
  if constexpr (BT <= 64) {
    if (d.rows == 64) return dispatch_ctas<BT, 64>(d, stream);
  }
  return "rows must be 64 (token tiles <= 64), 128, or a multiple of 8 in 72..120";
}

}  // namespace

std::string launch_decode(const DecodeArgs& d, cudaStream_t stream) {
  if (d.M <= 0 || d.N <= 0 || d.K <= 0) return "empty problem";
  if (d.K % 16 != 0 || d.N % 8 != 0) return "K must be a multiple of 16 and N of 8";
  const int num_kb = (d.K + kBlockK - 1) / kBlockK;
  if (d.splits < 1 || d.splits > num_kb) return "splits must be in [1, ceil(K/128)]";
  if (d.x_dtype == kInFP32) return "fused quantization takes bf16/fp16 activations";
  // decode config i -> its token tile's instantiation (sm90/tables.def lists them)
  int config = 0;
#define FP8L_DECODE_TILE(tokens) \
  if (d.config == config++) return dispatch_rows<tokens>(d, stream);
#include "sm90/tables.def"
  return "unknown decode config " + std::to_string(d.config);
}

}  // namespace fp8l
