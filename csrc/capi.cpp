// The kernel library's C entry points: raw device pointers, sizes and the CUDA stream; no
// torch, no Python. fp8linear/backends/sm90/library.py loads the library with ctypes, so one
// build serves every torch and Python version. Each entry point takes one argument struct
// (sm90/tables.def lists its fields, which Python packs in one call: a few hundred ns, where
// ctypes' per-argument conversions cost microseconds) and returns nullptr on success, else
// the error text (valid until the calling thread's next call).
//
// Scratch (quantized activations, split-K partials, the split reductions' tile counters) is the
// library's own: one grow-only device buffer per (device, stream), reused by every launch on
// that stream in stream order, never freed while a captured CUDA graph may still use it.
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "sm90/api.h"
#include "sm90/tables.h"

namespace {

thread_local std::string g_error;

const char* result(const std::string& err, const char* what) {
  if (err.empty()) return nullptr;
  g_error = std::string("fp8linear ") + what + ": " + err;
  return g_error.c_str();
}

// A device allocation of at least `bytes`, zeroed when new, made while the stream may be
// capturing a CUDA graph: allocation and memset are not capturable, so they run with this
// thread's capture mode relaxed and the memset on a side stream, outside the capture.
cudaError_t alloc_zeroed(void** ptr, size_t bytes) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess) return e;
  cudaStream_t side = nullptr;
  e = cudaMalloc(ptr, bytes);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMemsetAsync(*ptr, 0, bytes, side);
  if (e == cudaSuccess) e = cudaStreamSynchronize(side);
  if (side != nullptr) cudaStreamDestroy(side);
  cudaThreadExchangeStreamCaptureMode(&mode);
  return e;
}

// Scratch of one (device, stream). `counters` must be zero between launches: the last CTA of
// a split tile resets its own counter, so they stay zero with no memset per call.
struct Scratch {
  void* bytes = nullptr;
  size_t n_bytes = 0;
  int* counters = nullptr;
  size_t n_counters = 0;
};

std::mutex g_mu;
std::map<std::pair<int, cudaStream_t>, Scratch> g_scratch;
std::vector<void*> g_outgrown;  // kept: graphs captured before their growth may use them

// Scratch for a launch on `stream`: at least `bytes` bytes and `tiles` zeroed counters.
cudaError_t scratch(cudaStream_t stream, size_t bytes, size_t tiles, Scratch* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  Scratch& s = g_scratch[{dev, stream}];
  if (bytes > s.n_bytes) {
    const size_t want = bytes > 2 * s.n_bytes ? bytes : 2 * s.n_bytes;
    void* p = nullptr;
    if ((e = alloc_zeroed(&p, want)) != cudaSuccess) return e;
    if (s.bytes != nullptr) g_outgrown.push_back(s.bytes);
    s.bytes = p;
    s.n_bytes = want;
  }
  if (tiles > s.n_counters) {
    const size_t want = tiles > 4096 ? tiles : 4096;
    void* p = nullptr;
    if ((e = alloc_zeroed(&p, want * sizeof(int))) != cudaSuccess) return e;
    if (s.counters != nullptr) g_outgrown.push_back(s.counters);
    s.counters = static_cast<int*>(p);
    s.n_counters = want;
  }
  *out = s;
  return cudaSuccess;
}

constexpr size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// This library carries its own (static) CUDA runtime, whose current device is not torch's:
// every entry point makes the tensors' device current here first (its primary context, the
// one torch uses, so nothing else changes).
cudaError_t use_device(int device) {
  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e == cudaSuccess && cur == device) return e;
  return cudaSetDevice(device);
}

int num_sms() {
  static int cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64) return 132;
  if (cached[dev] == 0) cudaDeviceGetAttribute(&cached[dev], cudaDevAttrMultiProcessorCount, dev);
  return cached[dev];
}

// Bytes the quant kernel's output takes in scratch: fp8 [M, K], then the token-minor scales
// [num_kb, ld] (ld = M rounded up to 4: 16-byte TMA rows), 16-byte aligned.
size_t quant_bytes(int m, int k) {
  const size_t num_kb = (k + 127) / 128, ld = (m + 3) / 4 * 4;
  return align16(size_t(m) * k) + num_kb * ld * 4;
}

std::string quantize_into(const void* x, int x_dtype, int m, int k, bool pdl, void* base,
                          cudaStream_t stream, void** q, float** scale_t, int* ld) {
  *q = base;
  *scale_t = reinterpret_cast<float*>(static_cast<uint8_t*>(base) + align16(size_t(m) * k));
  *ld = (m + 3) / 4 * 4;
  return fp8l::launch_quant(x, x_dtype, *q, *scale_t, *ld, m, k, pdl, stream);
}

}  // namespace

