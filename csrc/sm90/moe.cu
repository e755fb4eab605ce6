// Instantiations and launch of the grouped expert GEMM of a mixture-of-experts layer: the
// decode kernel (decode_kernel.cuh, kGrouped) over all active experts in one launch. The
// tokens come sorted by expert, quantized, in token tiles of BT (a tile holds one expert's
// tokens; fp8linear/backends/sm90/moe.py routes them), and each CTA streams its tile's
// expert's weight rows: few tokens an expert read each expert's weights once.
#include "sm90/decode_launch.cuh"

namespace fp8l {
namespace {
using decode_launch::launch;

template <int BT, int C>
std::string moe_types(const DecodeArgs& d, cudaStream_t stream) {
  constexpr bool kPerRow = false, kRowStep = false, kRelay = false, kGrouped = true;
  if (d.out_dtype == kOutBF16)
    return launch<BT, 128, kPerRow, __nv_bfloat16, C, kRowStep, kRelay, kGrouped>(d, stream);
  return launch<BT, 128, kPerRow, __half, C, kRowStep, kRelay, kGrouped>(d, stream);
}

template <int BT>
std::string moe_ctas(const DecodeArgs& d, cudaStream_t stream) {
  if (d.ctas_per_sm == 1) return moe_types<BT, 1>(d, stream);
  if constexpr (BT <= 32) {
    if (d.ctas_per_sm == 2) return moe_types<BT, 2>(d, stream);
  }
  return "ctas_per_sm must be 1, or 2 with token tiles <= 32";
}

}  // namespace

std::string launch_moe_decode(const DecodeArgs& d, cudaStream_t stream) {
  if (d.M <= 0 || d.N <= 0 || d.K <= 0 || d.experts <= 0) return "empty problem";
  if (d.K % 16 != 0 || d.N % 8 != 0) return "K must be a multiple of 16 and N of 8";
  const int num_kb = (d.K + kBlockK - 1) / kBlockK;
  if (d.splits < 1 || d.splits > num_kb) return "splits must be in [1, ceil(K/128)]";
  if (d.x_dtype != kInFP8) return "grouped GEMMs take fp8 activations (sorted by expert)";
  if (d.tile_expert == nullptr) return "grouped GEMMs need tile_expert";
  if (d.w_scale_per_row) return "grouped GEMMs take 128x128 weight scales";
  if (d.rows != 128) return "grouped GEMMs run 128-row CTAs";
  if (d.out_dtype != kOutBF16 && d.out_dtype != kOutFP16) return "outputs are bf16 or fp16";
  int config = 0;
#define FP8L_DECODE_TILE(tokens) \
  if (d.config == config++) {    \
    if (d.M % tokens != 0) return "M must be whole token tiles"; \
    return moe_ctas<tokens>(d, stream); \
  }
#include "sm90/tables.def"
  return "unknown decode config " + std::to_string(d.config);
}

}  // namespace fp8l
