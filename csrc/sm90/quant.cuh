// Device helpers for activation quantization, shared by the standalone quant kernel and the
// decode kernel's fused quantization, so both produce bit-identical fp8 values and scales.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace fp8l {

constexpr float kFp8Max = 448.f;
constexpr float kAmaxEps = 1e-10f;  // = fp8linear.quant.AMAX_EPS

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

// Four consecutive values starting at element k0 (< K masked to 0). Vector loads when whole:
// K % 16 == 0 keeps them aligned.
template <typename T>
__device__ __forceinline__ void load4(const T* src, int k0, int K, float v[4]) {
  if (k0 + 4 <= K) {
    if constexpr (sizeof(T) == 2) {
      const uint2 raw = *reinterpret_cast<const uint2*>(src);
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = to_f(h[i]);
    } else {
      const float4 f = *reinterpret_cast<const float4*>(src);
      v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = k0 + i < K ? to_f(src[i]) : 0.f;
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// x / scale, clamped to +-448, rounded to nearest e4m3; 4 values packed little-endian.
__device__ __forceinline__ uint32_t quantize4(const float v[4], float scale) {
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float t = fminf(fmaxf(__fdiv_rn(v[i], scale), -kFp8Max), kFp8Max);
    const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(t, __NV_SATFINITE, __NV_E4M3);
    out |= uint32_t(b) << (8 * i);
  }
  return out;
}

}  // namespace fp8l