// The argument structs, field by field from sm90/tables.def.
using fp8l_ptr = const void*;
using fp8l_i64 = long long;
using fp8l_i32 = int;
#define FP8L_FIELD(kind, name) fp8l_##kind name;
#define FP8L_SKIP(kind, name)

struct QuantCall {
#define FP8L_ARG(entry, kind, name) FP8L_ARG_##entry(kind, name)
#define FP8L_ARG_quant FP8L_FIELD
#define FP8L_ARG_gemm FP8L_SKIP
#define FP8L_ARG_decode FP8L_SKIP
#include "sm90/tables.def"
#undef FP8L_ARG_quant
#undef FP8L_ARG_gemm
#undef FP8L_ARG_decode
};
struct GemmCall {
#define FP8L_ARG(entry, kind, name) FP8L_ARG_##entry(kind, name)
#define FP8L_ARG_quant FP8L_SKIP
#define FP8L_ARG_gemm FP8L_FIELD
#define FP8L_ARG_decode FP8L_SKIP
#include "sm90/tables.def"
#undef FP8L_ARG_quant
#undef FP8L_ARG_gemm
#undef FP8L_ARG_decode
};
struct DecodeCall {
#define FP8L_ARG(entry, kind, name) FP8L_ARG_##entry(kind, name)
#define FP8L_ARG_quant FP8L_SKIP
#define FP8L_ARG_gemm FP8L_SKIP
#define FP8L_ARG_decode FP8L_FIELD
#include "sm90/tables.def"
#undef FP8L_ARG_quant
#undef FP8L_ARG_gemm
#undef FP8L_ARG_decode
};

#define FP8L_API __attribute__((visibility("default")))

