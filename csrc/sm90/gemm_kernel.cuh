// Large-M block-scaled FP8 GEMM for sm_90a: C[M,N] = sum_kb (A_kb . B_kb^T) * sa[m,kb] * sb[n,kb].
//
// One persistent CTA per SM walks output tiles of BM x BN. Warp specialization:
//   math warpgroups 0..BM/64-1: each owns 64 rows of the tile; per 128-wide K block it issues
//     four m64nBNk32 fp8 wgmmas into a fresh fp32 partial, waits, and promotes the partial into
//     the fp32 total with the two scales (DeepSeek-V3 numerics: scales per K block);
//   the producer warpgroup (last, registers given back via setmaxnreg): warp 0 issues TMA
//     loads of A, B and the A scales into a STAGES-deep ring, warp 1 copies the B scales of
//     each stage into shared memory (128x128-block or per-row granularity).
// Epilogue: registers -> 128B-swizzled shared memory -> TMA store (clipped at M/N edges), while
// the producer already streams the next tile.
#pragma once
#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/ptx.cuh"
#include "common/wgmma.cuh"

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

struct GemmParams {
  int M, N, K, num_kb;
  const float* w_scale;  // [ceil(N/128), num_kb] blocks or [N, num_kb] per row
  const void* bias;      // [N] in the output dtype, or nullptr
};

template <int BM, int BN, int STAGES>
struct GemmSmem {
  static constexpr int kMathWG = BM / 64;
  static constexpr int kABytes = BM * kBlockK;
  static constexpr int kBBytes = BN * kBlockK;
  static constexpr int kOutBytes = BM * BN * 2;  // 16-bit outputs
  static constexpr int kA = 0;
  static constexpr int kB = kA + STAGES * kABytes;
  static constexpr int kOut = kB + STAGES * kBBytes;
  static constexpr int kSA = kOut + kOutBytes;
  static constexpr int kSB = kSA + STAGES * BM * 4;
  static constexpr int kBar = kSB + STAGES * BN * 4;
  static constexpr int kBytes = kBar + 2 * STAGES * 8;
  static constexpr int kAlloc = kBytes + 1024;  // slack to align the base to 1024 B
};

// Tile order: bands of kGroupM M-blocks, N-blocks inside, so that CTAs running at the same
// time share A rows and B columns in L2.
__device__ __forceinline__ void tile_coords(int t, int num_m, int num_n, int& mb, int& nb) {
  constexpr int kGroupM = 8;
  const int per_group = kGroupM * num_n;
  const int g = t / per_group;
  const int first_m = g * kGroupM;
  const int gm = min(num_m - first_m, kGroupM);
  const int r = t - g * per_group;
  mb = first_m + r % gm;
  nb = r / gm;
}

