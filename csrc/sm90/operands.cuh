// What the large-M and decode kernels share about their operands: the K block (one 128-byte
// swizzle row of fp8 and one scale block) and the 16-bit output types' conversions.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fp8l {

constexpr int kBlockK = 128;  // fp8 bytes per tile row == one 128B swizzle atom == scale block

template <typename T>
struct OutTraits;
template <>
struct OutTraits<__nv_bfloat16> {
  __device__ static __nv_bfloat16 from(float a) { return __float2bfloat16_rn(a); }
  __device__ static uint32_t pack(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static float2 load2(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
  }
};
template <>
struct OutTraits<__half> {
  __device__ static __half from(float a) { return __float2half_rn(a); }
  __device__ static uint32_t pack(float a, float b) {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static float2 load2(const __half* p) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
  }
};

}  // namespace fp8l
