// Instantiations and launch of the large-M kernel (gemm_kernel.cuh).
#include "common/launch.h"
#include "common/tma.h"
#include "sm90/api.h"
#include "sm90/tables.h"
#include "sm90/gemm_kernel.cuh"

namespace fp8l {
namespace {

// The tile configurations (index = GemmArgs::config), from sm90/tables.def; the dispatch
// rules (fp8linear/backends/sm90/plan.py) say when each is used.
struct Config {
  int bm, bn, stages, cluster;
  bool share_a, queue_next, split_tail;
  // 64-row tiles of <= 64 columns need <= 112 registers a thread: built lean
  // (gemm_kernel.cuh: kLean), so they start beside the previous kernel under PDL
  constexpr bool lean() const { return bm == 64 && bn <= 64; }
};
constexpr Config kConfigs[] = {
#define FP8L_GEMM_TILE(bm, bn, stages, cluster, share_a, queue_next, split_tail) \
  {bm, bn, stages, cluster, share_a, queue_next, split_tail},
#include "sm90/tables.def"
};

// A launch of `grid` CTAs in clusters of `cluster` along x (1: a plain launch, no cluster
// attribute); `attr` (room for one more) must outlive the config.
cudaLaunchConfig_t cluster_launch(int grid, int threads, int smem, cudaStream_t stream,
                                  int cluster, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = cluster > 1 ? 1 : 0;
  return cfg;
}

// CTAs of a cluster kernel that can be resident at once (clusters must fit inside a GPC);
// queried once per kernel and device: the occupancy call costs host time on every step.
template <auto Kernel>
int max_cluster_ctas(int cluster, int smem, int threads, int num_sms) {
  static int cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64) return num_sms;
  if (cached[dev] == 0) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_launch(num_sms, threads, smem, nullptr, cluster, &attr);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, Kernel, &cfg) != cudaSuccess || clusters <= 0)
      clusters = num_sms / cluster;
    cached[dev] = clusters * cluster;
  }
  return cached[dev];
}

template <int BM, int BN, int STAGES, int CLUSTER, bool kShareA, bool kPerRow, bool kLean,
          bool kQueueNext, bool kSplitTail, typename OutT, bool kGrouped = false,
          bool kSwiglu = false>
