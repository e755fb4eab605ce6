// Instantiations and launch of the grouped expert GEMM of a mixture-of-experts layer: the
// decode kernel (decode_kernel.cuh, kGrouped) over all active experts in one launch. The
// tokens come sorted by expert, quantized, in token tiles of BT (a tile holds one expert's
// tokens; fp8linear/backends/sm90/moe.py routes them), and each CTA streams its tile's
// expert's weight rows: few tokens an expert read each expert's weights once. Slot tiles
// (top_k > 0): a handful of tokens, unsorted, a tile a (token, slot) pair, its token row read
// and quantized in the kernel (the gather, and for down SiLU-and-mul, folded in).
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

template <int C>
std::string slot_types(const DecodeArgs& d, cudaStream_t stream) {
  constexpr bool kPerRow = false, kRowStep = false, kRelay = false, kGrouped = true;
  constexpr int kSlotTile = 8;  // wgmma's narrowest N: one live token
  if (d.out_dtype == kOutBF16)
    return launch<kSlotTile, 128, kPerRow, __nv_bfloat16, C, kRowStep, kRelay, kGrouped, true>(
        d, stream);
  return launch<kSlotTile, 128, kPerRow, __half, C, kRowStep, kRelay, kGrouped, true>(d, stream);
}

std::string launch_slots(const DecodeArgs& d, cudaStream_t stream) {
  if (d.x_dtype != kInBF16 && d.x_dtype != kInFP16)
    return "slot tiles take bf16/fp16 activations (quantized in the kernel)";
  if (d.config != 0) return "slot tiles run decode config 0 (8-token tiles)";
  if (d.M % d.top_k != 0) return "slot tiles: M must be tokens x top_k";
  if (d.ctas_per_sm == 1) return slot_types<1>(d, stream);
  if (d.ctas_per_sm == 2) return slot_types<2>(d, stream);
  if (d.ctas_per_sm == 3) return slot_types<3>(d, stream);
  return "ctas_per_sm must be 1, 2 or 3";
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
  if (d.tile_expert == nullptr) return "grouped GEMMs need tile_expert";
  if (d.w_scale_per_row) return "grouped GEMMs take 128x128 weight scales";
  if (d.rows != 128) return "grouped GEMMs run 128-row CTAs";
  if (d.out_dtype != kOutBF16 && d.out_dtype != kOutFP16) return "outputs are bf16 or fp16";
  if (d.top_k > 0) return launch_slots(d, stream);
  if (d.x_dtype != kInFP8 &&
      !((d.x_dtype == kInBF16 || d.x_dtype == kInFP16) && d.row_token != nullptr &&
        d.route_slots > 0 && d.route_top_k > 0))
    return "grouped GEMMs take fp8 activations (sorted by expert), or bf16/fp16 tokens with "
           "row_token, route_ids and route_top_k";
  if (d.bias != nullptr) return "grouped GEMMs take no bias";
  // (route_slots: the CTA counts the experts' slots in its weight ring, >= 16 KB)
  if (d.route_slots < 0 || (d.route_slots > 0 && (d.route_ids == nullptr || d.experts > 4095)))
    return "route_slots must be >= 0, and 0 without route_ids or above 4095 experts";
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
