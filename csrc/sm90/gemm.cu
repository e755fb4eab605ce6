// Instantiations and launch of the large-M kernel (gemm_kernel.cuh).
#include "common/launch.h"
#include "common/tma.h"
#include "sm90/api.h"
#include "sm90/gemm_kernel.cuh"

namespace fp8l {
namespace {

// The tile configurations (index = GemmArgs::config); fp8linear/kernels/heuristics.py says
// when each is used. Stages: as many as fit in 227 KB of shared memory next to the epilogue.
struct Config {
  int bm, bn, stages;
};
constexpr Config kConfigs[] = {{128, 128, 5}, {64, 128, 8}};

template <int BM, int BN, int STAGES, bool kPerRow, typename OutT>
std::string launch(const GemmArgs& g, cudaStream_t stream) {
  using L = GemmSmem<BM, BN, STAGES>;
  static_assert(L::kAlloc <= 232448, "shared memory over the sm_90 limit");
  const int num_kb = (g.K + kBlockK - 1) / kBlockK;
  CUtensorMap ta, tb, tsa, tc;
  std::string e;
  const auto sw128 = CU_TENSOR_MAP_SWIZZLE_128B;
  if (!(e = make_tensor_map_2d(&ta, g.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, g.M, g.K, g.K, BM,
                               kBlockK, sw128)).empty())
    return e;
  if (!(e = make_tensor_map_2d(&tb, g.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, g.N, g.K, g.K, BN,
                               kBlockK, sw128)).empty())
    return e;
  if (!(e = make_tensor_map_2d(&tsa, g.a_scale_t, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, num_kb,
                               g.a_scale_ld, g.a_scale_ld, 1, BM,
                               CU_TENSOR_MAP_SWIZZLE_NONE)).empty())
    return e;
  const auto out_type = g.out_dtype == kOutBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (!(e = make_tensor_map_2d(&tc, g.out, out_type, 2, g.M, g.N, g.N, 64, 64, sw128)).empty())
    return e;

  constexpr auto kernel = fp8_gemm_kernel<BM, BN, STAGES, kPerRow, OutT>;
  cudaError_t err = ensure_smem_limit<kernel>(L::kAlloc);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const int tiles = ((g.M + BM - 1) / BM) * ((g.N + BN - 1) / BN);
  const int grid = tiles < g.num_sms ? tiles : g.num_sms;
  GemmParams p{g.M, g.N, g.K, num_kb, g.w_scale, g.bias};
  kernel<<<grid, (BM / 64 + 1) * 128, L::kAlloc, stream>>>(ta, tb, tsa, tc, p);
  err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

template <int BM, int BN, int STAGES>
std::string dispatch_types(const GemmArgs& g, cudaStream_t stream) {
  if (g.out_dtype == kOutBF16)
    return g.w_scale_per_row ? launch<BM, BN, STAGES, true, __nv_bfloat16>(g, stream)
                             : launch<BM, BN, STAGES, false, __nv_bfloat16>(g, stream);
  return g.w_scale_per_row ? launch<BM, BN, STAGES, true, __half>(g, stream)
                           : launch<BM, BN, STAGES, false, __half>(g, stream);
}

}  // namespace

std::string launch_gemm(const GemmArgs& g, cudaStream_t stream) {
  if (g.M <= 0 || g.N <= 0 || g.K <= 0) return "empty problem";
  if (g.K % 16 != 0 || g.N % 8 != 0) return "K must be a multiple of 16 and N of 8";
  if (g.a_scale_ld % 4 != 0 || g.a_scale_ld < g.M) return "a_scale_ld must be >= M and % 4";
  switch (g.config) {
    case 0: return dispatch_types<kConfigs[0].bm, kConfigs[0].bn, kConfigs[0].stages>(g, stream);
    case 1: return dispatch_types<kConfigs[1].bm, kConfigs[1].bn, kConfigs[1].stages>(g, stream);
    default: return "unknown gemm config " + std::to_string(g.config);
  }
}

}  // namespace fp8l
