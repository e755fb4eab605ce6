// Instantiations and launch of the decode kernel (decode_kernel.cuh).
#include "sm90/decode_launch.cuh"

namespace fp8l {
namespace {
using decode_launch::launch;
using decode_launch::relay_plan;

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
  if (d.out_dtype != kOutBF16 && d.out_dtype != kOutFP16) return "outputs are bf16 or fp16";
  if (d.tile_expert != nullptr) return "grouped problems go to launch_moe_decode";
  // decode config i -> its token tile's instantiation (sm90/tables.def lists them)
  int config = 0;
#define FP8L_DECODE_TILE(tokens) \
  if (d.config == config++) return dispatch_rows<tokens>(d, stream);
#include "sm90/tables.def"
  return "unknown decode config " + std::to_string(d.config);
}

}  // namespace fp8l
