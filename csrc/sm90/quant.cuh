// Device helpers for activation quantization, shared by the standalone quant kernel and the
// decode kernel's fused quantization, so both produce bit-identical fp8 values and scales.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace fp8l {

constexpr float kFp8Max = 448.f;
constexpr float kAmaxEps = 1e-10f;  // = fp8linear.quant.AMAX_EPS

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

// The values of type T (fp32, or two fp16 / bf16) in one 32-bit word, as floats.
template <typename T>
__device__ __forceinline__ void word_to_floats(uint32_t w, float* v) {
  if constexpr (std::is_same_v<T, float>) {
    v[0] = __uint_as_float(w);
  } else if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = *reinterpret_cast<const __half2*>(&w);
    v[0] = __low2float(h), v[1] = __high2float(h);
  } else {
    const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w);
    v[0] = __low2float(h), v[1] = __high2float(h);
  }
}

// 8 bf16 (or fp16) values packed in 16 bytes, as floats (the decode kernel's input type is a
// run-time flag)
__device__ __forceinline__ void unpack8(const uint4& bits, bool fp16, float v[8]) {
  const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (fp16) word_to_floats<__half>(w[q], v + 2 * q);
    else word_to_floats<__nv_bfloat16>(w[q], v + 2 * q);
  }
}

// The scale of a group and its reciprocal: scale = max(amax, eps) / 448 (IEEE division, as
// fp8linear.quant.quantize_activation), rcp = 1 / scale rounded to nearest.
struct GroupScale {
  float scale, rcp;
};
__device__ __forceinline__ GroupScale group_scale(float amax) {
  const float s = __fdiv_rn(fmaxf(amax, kAmaxEps), kFp8Max);
  return {s, __frcp_rn(s)};
}

// x / scale rounded to nearest fp32, exactly as IEEE division (__fdiv_rn) gives it, in three
// instructions with the group's reciprocal: q = x * rcp is within one ulp of x / scale, and
// one correction with the exact residual x - q * scale (an FMA) rounds it correctly
// (Markstein's theorem: rcp correctly rounded, q within an ulp, no overflow; quotients too
// small for that are far below fp8's smallest subnormal, and copysign keeps the sign of a
// zero). __fdiv_rn per element costs ~10 instructions and a range-check branch, which made
// the decode kernel's fused quantization compute-bound on long K ranges.
__device__ __forceinline__ float div_by_scale(float x, const GroupScale& g) {
  const float q = __fmul_rn(x, g.rcp);
  const float r = __fmaf_rn(-q, g.scale, x);
  return copysignf(__fmaf_rn(r, g.rcp, q), x);
}

// x / scale rounded to nearest e4m3, saturating at +-448 (NaN stays NaN); n values (a multiple
// of 2) packed little-endian into n / 4 words.
template <int n>
__device__ __forceinline__ void quantize(const float* v, const GroupScale& g, uint32_t* out) {
#pragma unroll
  for (int w = 0; w < n / 4; ++w) {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(div_by_scale(v[4 * w], g), div_by_scale(v[4 * w + 1], g)), __NV_SATFINITE,
        __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(div_by_scale(v[4 * w + 2], g), div_by_scale(v[4 * w + 3], g)),
        __NV_SATFINITE, __NV_E4M3);
    out[w] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
}

}  // namespace fp8l
