// Dev probe (issue 4's ceilings; not part of the package): a decode GEMM with free math.
//
// Each CTA owns `rows` weight rows and a K range, and streams them through a ring of
// `depth` shared-memory stages (a TMA box of rows x 128 bytes a stage, the decode kernel's
// own weight loads, evict-first) as the decode kernel does,
// except that the consumer does no math: it waits for the previous kernel
// (griddepcontrol.wait, standing in for the activations' dependency), then releases each
// stage as it lands. So no ring slot is reused before the dependency is met, as in a real
// GEMM, and what this reaches is a ceiling for any kernel that stages weights through
// shared memory and depends on its predecessor. `empty_launch` is a kernel that only
// waits for its predecessor and releases its dependents: put before a GEMM, it adds the
// least any second kernel (a quantization kernel) can add to a step.
//
// Built on the device: nvcc -arch=sm_90a -O3 -shared -Xcompiler -fPIC -Icsrc (no torch headers).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/tma.h"

using namespace fp8l;

namespace {

struct CeilingParams {
  const uint8_t* w;
  int n, k;
  float* out;  // a float a CTA (the consumer's checksum), or [n, 8] floats (epilogue)
  int rows, splits, depth, trigger_early, layout;
  // The parts of a decode GEMM other than the weight stream and the math, each optional:
  int act;           // an 8-token fp8 activation tile a stage from tx (TMA), requested by the
                     // producer after `first` weight stages and griddepcontrol.wait, as the
                     // decode kernel does (the consumer then does not wait itself)
  int first;         // weight stages before the activations (0: the whole ring)
  int reduce;        // splits > 1: partials [rows x 8] fp32 to `ws`, the last CTA of a tile
                     // (counters) sums them in split order and writes the tile
  float* ws;
  int* counters;     // a counter a tile, zero at launch; the last CTA resets it
};

// grid: (row tiles x splits); block: 64 threads (warp 0 produces, warp 1 consumes).
// layout 0: 2D TMA boxes of rows x 128 bytes (swizzled, as the decode kernel loads weights);
// layout 1: one contiguous bulk copy a stage (the friendliest DRAM pattern; an upper bound).
__global__ void __launch_bounds__(64) read_ceiling(const __grid_constant__ CUtensorMap tw,
                                                   const __grid_constant__ CUtensorMap tx,
                                                   const CeilingParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int wbytes = p.rows * 128;
  const int stage_bytes = wbytes + (p.act ? 8 * 128 : 0);
  const int depth = p.depth;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + depth * stage_bytes);
  uint64_t* empty = full + depth;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile = blockIdx.x / p.splits, split = blockIdx.x % p.splits;
  const int row0 = tile * p.rows;
  const int kblocks = (p.k + 127) / 128;
  const int per = (kblocks + p.splits - 1) / p.splits;
  const int kb0 = split * per, kb1 = min(kblocks, kb0 + per);
  const int kbs = kb1 - kb0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < depth; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 1);
    }
    fence_barrier_init();
    tma_prefetch_desc(&tw);
    if (p.act) tma_prefetch_desc(&tx);
  }
  __syncthreads();
  if (p.trigger_early) pdl_launch_dependents();
  float acc = 0.f;
  if (warp == 0) {
    if (lane == 0) {
      const uint64_t once = l2_policy_evict_first();
      const uint64_t keep = l2_policy_evict_last();
      int first = kbs < depth ? kbs : depth;
      if (p.first > 0 && p.first < first) first = p.first;
      for (int i = 0; i < kbs; ++i) {
        const int kb = kb0 + i, slot = i % depth;
        if (i >= depth) mbar_wait(&empty[slot], ((i / depth) - 1) & 1);
        mbar_arrive_expect_tx(&full[slot], stage_bytes);
        if (p.layout == 0) {
          tma_load_2d(smem + slot * stage_bytes, &tw, &full[slot], kb * 128, row0, once);
        } else {
          const size_t off = (static_cast<size_t>(tile) * kblocks + kb) * wbytes;
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
              " [%0], [%1], %2, [%3];" ::"r"(smem_u32(smem + slot * stage_bytes)),
              "l"(p.w + off), "r"(wbytes), "r"(smem_u32(&full[slot]))
              : "memory");
        }
        if (!p.act) continue;
        if (i == first - 1) {
          pdl_wait();
          for (int j = 0; j < first; ++j)
            tma_load_2d(smem + j * stage_bytes + wbytes, &tx, &full[j], (kb0 + j) * 128, 0,
                        keep);
        } else if (i >= first) {
          tma_load_2d(smem + slot * stage_bytes + wbytes, &tx, &full[slot], kb * 128, 0, keep);
        }
      }
    }
  } else {
    if (!p.act) pdl_wait();  // the activations' dependency
    for (int i = 0; i < kbs; ++i) {
      const int slot = i % depth;
      mbar_wait(&full[slot], (i / depth) & 1);
      acc += static_cast<float>(smem[slot * stage_bytes + lane * 4]);
      if (p.act) acc += static_cast<float>(smem[slot * stage_bytes + wbytes + lane * 4]);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
    }
    if (!p.trigger_early) pdl_launch_dependents();
    if (!p.reduce) {
      if (lane == 0) p.out[blockIdx.x] = acc;
      return;
    }
    // the tile's [rows x 8] fp32 partial (acc standing in for it), 16-byte stores
    const int per_tile = p.rows * 8;
    float4 v = make_float4(acc, acc, acc, acc);
    float4* mine = reinterpret_cast<float4*>(p.ws + (size_t(tile) * p.splits + split) * per_tile);
    for (int e = lane; e < per_tile / 4; e += 32) mine[e] = v;
    if (p.splits == 1) return;
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atom_add_acq_rel_gpu(&p.counters[tile], 1) == p.splits - 1;
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    for (int e = lane; e < per_tile / 4; e += 32) {
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s = 0; s < p.splits; ++s) {
        const float4 t = __ldcg(reinterpret_cast<const float4*>(
            p.ws + (size_t(tile) * p.splits + s) * per_tile) + e);
        sum.x += t.x; sum.y += t.y; sum.z += t.z; sum.w += t.w;
      }
      reinterpret_cast<float4*>(p.out + size_t(tile) * per_tile)[e] = sum;
    }
    if (lane == 0) p.counters[tile] = 0;
  }
}

