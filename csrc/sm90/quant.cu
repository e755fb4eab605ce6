// Per-token, per-128-channel activation quantization: the first launch of fp8_linear on the
// large-M path and on the decode path where the decode kernel does not quantize itself.
// A group of 128 channels is 128 / kV lanes of kV values each; each group of lanes takes
// kUnroll groups, all loads issued before any reduction. Two shapes (launch_typed):
//  - narrow: a warp a group, 4 values (8 bytes of bf16/fp16) a lane, one group at a time;
//  - wide: 16-byte loads (a half-warp a bf16/fp16 group), two groups a lane: 32 bytes in
//    flight a lane, a quarter of the CTAs. Alone faster from 256 tokens x 8K channels, but in
//    fp8_linear only from 1024 tokens (docs/tuning.md: quant-wide), so it serves prefill.
// Numerics equal fp8linear.quant.quantize_activation: scale = max(amax, 1e-10) / 448, then
// x / scale rounded to nearest e4m3, saturating (quant.cuh, shared with the decode kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/launch.h"
#include "common/ptx.cuh"
#include "sm90/api.h"
#include "sm90/quant.cuh"

namespace fp8l {
namespace {

constexpr int kQuantThreads = 256;
constexpr int kWideMinTokens = 1024;  // the wide shape from this many tokens (see above)

// kV values of type T a lane: 8 or 16 bytes
template <typename T, int kV>
using LaneBits = std::conditional_t<kV * sizeof(T) == 16, uint4, uint2>;

template <typename T, int kV>
__device__ __forceinline__ void to_floats(const LaneBits<T, kV>& raw, float* v) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
  constexpr int kPerWord = 4 / sizeof(T);
#pragma unroll
  for (int i = 0; i < int(sizeof(raw) / 4); ++i) word_to_floats<T>(w[i], v + kPerWord * i);
}

template <typename T, int kV, int kUnroll>
__global__ void __launch_bounds__(kQuantThreads)
    quant_kernel(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scale_t,
                 int scale_ld, int M, int K, int num_kb) {
  constexpr int kL = 128 / kV;  // lanes a group
  using Bits = LaneBits<T, kV>;
  // The GEMM launched after us (programmatic dependent launch) may start now: its weight
  // stream does not depend on us, and it waits (griddepcontrol.wait) for our complete,
  // flushed output before it reads the activations. This hides the GEMM's launch and ring
  // fill behind the quantization instead of after it.
  pdl_launch_dependents();
  // Launched under PDL ourselves (after a decode GEMM that lets its dependents start early),
  // x is the previous kernel's output: wait for it (a no-op without PDL).
  pdl_wait();
  // (int indices: the host checks that M x num_kb fits; one division per group, not four)
  const int groups = M * num_kb;
  const int lane_group = int((blockIdx.x * kQuantThreads + threadIdx.x) / kL);
  const int stride = int(gridDim.x * kQuantThreads / kL);
  const int sub = threadIdx.x % kL;
  if constexpr (kUnroll == 1 && kL == 32) {
    if (lane_group >= groups) return;  // a whole warp (its shuffles need no absent lanes)
  }
  Bits raw[kUnroll];
  int m[kUnroll], kb[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    // token index fastest: neighbouring groups of lanes write neighbouring scale_t entries
    const int g = lane_group + u * stride;
    m[u] = g < groups ? g % M : 0;
    kb[u] = g < groups ? g / M : num_kb;  // (num_kb: past K, nothing loaded or stored)
    const int k0 = kb[u] * 128 + sub * kV;
    // zeros past K (K % 16 == 0 and k0 % kV == 0: a lane's values are all in or all out)
    raw[u] = Bits{};
    if (k0 < K) raw[u] = *reinterpret_cast<const Bits*>(x + size_t(m[u]) * K + k0);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    float v[kV];
    to_floats<T, kV>(raw[u], v);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kV; ++i) amax = fmax_nan(amax, fabsf(v[i]));
#pragma unroll
    for (int o = kL / 2; o > 0; o >>= 1)
      amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (kb[u] >= num_kb) continue;  // (after the shuffles: every lane takes part)
    const GroupScale gs = group_scale(amax);
    uint32_t packed[kV / 4];
    quantize<kV>(v, gs, packed);
    const int k0 = kb[u] * 128 + sub * kV;
    uint8_t* dst = q + size_t(m[u]) * K + k0;
    if (k0 < K) {
      if constexpr (kV == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
      else *reinterpret_cast<uint32_t*>(dst) = packed[0];
    }
    if (sub == 0) scale_t[size_t(kb[u]) * scale_ld + m[u]] = gs.scale();
  }
}

template <typename T, int kV, int kUnroll>
cudaError_t launch_shape(const void* x, uint8_t* q, float* scale_t, int scale_ld, int M, int K,
                         int num_kb, bool pdl, cudaStream_t stream) {
  const long groups = long(M) * num_kb;  // (< 2^31: launch_quant)
  const long per_block = long(kQuantThreads) / (128 / kV) * kUnroll;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned((groups + per_block - 1) / per_block));
  cfg.blockDim = dim3(kQuantThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr = pdl_attribute();
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, quant_kernel<T, kV, kUnroll>, static_cast<const T*>(x), q,
                            scale_t, scale_ld, M, K, num_kb);
}

template <typename T>
cudaError_t launch_typed(const void* x, uint8_t* q, float* scale_t, int scale_ld, int M, int K,
                         int num_kb, bool pdl, cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(T);  // values in 16 bytes
  if (M >= kWideMinTokens)
    return launch_shape<T, kWide, 2>(x, q, scale_t, scale_ld, M, K, num_kb, pdl, stream);
  return launch_shape<T, 4, 1>(x, q, scale_t, scale_ld, M, K, num_kb, pdl, stream);
}

}  // namespace

std::string launch_quant(const void* x, int in_dtype, void* q, float* scale_t, int scale_ld,
                         int M, int K, bool pdl, cudaStream_t stream) {
  if (M <= 0 || K <= 0) return "";
  if (K % 16 != 0) return "K must be a multiple of 16";
  const int num_kb = (K + 127) / 128;
  // (the kernel's group and lane indices are ints; 2^31 groups are 512 GB of activations)
  if (long(M) * num_kb * 32 >= (1L << 31)) return "too many tokens x channels for one launch";
  auto* qq = static_cast<uint8_t*>(q);
  cudaError_t err;
  switch (in_dtype) {
    case kInBF16:
      err = launch_typed<__nv_bfloat16>(x, qq, scale_t, scale_ld, M, K, num_kb, pdl, stream);
      break;
    case kInFP16:
      err = launch_typed<__half>(x, qq, scale_t, scale_ld, M, K, num_kb, pdl, stream);
      break;
    case kInFP32:
      err = launch_typed<float>(x, qq, scale_t, scale_ld, M, K, num_kb, pdl, stream);
      break;
    default:
      return "unsupported input dtype";
  }
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace fp8l
