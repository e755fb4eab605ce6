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
    // bf16 is fp32's top half: one instruction a value (__high2float's PRMT + shift is two)
    v[0] = __uint_as_float(w << 16), v[1] = __uint_as_float(w & 0xFFFF0000u);
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

// SiLU(g) * u of one gate and up value, both already 16-bit values: vLLM's SiluAndMul in the
// activations' dtype (silu in fp32, rounded; the product of two 16-bit floats, exact in fp32,
// rounded once by the caller's packing), as fp8linear.swiglu_quant.silu_mul_reference. The
// division is the approximate one (2 ulp), as Triton's `/`: IEEE division's ~10 instructions
// a value made the fused gate_up epilogue cost the grouped GEMM 4-8% (docs/tuning.md:
// moe-prefill-fused-act).
__device__ __forceinline__ float silu_mul1(float g, float u, bool fp16) {
  const float silu = __fdividef(g, 1.f + __expf(-g));
  return u * (fp16 ? __half2float(__float2half_rn(silu))
                   : __bfloat162float(__float2bfloat16_rn(silu)));
}

// SiLU(gate) * up of 8 packed 16-bit values each, packed the same way (silu_mul1).
__device__ __forceinline__ uint4 silu_mul8(const uint4& gate, const uint4& up, bool fp16) {
  float g[8], u[8];
  unpack8(gate, fp16, g);
  unpack8(up, fp16, u);
  uint32_t w[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float h[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) h[i] = silu_mul1(g[2 * q + i], u[2 * q + i], fp16);
    if (fp16) {
      const __half2 v = __floats2half2_rn(h[0], h[1]);
      w[q] = *reinterpret_cast<const uint32_t*>(&v);
    } else {
      const __nv_bfloat162 v = __floats2bfloat162_rn(h[0], h[1]);
      w[q] = *reinterpret_cast<const uint32_t*>(&v);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// max that propagates NaN (fmaxf drops it): as torch's amax in
// fp8linear.quant.quantize_activation, a NaN makes its group's scale, and so the group, NaN.
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// 16-bit floats by magnitude as bits: with the sign cleared, unsigned order is magnitude order
// (NaN above inf), so an integer max of the bits is the amax, NaN-propagating, two halves an
// instruction.
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// Clears the signs of two packed 16-bit floats: their magnitudes as max_u16x2 orders them.
constexpr uint32_t kAbsBits16x2 = 0x7FFF7FFFu;
// The largest magnitude of 8 packed 16-bit values, as bits, in one of the two halves (the
// caller takes the max of the halves).
__device__ __forceinline__ uint32_t amax_bits8(const uint4& b) {
  constexpr uint32_t k = kAbsBits16x2;
  return max_u16x2(max_u16x2(b.x & k, b.y & k), max_u16x2(b.z & k, b.w & k));
}
// 16-bit float bits (low half of h) as a float: exact.
__device__ __forceinline__ float bits16_to_float(uint32_t h, bool fp16) {
  return fp16 ? __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu)))
              : __uint_as_float(h << 16);
}

// The scale of a group and its reciprocal: scale = max(amax, eps) / 448 (IEEE division, as
// fp8linear.quant.quantize_activation), rcp = 1 / scale rounded to nearest. An inf input makes
// the scale inf, and torch's x / inf is +-0 for finite x and NaN for +-inf: `div` is then 0,
// with which div_by_scale's corrected product gives exactly that (an inf there would make
// inf * 0 = NaN of every x).
struct GroupScale {
  float div, rcp;  // div: the scale, 0 where it is inf
  __device__ __forceinline__ float scale() const {
    return div != 0.f ? div : __int_as_float(0x7f800000);
  }
};
__device__ __forceinline__ GroupScale group_scale(float amax) {
  const float s = __fdiv_rn(fmax_nan(amax, kAmaxEps), kFp8Max);
  return {isinf(s) ? 0.f : s, __frcp_rn(s)};
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
  const float r = __fmaf_rn(-q, g.div, x);
  return copysignf(__fmaf_rn(r, g.rcp, q), x);
}

// x / scale of two values, each rounded to nearest e4m3 and saturating at +-448 (NaN stays
// NaN), packed little-endian.
__device__ __forceinline__ __nv_fp8x2_storage_t quantize2(float a, float b, const GroupScale& g) {
  return __nv_cvt_float2_to_fp8x2(make_float2(div_by_scale(a, g), div_by_scale(b, g)),
                                  __NV_SATFINITE, __NV_E4M3);
}

// quantize2 of n values (a multiple of 4) packed into n / 4 words.
template <int n>
__device__ __forceinline__ void quantize(const float* v, const GroupScale& g, uint32_t* out) {
#pragma unroll
  for (int w = 0; w < n / 4; ++w)
    out[w] = uint32_t(quantize2(v[4 * w], v[4 * w + 1], g)) |
             (uint32_t(quantize2(v[4 * w + 2], v[4 * w + 3], g)) << 16);
}

}  // namespace fp8l
