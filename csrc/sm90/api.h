// Host-side entry points of the sm90 kernels. Plain C++ (raw pointers, cudaStream_t): no torch
// headers; csrc/capi.cpp exposes them to Python through C entry points.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace fp8l {

// output and activation data type codes (sm90/tables.def)
enum OutDType : int {
#define FP8L_OUT_DTYPE(name, code) name = code,
#include "sm90/tables.def"
};

struct GemmArgs {
  const void* a;          // [M, K] fp8 e4m3, row-major
  const float* a_scale_t; // [num_kb, a_scale_ld] fp32 (token-minor: TMA-loadable per K block)
  int a_scale_ld;         // >= M, multiple of 4 (16-byte rows for TMA)
  const void* w;          // [N, K] fp8 e4m3, row-major
  const float* w_scale;   // [ceil(N/128), num_kb] or [N, num_kb]
  bool w_scale_per_row;
  const void* bias;       // [N] in the output dtype or fp32 (bias_f32), or nullptr
  bool bias_f32;
  void* out;              // [M, N] bf16/fp16
  int out_dtype;
  int M, N, K;
  int config;             // tile configuration, chosen by fp8linear/backends/sm90/plan.py
  int num_sms;
  bool pdl;               // programmatic dependent launch (prologue overlaps the previous kernel)
  int early_b;            // (pdl) first weight stages requested before waiting for the previous kernel
  int group_m;            // tile order: M units walked before the next N unit (>= 1)
  float* workspace;       // split-tail configs: fp32 [num_sms * BM * BN] (a partial tile a CTA)
  int* counters;          // split-tail configs: int32 [tiles], zero; the kernel leaves them zero
  // Grouped (mixture of experts, launch_moe_prefill): w [experts, N, K], a the tokens sorted by
  // expert in 128-row tiles, tile_expert [M / 128] each tile's expert (-1: unused). Dense:
  // nullptr and 1.
  const int* tile_expert;
  // Grouped: each sorted row's token, int64, -1 on padding rows (an expert's rows come first in
  // its tiles): a tile whose rows from 64 on are padding runs half its MMAs. Dense: nullptr.
  const int64_t* row_token;
  int experts;
  // Grouped gate_up (N = 2I) with SiLU-and-mul + quantization in the epilogue: out is then fp8
  // h [M, I] (out_dtype: the activations' dtype, to which gate and up round first) and
  // out_scale_t its scales [I / 128, out_scale_ld] (token-minor). nullptr: out as computed.
  float* out_scale_t;
  int out_scale_ld;
};

// Large-M persistent TMA + wgmma kernel. Returns "" on success, else the error.
std::string launch_gemm(const GemmArgs& args, cudaStream_t stream);
// The grouped expert GEMM for many tokens an expert (sm90/gemm.cu, the large-M kernel).
std::string launch_moe_prefill(const GemmArgs& args, cudaStream_t stream);

// Per-token, per-128-channel activation quantization:
// x [M, K] (bf16/fp16/fp32) -> q [M, K] fp8, scale_t [num_kb, scale_ld] fp32.
enum InDType : int {
#define FP8L_IN_DTYPE(name, code) name = code,
#include "sm90/tables.def"
};
// pdl: launched under programmatic dependent launch (waits for the previous kernel in-kernel)
std::string launch_quant(const void* x, int in_dtype, void* q, float* scale_t, int scale_ld,
                         int M, int K, bool pdl, cudaStream_t stream);

}  // namespace fp8l

namespace fp8l {

// Skinny decode GEMM: swap-AB (weights on wgmma's 64-row side, tokens on its narrow side),
// split-K over the CTAs with a deterministic in-kernel reduction, activation quantization fused.
struct DecodeArgs {
  const void* x;          // [M, K] bf16/fp16 activations (quantized inside the kernel),
  int x_dtype;            // kInBF16 / kInFP16, or kInFP8: already quantized,
  const float* x_scale;   // with fp32 scales: (m, kb) at x_scale[m * xs_stride_m + kb * xs_stride_kb]
  int xs_stride_m, xs_stride_kb;
  const void* w;          // [N, K] fp8
  const float* w_scale;   // [ceil(N/128), num_kb] or [N, num_kb]
  bool w_scale_per_row;
  const void* bias;       // [N] in the output dtype or fp32 (bias_f32), or nullptr
  bool bias_f32;
  void* out;              // [M, N]
  int out_dtype;
  float* workspace;       // fp32 [splits * tiles * BT * (64 or 128)] when splits > 1
  int* counters;          // int32 [tiles], zero; the kernel leaves them zero again
  int M, N, K;
  int config;             // token tile BT = 8 << config (8..128)
  int rows;               // weight rows a CTA owns: 64 (token tiles <= 64), 128, or 72..120 (a
                          // multiple of 8) in a 128-row CTA, one an SM
  int splits;             // K-splits (1 = no reduction)
  int ctas_per_sm;        // 1, or 2 (token tiles <= 32): half the shared memory and registers,
                          // so the next kernel's CTAs fit beside ours under PDL
  bool pdl;               // programmatic dependent launch
  bool early_trigger;     // (pdl) the next kernel may launch as soon as ours has started
  int num_sms;            // of the device (whether the grid fits in one wave)
  // Grouped (mixture of experts, launch_moe_decode): w [experts, N, K], w_scale [experts, ...],
  // x the tokens sorted by expert in token tiles of BT, tile_expert [M / BT] each tile's expert
  // (-1: unused). Dense: nullptr and 1.
  const int* tile_expert;
  int experts;
  // Slot tiles (launch_moe_decode, top_k > 0; few tokens, no routing): x [M / top_k, K] the
  // tokens (16-bit), or with silu_in [M, 2K] gate | up rows of the pairs; tile_expert points at
  // topk_ids [M] (int64 where ids_int64); out [M, N] a row a (token, slot) pair; ids_ready: the
  // ids were written before the previous kernel (else read after waiting for it, under PDL).
  int top_k, ids_int64, ids_ready, silu_in;
  // Weight stages a CTA keeps in flight: -1 the rule (decode_launch.cuh window_stages), 0 the
  // whole ring, n > 0 at most n (relaying plans keep theirs)
  int window;
  // Grouped sorted tiles, route_slots > 0: route_ids holds the route_slots (token, slot) expert
  // ids (int64 where ids_int64), written before the previous kernel, from which the first
  // wave's CTAs find their tile's expert (moe-tile-route); later ones read tile_expert
  const void* route_ids;
  int route_slots;
  // Grouped sorted tiles of 16-bit x (with route_slots): x the tokens [M', K], row_token [M]
  // each sorted row's token (int64, -1: padding), read and quantized in the kernel (no
  // gather); route_top_k the slots a token of route_ids
  const long long* row_token;
  int route_top_k;
};
std::string launch_decode(const DecodeArgs& args, cudaStream_t stream);
// The grouped expert GEMM (sm90/moe.cu): fp8 x, 128-row CTAs, bf16/fp16 outputs.
std::string launch_moe_decode(const DecodeArgs& args, cudaStream_t stream);

}  // namespace fp8l