// trigger_first: release the dependents before waiting, as the quantization kernel does
__global__ void empty_kernel(int trigger_first) {
  if (trigger_first) pdl_launch_dependents();
  pdl_wait();
  if (!trigger_first) pdl_launch_dependents();
}

cudaError_t launch(const void* fn, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   void** args, bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr = pdl_attribute();
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelExC(&cfg, fn, args);
}

}  // namespace

extern "C" {

// CTAs: ceil(n / rows) * splits. smem_pad raises the CTA's shared memory (to cap CTAs an SM).
// x: [8, k] fp8 activations (act). Returns a CUDA error code, or -1 where a tensor map cannot
// be made.
int ceiling_launch(void* stream, const void* w, int n, int k, float* out, int rows, int splits,
                   int depth, int trigger_early, int smem_pad, int pdl, int layout,
                   const void* x, int act, int first, int reduce, float* ws, int* counters) {
  const int stage_bytes = rows * 128 + (act ? 8 * 128 : 0);
  size_t smem = static_cast<size_t>(depth) * stage_bytes + 2 * depth * sizeof(uint64_t);
  if (smem < static_cast<size_t>(smem_pad)) smem = smem_pad;
  cudaError_t e = ensure_smem_limit<read_ceiling>(static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  CUtensorMap tw, tx{};
  if (!make_tensor_map_2d(&tw, w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, n, k, k, rows, 128,
                          CU_TENSOR_MAP_SWIZZLE_128B)
           .empty())
    return -1;
  if (act && !make_tensor_map_2d(&tx, x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 8, k, k, 8, 128,
                                 CU_TENSOR_MAP_SWIZZLE_128B)
                  .empty())
    return -1;
  CeilingParams p{static_cast<const uint8_t*>(w), n, k, out, rows, splits, depth,
                  trigger_early, layout, act, first, reduce, ws, counters};
  void* args[] = {&tw, &tx, &p};
  dim3 grid((n + rows - 1) / rows * splits);
  return launch(reinterpret_cast<const void*>(read_ceiling), grid, dim3(64), smem,
                static_cast<cudaStream_t>(stream), args, pdl != 0);
}

// grid CTAs of `threads` threads (the quantization kernel's launch: empty, its grid's cost)
int empty_launch(void* stream, int pdl, int trigger_first, int grid, int threads) {
  void* args[] = {&trigger_first};
  return launch(reinterpret_cast<const void*>(empty_kernel), dim3(grid), dim3(threads), 0,
                static_cast<cudaStream_t>(stream), args, pdl != 0);
}

}  // extern "C"