template <int BM, int BN, int STAGES, bool kPerRowB, typename OutT>
__global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,   // [M, K] fp8
                    const __grid_constant__ CUtensorMap tmap_b,   // [N, K] fp8
                    const __grid_constant__ CUtensorMap tmap_sa,  // [num_kb, Mpad] fp32
                    const __grid_constant__ CUtensorMap tmap_c,   // [M, N] OutT
                    const GemmParams p) {
  using L = GemmSmem<BM, BN, STAGES>;
  constexpr int kMathWG = L::kMathWG;
  static_assert(BN == 64 || BN == 128, "BN must divide the 128-row weight-scale block");
  static_assert(BM == 64 || BM == 128, "one or two math warpgroups");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~uintptr_t(1023));
  uint8_t* sA = smem + L::kA;
  uint8_t* sB = smem + L::kB;
  uint8_t* sOut = smem + L::kOut;
  float* sSA = reinterpret_cast<float*>(smem + L::kSA);
  float* sSB = reinterpret_cast<float*>(smem + L::kSB);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBar);
  uint64_t* empty = full + STAGES;

  const int wg = threadIdx.x / 128;
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int num_m = (p.M + BM - 1) / BM;
  const int num_n = (p.N + BN - 1) / BN;
  const int num_tiles = num_m * num_n;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1 + 32);      // TMA thread's expect_tx + the 32 B-scale lanes
      mbar_init(&empty[s], kMathWG * 4);  // one arrival per math warp
    }
    fence_barrier_init();
    tma_prefetch_desc(&tmap_a);
    tma_prefetch_desc(&tmap_b);
    tma_prefetch_desc(&tmap_sa);
    tma_prefetch_desc(&tmap_c);
  }
  __syncthreads();

  if (wg == kMathWG) {
    // ------------------------------------------------------------------ producer warpgroup
    reg_dealloc<40>();
    if (warp_in_wg == 0) {
      if (lane == 0) {
        const uint64_t keep = l2_policy_evict_last();  // tiles are re-read by other CTAs
        int s = 0;
        uint32_t phase = 0;
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
          int mb, nb;
          tile_coords(t, num_m, num_n, mb, nb);
          for (int kb = 0; kb < p.num_kb; ++kb) {
            mbar_wait(&empty[s], phase ^ 1);
            mbar_arrive_expect_tx(&full[s], L::kABytes + L::kBBytes + BM * 4);
            tma_load_2d(sA + s * L::kABytes, &tmap_a, &full[s], kb * kBlockK, mb * BM, keep);
            tma_load_2d(sB + s * L::kBBytes, &tmap_b, &full[s], kb * kBlockK, nb * BN, keep);
            tma_load_2d(sSA + s * BM, &tmap_sa, &full[s], mb * BM, kb, keep);
            if (++s == STAGES) { s = 0; phase ^= 1; }
          }
        }
      }
    } else if (warp_in_wg == 1) {
      // B scales: tiny and strided (per-row layout), so plain loads into the stage's slot.
      int s = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        int mb, nb;
        tile_coords(t, num_m, num_n, mb, nb);
        for (int kb = 0; kb < p.num_kb; ++kb) {
          mbar_wait(&empty[s], phase ^ 1);
          if constexpr (kPerRowB) {
            for (int i = lane; i < BN; i += 32) {
              const int n = nb * BN + i;
              sSB[s * BN + i] = n < p.N ? __ldg(p.w_scale + size_t(n) * p.num_kb + kb) : 0.f;
            }
          } else if (lane == 0) {
            sSB[s * BN] = __ldg(p.w_scale + size_t(nb * BN / 128) * p.num_kb + kb);
          }
          mbar_arrive(&full[s]);
          if (++s == STAGES) { s = 0; phase ^= 1; }
        }
      }
    }
  } else {
    // ---------------------------------------------------------------------- math warpgroups
    reg_alloc<232>();
    using Mma = WgmmaFp8<BN>;
    constexpr int kRegs = Mma::kRegs;
    float acc[kRegs];
    float part[kRegs];
    const int row_in_wg = warp_in_wg * 16 + lane / 4;  // and +8
    const int col_q = 2 * (lane % 4);                  // + 8*j, and +1
    uint8_t* my_out = sOut + wg * 64 * BN * 2;
    int s = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int mb, nb;
      tile_coords(t, num_m, num_n, mb, nb);
#pragma unroll
      for (int i = 0; i < kRegs; ++i) acc[i] = 0.f;

      for (int kb = 0; kb < p.num_kb; ++kb) {
        mbar_wait(&full[s], phase);
        const uint64_t da = make_smem_desc_sw128(sA + s * L::kABytes + wg * 64 * kBlockK);
        const uint64_t db = make_smem_desc_sw128(sB + s * L::kBBytes);
#pragma unroll
        for (int i = 0; i < kRegs; ++i) fence_operand(part[i]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 32; ++kk) {
          // +32 bytes along K inside the swizzle atom == +2 in the descriptor's address field
          Mma::mma(part, da + 2 * kk, db + 2 * kk, kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kRegs; ++i) fence_operand(part[i]);

        const float sa0 = sSA[s * BM + wg * 64 + row_in_wg];
        const float sa1 = sSA[s * BM + wg * 64 + row_in_wg + 8];
        if constexpr (kPerRowB) {
          const float* sb = sSB + s * BN;
#pragma unroll
          for (int j = 0; j < kRegs / 4; ++j) {
            const float b0 = sb[8 * j + col_q], b1 = sb[8 * j + col_q + 1];
            acc[4 * j + 0] = fmaf(part[4 * j + 0], sa0 * b0, acc[4 * j + 0]);
            acc[4 * j + 1] = fmaf(part[4 * j + 1], sa0 * b1, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(part[4 * j + 2], sa1 * b0, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(part[4 * j + 3], sa1 * b1, acc[4 * j + 3]);
          }
        } else {
          const float sb = sSB[s * BN];
          const float s0 = sa0 * sb, s1 = sa1 * sb;
#pragma unroll
          for (int j = 0; j < kRegs / 4; ++j) {
            acc[4 * j + 0] = fmaf(part[4 * j + 0], s0, acc[4 * j + 0]);
            acc[4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[4 * j + 3]);
          }
        }
        // All lanes have read this stage's scales; the wgmma reads finished at wait<0>.
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
        if (++s == STAGES) { s = 0; phase ^= 1; }
      }

      // ------------------------------------------------------------------------ epilogue
      const bool wg_leader = threadIdx.x % 128 == 0;
      if (wg_leader) tma_store_wait_read();  // the previous tile's store has left smem
      named_barrier(1 + wg, 128);
      const OutT* bias = static_cast<const OutT*>(p.bias);
#pragma unroll
      for (int j = 0; j < kRegs / 4; ++j) {
        const int c = 8 * j + col_q;  // column inside the tile
        float b0 = 0.f, b1 = 0.f;
        const int n = nb * BN + c;
        if (bias != nullptr && n < p.N) {
          const float2 bb = OutTraits<OutT>::load2(bias + n);
          b0 = bb.x;
          b1 = bb.y;
        }
        // box = 64 columns (128 B) x 64 rows; 16-byte chunk index XOR (row % 8) = swizzle
        uint8_t* box = my_out + (c / 64) * 64 * 128;
        const int chunk = (c % 64) / 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row_in_wg + 8 * h;
          const uint32_t v = OutTraits<OutT>::pack(acc[4 * j + 2 * h] + b0, acc[4 * j + 2 * h + 1] + b1);
          *reinterpret_cast<uint32_t*>(box + r * 128 + ((chunk ^ (r % 8)) * 16) + (col_q * 2)) = v;
        }
      }
      fence_proxy_async_smem();
      named_barrier(1 + wg, 128);
      if (wg_leader) {
#pragma unroll
        for (int cb = 0; cb < BN / 64; ++cb)
          tma_store_2d(&tmap_c, my_out + cb * 64 * 128, nb * BN + cb * 64, mb * BM + wg * 64);
        tma_store_commit();
      }
    }
    if (threadIdx.x % 128 == 0) tma_store_wait_all();
  }
}

}  // namespace fp8l
