// Per-token, per-128-channel activation quantization: the first launch of fp8_linear on the
// large-M path and on the decode path where the decode kernel does not quantize itself. One warp per (token, 128 channels):
// each lane holds 4 values, a shuffle reduction gives the group's amax.
// Numerics equal fp8linear.quant.quantize_activation: scale = max(amax, 1e-10) / 448, then
// x / scale (IEEE division) rounded to nearest e4m3, saturating.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/launch.h"
#include "common/ptx.cuh"
#include "sm90/api.h"
#include "sm90/quant.cuh"

namespace fp8l {
namespace {

template <typename T>
__global__ void quant_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                             float* __restrict__ scale_t, int scale_ld, int M, int K, int num_kb) {
  // The GEMM launched after us (programmatic dependent launch) may start now: its weight
  // stream does not depend on us, and it waits (griddepcontrol.wait) for our complete,
  // flushed output before it reads the activations. This hides the GEMM's launch and ring
  // fill behind the quantization instead of after it.
  pdl_launch_dependents();
  // Launched under PDL ourselves (after a decode GEMM that lets its dependents start early),
  // x is the previous kernel's output: wait for it (a no-op without PDL).
  pdl_wait();
  const long gid = (long(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (gid >= long(M) * num_kb) return;
  // token index fastest: neighbouring warps write neighbouring scale_t entries
  const int m = int(gid % M), kb = int(gid / M);
  const int k0 = kb * 128 + lane * 4;
  const T* src = x + size_t(m) * K + k0;
  float v[4];
  load4(src, k0, K, v);
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = warp_max(amax);
  const GroupScale gs = group_scale(amax);
  uint32_t packed;
  quantize<4>(v, gs, &packed);
  const float scale = gs.scale;
  uint8_t* dst = q + size_t(m) * K + k0;
  if (k0 + 4 <= K) {
    *reinterpret_cast<uint32_t*>(dst) = packed;  // K % 16 == 0 keeps this 4-byte aligned
  } else {
    for (int i = 0; i < 4 && k0 + i < K; ++i) dst[i] = uint8_t(packed >> (8 * i));
  }
  if (lane == 0) scale_t[size_t(kb) * scale_ld + m] = scale;
}

template <typename T>
cudaError_t launch_typed(const void* x, uint8_t* q, float* scale_t, int scale_ld, int M, int K,
                         int num_kb, unsigned blocks, int threads, bool pdl, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  cudaLaunchAttribute attr = pdl_attribute();
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, quant_kernel<T>, static_cast<const T*>(x), q, scale_t,
                            scale_ld, M, K, num_kb);
}

}  // namespace

std::string launch_quant(const void* x, int in_dtype, void* q, float* scale_t, int scale_ld,
                         int M, int K, bool pdl, cudaStream_t stream) {
  if (M <= 0 || K <= 0) return "";
  if (K % 16 != 0) return "K must be a multiple of 16";
  const int num_kb = (K + 127) / 128;
  const long warps = long(M) * num_kb;
  const int threads = 256;
  const unsigned blocks = unsigned((warps * 32 + threads - 1) / threads);
  auto* qq = static_cast<uint8_t*>(q);
  cudaError_t err;
  switch (in_dtype) {
    case kInBF16:
      err = launch_typed<__nv_bfloat16>(x, qq, scale_t, scale_ld, M, K, num_kb, blocks, threads,
                                        pdl, stream);
      break;
    case kInFP16:
      err = launch_typed<__half>(x, qq, scale_t, scale_ld, M, K, num_kb, blocks, threads, pdl,
                                 stream);
      break;
    case kInFP32:
      err = launch_typed<float>(x, qq, scale_t, scale_ld, M, K, num_kb, blocks, threads, pdl,
                                stream);
      break;
    default:
      return "unsupported input dtype";
  }
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace fp8l