std::string launch(const GemmArgs& g, cudaStream_t stream) {
  using L = GemmSmem<BM, BN, STAGES, kSplitTail>;
  static_assert(L::kAlloc <= kSmemOneCtaPerSm, "shared memory over the sm_90 limit");
  const int num_kb = (g.K + kBlockK - 1) / kBlockK;
  CUtensorMap ta, tb, tsa, tc;
  std::string e;
  const auto sw128 = CU_TENSOR_MAP_SWIZZLE_128B;
  // Fewer tokens than a tile has rows: boxes of just the rows there are (8-row multiples for
  // A, 16-byte ones for its scales) instead of TMA zero-filling the rest, which cost as much
  // as a second block of rows (the smem rows past them hold stale data, whose output rows
  // lie past M and are never stored).
  const int a_rows = g.M < BM ? (g.M + 7) / 8 * 8 : BM;
  const int sa_cols = g.M < BM ? (g.M + 3) / 4 * 4 : BM;
  // a shared tile (weights, or activations with kShareA) is loaded and multicast in halves by
  // the two CTAs of a pair (activation halves of a_half rows, 8-row multiples so that rank 1's
  // half starts on a 1024-byte swizzle atom; rows past M are zero-filled by TMA)
  const int a_half = (a_rows / 2 + 7) / 8 * 8;
  // (grouped: 64-row boxes, a tile's rows in one or two: gemm_kernel.cuh's stage)
  if (!(e = make_tensor_map_2d(&ta, g.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, g.M, g.K, g.K,
                               kGrouped ? 64 : kShareA ? a_half : a_rows, kBlockK,
                               sw128)).empty())
    return e;
  // grouped: every expert's weights, [experts * N, K]; kSwiglu: a tile of two 64-row boxes
  const int w_rows = kGrouped ? g.experts * g.N : g.N;
  if (!(e = make_tensor_map_2d(&tb, g.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w_rows, g.K, g.K,
                               kShareA ? BN : BN / (kSwiglu ? 2 : CLUSTER), kBlockK,
                               sw128)).empty())
    return e;
  // token columns past M read as zero (their A rows are zero too): the scales may be a view
  // of a caller's tensor that ends at column M of its last row
  if (!(e = make_tensor_map_2d(&tsa, g.a_scale_t, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, num_kb,
                               g.M, g.a_scale_ld, 1, sa_cols,
                               CU_TENSOR_MAP_SWIZZLE_NONE)).empty())
    return e;
  const auto out_type = g.out_dtype == kOutBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  // output boxes as the kernel lays them out (GemmSmem::kBoxCols): 64 columns 128B-swizzled,
  // 32 columns 64B-swizzled, narrow tiles (BN <= 32, 48) one unswizzled box of BN columns
  const auto out_swizzle = L::kOneBox ? CU_TENSOR_MAP_SWIZZLE_NONE
                           : L::kBoxCols == 32 ? CU_TENSOR_MAP_SWIZZLE_64B : sw128;
  // (kSwiglu: fp8 h [M, N / 2] in 64-row boxes of a tile's 128 channels)
  if (!(e = kSwiglu ? make_tensor_map_2d(&tc, g.out, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, g.M,
                                         g.N / 2, g.N / 2, 64, BN, sw128)
                    : make_tensor_map_2d(&tc, g.out, out_type, 2, g.M, g.N, g.N, 64, L::kBoxCols,
                                         out_swizzle)).empty())
    return e;

  constexpr auto kernel = fp8_gemm_kernel<BM, BN, STAGES, CLUSTER, kShareA, kPerRow, kLean,
                                          kQueueNext, kSplitTail, OutT, kGrouped, kSwiglu>;
  constexpr int kThreads = L::kThreads;
  cudaError_t err = ensure_smem_limit<kernel>(L::kAlloc);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  // persistent: one CTA per SM (per cluster slot), never more CTAs than work units need
  const int units = Units(g.M, g.N, BM, BN, CLUSTER, kShareA, kSwiglu).count();
  int slots = g.num_sms / CLUSTER * CLUSTER;
  if (CLUSTER > 1) slots = max_cluster_ctas<kernel>(CLUSTER, L::kAlloc, kThreads, g.num_sms);
  int grid = units * CLUSTER < slots ? units * CLUSTER : slots;
  if constexpr (kSplitTail) {
    // the tail's parts in the last wave (gemm_kernel.cuh SplitTail): all tiles when they make
    // less than a wave, in as many parts as fill it (the kernel derives the same split from
    // this grid)
    const SplitTail st(units, num_kb, slots);
    if (units <= slots) grid = st.tail * st.parts;
    if (g.workspace == nullptr || g.counters == nullptr) return "split tail: no workspace";
  }
  const uint32_t stage_bytes =
      uint32_t((kShareA ? 2 * a_half : a_rows) * kBlockK + L::kBBytes + sa_cols * 4);
  // (the split tail requests no early weight stages: it runs from 512 tokens, where none are
  // asked)
  // (nor does the grouped GEMM: its first weights depend on the tile's expert)
  const int early_b = kSplitTail || kGrouped ? 0 : g.early_b;
  GemmParams p{g.M,         g.N,     g.K,     num_kb, g.w_scale, g.bias, g.bias_f32,
               stage_bytes, early_b, g.group_m > 1 ? g.group_m : 1,     a_half,
               g.workspace, g.counters, g.tile_expert, g.row_token, g.out_scale_t,
               g.out_scale_ld};
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = cluster_launch(grid, kThreads, L::kAlloc, stream, CLUSTER, attr);
  if (g.pdl) attr[cfg.numAttrs++] = pdl_attribute();
  err = cudaLaunchKernelEx(&cfg, kernel, ta, tb, tsa, tc, p);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

template <int I>
std::string dispatch_types(const GemmArgs& g, cudaStream_t stream) {
  constexpr Config c = kConfigs[I];
  constexpr int bm = c.bm, bn = c.bn, st = c.stages, cl = c.cluster;
  constexpr bool sa = c.share_a, ln = c.lean(), qn = c.queue_next, sk = c.split_tail;
  if (g.out_dtype == kOutBF16)
    return g.w_scale_per_row
               ? launch<bm, bn, st, cl, sa, true, ln, qn, sk, __nv_bfloat16>(g, stream)
               : launch<bm, bn, st, cl, sa, false, ln, qn, sk, __nv_bfloat16>(g, stream);
  return g.w_scale_per_row ? launch<bm, bn, st, cl, sa, true, ln, qn, sk, __half>(g, stream)
                           : launch<bm, bn, st, cl, sa, false, ln, qn, sk, __half>(g, stream);
}

// config index -> its instantiation, for every row of kConfigs (the table is the only list)
template <int I = 0>
std::string dispatch_config(const GemmArgs& g, cudaStream_t stream) {
  if constexpr (I < int(sizeof(kConfigs) / sizeof(kConfigs[0]))) {
    return g.config == I ? dispatch_types<I>(g, stream) : dispatch_config<I + 1>(g, stream);
  } else {
    return "unknown gemm config " + std::to_string(g.config);
  }
}

// The tiles the grouped prefill kernel is built for (GemmArgs::config of launch_moe_prefill)
constexpr int kMoePrefillConfigs[] = {
#define FP8L_MOE_PREFILL_TILE(config) config,
#include "sm90/tables.def"
};

// The grouped kernel on prefill tile I (kMoePrefillConfigs[I]) for the output type.
template <int I, bool kSwiglu>
std::string grouped(const GemmArgs& g, cudaStream_t stream) {
  constexpr Config c = kConfigs[kMoePrefillConfigs[I]];
  static_assert(c.bm == 128 && (c.bn == 128 || c.bn == 192) && !c.share_a && !c.split_tail,
                "the grouped kernel runs 128-row tiles of 128 or 192 columns, pairs along M");
  constexpr int bn = c.bn, st = c.stages, cl = c.cluster;
  constexpr bool qn = c.queue_next, kGrouped = true;
  if constexpr (kSwiglu && bn != 128) {
    return "the SiLU-and-mul epilogue runs 128-column tiles";
  } else {
    if (g.out_dtype == kOutBF16)
      return launch<128, bn, st, cl, false, false, false, qn, false, __nv_bfloat16, kGrouped,
                    kSwiglu>(g, stream);
    return launch<128, bn, st, cl, false, false, false, qn, false, __half, kGrouped, kSwiglu>(
        g, stream);
  }
}

// prefill config -> its instantiation, for every FP8L_MOE_PREFILL_TILE row
template <bool kSwiglu, int I = 0>
std::string dispatch_grouped(const GemmArgs& g, cudaStream_t stream) {
  if constexpr (I < int(sizeof(kMoePrefillConfigs) / sizeof(kMoePrefillConfigs[0]))) {
    return g.config == kMoePrefillConfigs[I] ? grouped<I, kSwiglu>(g, stream)
                                             : dispatch_grouped<kSwiglu, I + 1>(g, stream);
  } else {
    return "gemm config " + std::to_string(g.config) + " is not a grouped prefill tile";
  }
}

}  // namespace

