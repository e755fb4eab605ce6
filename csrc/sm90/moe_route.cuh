// The grouped decode kernel's routing inside the kernel (moe-tile-route, moe-token-rows): a
// sorted tile's expert and its rows' tokens found from the (token, slot) expert ids exactly as
// fp8linear/moe_routing.py's route places them, by CTAs that start before that routing is done.
#pragma once
#include <cstdint>

namespace fp8l {

// A layer's (token, slot) expert ids: `slots` of them, top_k a token, int64 or int32.
struct RouteIds {
  const void* ids;
  bool int64;
  int slots, experts, top_k;
};

// Sorted tile y's expert from the (token, slot) ids, as fp8linear/moe_routing.py's route places
// them: the first expert whose rows, each expert's padded to whole BT-token tiles, end after the
// tile's first row (-1: past them all; ids outside 0..experts-1 take no row). `counts`: shared
// scratch of experts + 3 ints, free again on return. tokens (not null): the token of each of
// the tile's rows, its expert's slots in slot order (-1: padding), and the tile's live rows.
template <int BT>
__device__ __forceinline__ int tile_expert_from_ids(const RouteIds& p, int* counts,
                                                    int* tokens = nullptr, int* live = nullptr) {
  const int experts = p.experts;
  auto id_at = [&](int s) -> long long {
    return p.int64 ? __ldg(static_cast<const long long*>(p.ids) + s)
                   : __ldg(static_cast<const int*>(p.ids) + s);
  };
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < p.slots; s += blockDim.x) {
    const long long id = id_at(s);
    if (id >= 0 && id < experts) atomicAdd(&counts[id], 1);
  }
  __syncthreads();
  const int row = blockIdx.y * BT;
  if (threadIdx.x < 32) {  // lane l: experts [l * per, (l + 1) * per), a scan over the lanes
    const int lane = threadIdx.x, per = (experts + 31) / 32;
    const int lo = min(lane * per, experts), hi = min(lo + per, experts);
    int rows = 0;
    for (int e = lo; e < hi; ++e) rows += (counts[e] + BT - 1) / BT * BT;
    int end = rows;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, end, d);
      if (lane >= d) end += v;
    }
    int found = -1, first = 0;
    if (row >= end - rows && row < end) {  // (one lane at most: the ranges are disjoint)
      int at = end - rows;
      for (int e = lo; e < hi && found < 0; ++e) {
        first = at;
        at += (counts[e] + BT - 1) / BT * BT;
        if (at > row) found = e;
      }
    }
    const unsigned any = __ballot_sync(0xffffffffu, found >= 0);
    if (found >= 0 || (lane == 0 && any == 0)) {
      counts[experts] = found;
      counts[experts + 1] = row - first;                     // the tile's first rank
      counts[experts + 2] = found >= 0 ? counts[found] : 0;  // its expert's slots
    }
  }
  __syncthreads();
  const int e = counts[experts];
  if (tokens != nullptr) {
    const int r0 = counts[experts + 1], n = counts[experts + 2];
    __syncthreads();  // (counts is reused below)
    if (threadIdx.x < BT) tokens[threadIdx.x] = -1;
    // the expert's slots ranked in slot order, blockDim at a time: a warp's by ballot, the
    // warps' before it by their counts
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    int base = 0;
    for (int s0 = 0; s0 < p.slots && base < r0 + BT; s0 += blockDim.x) {
      const int s = s0 + threadIdx.x;
      const bool mine = e >= 0 && s < p.slots && id_at(s) == e;
      const unsigned b = __ballot_sync(0xffffffffu, mine);
      if (lane == 0) counts[warp] = __popc(b);
      __syncthreads();
      int rank = base + __popc(b & ((1u << lane) - 1)), total = base;
      for (int w = 0; w < warps; ++w) {
        rank += w < warp ? counts[w] : 0;
        total += counts[w];
      }
      if (mine && rank >= r0 && rank < r0 + BT) tokens[rank - r0] = s / p.top_k;
      __syncthreads();
      base = total;
    }
    *live = e < 0 ? 0 : min(BT, n - r0);
  }
  __syncthreads();  // (the scratch is the weight ring's)
  return e;
}

// Whether this CTA is one of the grid's first kCtasPerSM an SM (its first wave, launched
// together; CTAs start in index order).
template <int kCtasPerSM>
__device__ __forceinline__ bool first_wave_cta() {
  uint32_t sms;
  asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
  const uint32_t cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  return cta < kCtasPerSM * sms;
}

}  // namespace fp8l