extern "C" {

// Version of this interface: library.py refuses a library whose version differs.
FP8L_API int fp8l_abi_version() { return fp8l::kAbiVersion; }

// sizeof of each argument struct: library.py checks its packed layout against them at load.
FP8L_API int fp8l_arg_size(int entry) {
  return entry == 0 ? int(sizeof(QuantCall)) : entry == 1 ? int(sizeof(GemmCall))
                                                          : int(sizeof(DecodeCall));
}

// Per-token, per-128-channel quantization: x [M, K] -> q [M, K] fp8, scale_t [num_kb, scale_ld].
FP8L_API const char* fp8l_quant(const QuantCall* c) {
  const cudaError_t e = use_device(c->device);
  if (e != cudaSuccess) return result(cudaGetErrorString(e), "quant device");
  return result(fp8l::launch_quant(c->x, c->x_dtype, const_cast<void*>(c->q),
                                   static_cast<float*>(const_cast<void*>(c->scale_t)),
                                   c->scale_ld, c->m, c->k, c->pdl != 0,
                                   static_cast<cudaStream_t>(const_cast<void*>(c->stream))),
                "quant");
}

// Large-M GEMM (fp8l::GemmArgs). a_scale_t null: `a` holds 16/32-bit activations that the
// quant kernel quantizes first (under PDL when quant_pdl); the grouped kernel
// (tile_expert) takes quantized activations only, and refuses others itself.
FP8L_API const char* fp8l_gemm(const GemmCall* c) {
  const auto s = static_cast<cudaStream_t>(const_cast<void*>(c->stream));
  const bool quant_first = c->a_scale_t == nullptr && c->tile_expert == nullptr;
  const size_t q_bytes = quant_first ? align16(quant_bytes(c->m, c->k)) : 0;
  Scratch sc;
  cudaError_t e = use_device(c->device);
  if (e == cudaSuccess) e = scratch(s, q_bytes + size_t(c->ws_floats) * 4, size_t(c->tiles), &sc);
  if (e != cudaSuccess) return result(cudaGetErrorString(e), "gemm scratch");
  fp8l::GemmArgs g{};
  if (quant_first) {
    void* q = nullptr;
    float* st = nullptr;
    int ld = 0;
    const std::string err = quantize_into(c->a, c->a_dtype, c->m, c->k, c->quant_pdl != 0,
                                          sc.bytes, s, &q, &st, &ld);
    if (!err.empty()) return result(err, "quant");
    g.a = q;
    g.a_scale_t = st;
    g.a_scale_ld = ld;
  } else {
    g.a = c->a;
    g.a_scale_t = static_cast<const float*>(c->a_scale_t);
    g.a_scale_ld = c->a_scale_ld;
  }
  g.w = c->w;
  g.w_scale = static_cast<const float*>(c->w_scale);
  g.w_scale_per_row = c->per_row != 0;
  g.bias = c->bias;
  g.bias_f32 = c->bias_f32 != 0;
  g.out = const_cast<void*>(c->out);
  g.out_dtype = c->out_dtype;
  g.M = c->m;
  g.N = c->n;
  g.K = c->k;
  g.config = c->config;
  g.num_sms = num_sms();
  g.pdl = c->pdl != 0;
  g.early_b = c->early_b;
  g.group_m = c->group_m;
  if (c->ws_floats > 0) {
    g.workspace = reinterpret_cast<float*>(static_cast<uint8_t*>(sc.bytes) + q_bytes);
    g.counters = sc.counters;
  }
  g.tile_expert = static_cast<const int*>(c->tile_expert);
  g.row_token = static_cast<const int64_t*>(c->row_token);
  g.experts = c->experts;
  g.out_scale_t = static_cast<float*>(const_cast<void*>(c->out_scale_t));
  g.out_scale_ld = c->out_scale_ld;
  if (g.tile_expert != nullptr) return result(fp8l::launch_moe_prefill(g, s), "moe prefill");
  return result(fp8l::launch_gemm(g, s), "gemm");
}

// Decode GEMM (fp8l::DecodeArgs): fp8 x with its scales; or bf16/fp16 x quantized in the
// kernel, or by the quant kernel first (quant_first).
FP8L_API const char* fp8l_decode(const DecodeCall* c) {
  const auto s = static_cast<cudaStream_t>(const_cast<void*>(c->stream));
  const size_t q_bytes = c->quant_first ? align16(quant_bytes(c->m, c->k)) : 0;
  Scratch sc;
  cudaError_t e = use_device(c->device);
  if (e == cudaSuccess) e = scratch(s, q_bytes + size_t(c->ws_floats) * 4, size_t(c->tiles), &sc);
  if (e != cudaSuccess) return result(cudaGetErrorString(e), "decode scratch");
  fp8l::DecodeArgs d{};
  if (c->quant_first) {
    // (under PDL: after a decode GEMM that lets its dependents launch early, the quant kernel
    // starts at once and waits for its input in-kernel)
    void* q = nullptr;
    float* st = nullptr;
    int ld = 0;
    const std::string err = quantize_into(c->x, c->x_dtype, c->m, c->k, c->pdl != 0, sc.bytes,
                                          s, &q, &st, &ld);
    if (!err.empty()) return result(err, "quant");
    d.x = q;
    d.x_dtype = fp8l::kInFP8;
    d.x_scale = st;  // token-minor [num_kb, ld]
    d.xs_stride_m = 1;
    d.xs_stride_kb = ld;
  } else {
    d.x = c->x;
    d.x_dtype = c->x_dtype;
    d.x_scale = static_cast<const float*>(c->x_scale);
    d.xs_stride_m = c->xs_stride_m;
    d.xs_stride_kb = c->xs_stride_kb;
  }
  if (c->ws_floats > 0)
    d.workspace = reinterpret_cast<float*>(static_cast<uint8_t*>(sc.bytes) + q_bytes);
  d.counters = sc.counters;
  d.w = c->w;
  d.w_scale = static_cast<const float*>(c->w_scale);
  d.w_scale_per_row = c->per_row != 0;
  d.bias = c->bias;
  d.bias_f32 = c->bias_f32 != 0;
  d.out = const_cast<void*>(c->out);
  d.out_dtype = c->out_dtype;
  d.M = c->m;
  d.N = c->n;
  d.K = c->k;
  d.config = c->config;
  d.rows = c->rows;
  d.splits = c->splits;
  d.ctas_per_sm = c->ctas_per_sm;
  d.pdl = c->pdl != 0;
  d.early_trigger = c->early_trigger != 0;
  d.num_sms = num_sms();
  d.tile_expert = static_cast<const int*>(c->tile_expert);
  d.experts = c->experts;
  d.top_k = c->top_k;
  d.ids_int64 = c->ids_int64;
  d.ids_ready = c->ids_ready;
  d.silu_in = c->silu_in;
  d.window = c->window;
  d.route_ids = c->route_ids;
  d.route_slots = c->route_slots;
  d.row_token = static_cast<const long long*>(c->row_token);
  d.route_top_k = c->route_top_k;
  if (d.tile_expert != nullptr) return result(fp8l::launch_moe_decode(d, s), "grouped decode");
  return result(fp8l::launch_decode(d, s), "decode");
}

}  // extern "C"