// The prefill expert GEMM of a mixture-of-experts layer (gemm_kernel.cuh: kGrouped) on one of
// the kMoePrefillConfigs tiles: fp8 a sorted by expert in M blocks of 128 rows, each block's
// expert in tile_expert, w [experts, N, K] with 128x128 scales.
std::string launch_moe_prefill(const GemmArgs& g, cudaStream_t stream) {
  if (g.M <= 0 || g.N <= 0 || g.K <= 0 || g.experts <= 0) return "empty problem";
  if (g.tile_expert == nullptr || g.row_token == nullptr)
    return "grouped GEMMs need tile_expert and row_token";
  if (g.a_scale_t == nullptr) return "grouped GEMMs take fp8 activations (sorted by expert)";
  if (g.M % 128 != 0) return "M must be whole 128-row token tiles";
  if (g.N % 128 != 0 || g.K % 16 != 0) return "N must be a multiple of 128 and K of 16";
  if (g.a_scale_ld % 4 != 0 || g.a_scale_ld < g.M) return "a_scale_ld must be >= M and % 4";
  if (g.w_scale_per_row || g.bias != nullptr) return "grouped GEMMs take block scales, no bias";
  if (g.out_dtype != kOutBF16 && g.out_dtype != kOutFP16) return "outputs are bf16 or fp16";
  // out_scale_t: gate_up with SiLU-and-mul + quantization in the epilogue (fp8 h, N = 2I)
  if (g.out_scale_t == nullptr) return dispatch_grouped<false>(g, stream);
  if (g.N % 256 != 0) return "SiLU-and-mul: N (2I) must be a multiple of 256";
  if (g.out_scale_ld % 4 != 0 || g.out_scale_ld < g.M) return "out_scale_ld must be >= M and % 4";
  return dispatch_grouped<true>(g, stream);
}

std::string launch_gemm(const GemmArgs& g, cudaStream_t stream) {
  if (g.M <= 0 || g.N <= 0 || g.K <= 0) return "empty problem";
  if (g.K % 16 != 0 || g.N % 8 != 0) return "K must be a multiple of 16 and N of 8";
  if (g.a_scale_ld % 4 != 0 || g.a_scale_ld < g.M) return "a_scale_ld must be >= M and % 4";
  return dispatch_config(g, stream);
}

}  // namespace fp8l
