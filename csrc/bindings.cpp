// torch <-> kernel glue: the only translation unit that includes torch headers. Python
// (fp8linear/ops.py, backends/sm90/backend.py) has already validated dtypes, shapes and
// strides; here we only take pointers and the current stream, and turn a launch error into an
// exception.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "sm90/api.h"

namespace {

void check(const std::string& err, const char* what) {
  TORCH_CHECK(err.empty(), "fp8linear ", what, ": ", err);
}

int num_sms(int device) {
  static int cached[64] = {0};
  if (cached[device] == 0) {
    cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device);
  }
  return cached[device];
}

int out_code(const at::Tensor& out) {
  return out.scalar_type() == at::kBFloat16 ? fp8l::kOutBF16 : fp8l::kOutFP16;
}

int in_code(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 ? fp8l::kInBF16
         : x.scalar_type() == at::kHalf   ? fp8l::kInFP16
         : x.scalar_type() == at::kFloat  ? fp8l::kInFP32
                                          : fp8l::kInFP8;
}

// 16/32-bit activations x [M,K] quantized by the quant kernel into one scratch allocation:
// fp8 [M,K], then the token-minor scales [num_kb, ld] (ld = M rounded up to 4: 16-byte TMA
// rows) 16-byte aligned after them. Allocated here rather than in Python, where each
// torch.empty costs ~4 us of host time; freed at return, which the caching allocator makes
// safe for work queued on this stream (and capture keeps it in the graph's pool).
struct Quantized {
  at::Tensor scratch;
  void* q;
  float* scale_t;
  int ld;
};
Quantized quantize(const at::Tensor& x, bool pdl) {
  const int64_t m = x.size(0), k = x.size(1), num_kb = (k + 127) / 128;
  const int64_t ld = (m + 3) / 4 * 4, q_bytes = (m * k + 15) / 16 * 16;
  Quantized r;
  r.scratch = at::empty({q_bytes + num_kb * ld * 4}, x.options().dtype(at::kByte));
  r.q = r.scratch.data_ptr();
  r.scale_t = reinterpret_cast<float*>(static_cast<uint8_t*>(r.q) + q_bytes);
  r.ld = int(ld);
  check(fp8l::launch_quant(x.data_ptr(), in_code(x), r.q, r.scale_t, r.ld, int(m), int(k), pdl,
                           at::cuda::getCurrentCUDAStream()),
        "quant");
  return r;
}

at::Tensor tile_counters(const at::Tensor& like, int64_t tiles);

// a [M,K] fp8 with a_scale_t [num_kb, M] fp32 (row stride ld, a multiple of 4); or, without
// a_scale_t, 16/32-bit activations quantized first (quant_pdl: that kernel under PDL). w [N,K]
// fp8; w_scale blocks or per-row; out [M,N]. workspace_floats > 0 (split-tail configurations):
// their fp32 workspace, allocated here, and `tiles` counters.
void gemm(const at::Tensor& a, const c10::optional<at::Tensor>& a_scale_t, const at::Tensor& w,
          const at::Tensor& w_scale, bool per_row, const c10::optional<at::Tensor>& bias,
          at::Tensor& out, int64_t config, bool pdl, bool quant_pdl, int64_t early_b,
          int64_t group_m, int64_t workspace_floats, int64_t tiles) {
  const c10::cuda::CUDAGuard guard(a.device());
  fp8l::GemmArgs g{};
  Quantized qa;
  if (a_scale_t.has_value()) {
    g.a = a.data_ptr();
    g.a_scale_t = a_scale_t->data_ptr<float>();
    g.a_scale_ld = int(a_scale_t->stride(0));
  } else {
    qa = quantize(a, quant_pdl);
    g.a = qa.q;
    g.a_scale_t = qa.scale_t;
    g.a_scale_ld = qa.ld;
  }
  g.w = w.data_ptr();
  g.w_scale = w_scale.data_ptr<float>();
  g.w_scale_per_row = per_row;
  g.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  g.bias_f32 = bias.has_value() && bias->scalar_type() == at::kFloat;
  g.out = out.data_ptr();
  g.out_dtype = out_code(out);
  g.M = int(a.size(0));
  g.N = int(w.size(0));
  g.K = int(w.size(1));
  g.config = int(config);
  g.num_sms = num_sms(a.get_device());
  g.pdl = pdl;
  g.early_b = int(early_b);
  g.group_m = int(group_m);
  at::Tensor workspace;
  if (workspace_floats > 0) {
    workspace = at::empty({workspace_floats}, a.options().dtype(at::kFloat));
    g.workspace = workspace.data_ptr<float>();
    g.counters = tile_counters(a, tiles).data_ptr<int>();
  }
  check(fp8l::launch_gemm(g, at::cuda::getCurrentCUDAStream()), "gemm");
}

void quant(const at::Tensor& x, at::Tensor& q, at::Tensor& scale_t, bool pdl) {
  const c10::cuda::CUDAGuard guard(x.device());
  check(fp8l::launch_quant(x.data_ptr(), in_code(x), q.data_ptr(), scale_t.data_ptr<float>(),
                           int(scale_t.size(1)), int(x.size(0)), int(x.size(1)), pdl,
                           at::cuda::getCurrentCUDAStream()),
        "quant");
}

// A new int32 array of zeros, zeroed now also while the current stream is being captured
// into a CUDA graph: at::zeros there would only record its fill in the graph, and eager calls
// on that stream before the graph's first replay would count from whatever the memory held
// (a split reduction then never finds its last CTA: unwritten output). The fill then runs on
// a side stream outside the capture (relaxed capture mode for this thread meanwhile).
at::Tensor zeroed_ints(const at::Tensor& like, int64_t n) {
  at::Tensor t = at::empty({n}, like.options().dtype(at::kInt));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TORCH_CHECK(cudaStreamIsCapturing(stream, &status) == cudaSuccess, "cudaStreamIsCapturing");
  if (status == cudaStreamCaptureStatusNone) return t.zero_();
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  TORCH_CHECK(cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess, "capture mode");
  cudaStream_t side = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMemsetAsync(t.data_ptr(), 0, size_t(n) * sizeof(int), side);
  if (e == cudaSuccess) e = cudaStreamSynchronize(side);
  if (side != nullptr) cudaStreamDestroy(side);
  cudaThreadExchangeStreamCaptureMode(&mode);
  TORCH_CHECK(e == cudaSuccess, "zeroing the tile counters: ", cudaGetErrorString(e));
  return t;
}

// The split reduction's tile counters: int32, zero between launches (the last CTA of a tile
// resets its own, so no memset per call and CUDA-graph replays find them zero). One array
// per (device, stream): decode GEMMs on concurrent streams never share one. Grown on demand;
// an outgrown array is kept alive, as graphs captured before may still use it.
at::Tensor tile_counters(const at::Tensor& like, int64_t tiles) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, at::Tensor> arrays;
  static std::vector<at::Tensor> outgrown;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& c = arrays[{like.get_device(), stream}];
  if (!c.defined() || c.numel() < tiles) {
    if (c.defined()) outgrown.push_back(c);
    c = zeroed_ints(like, std::max<int64_t>(tiles, 4096));
  }
  return c;
}

// Decode: swap-AB + split-K. x [M,K]: fp8 with x_scale [M, num_kb] (any strides); bf16/fp16
// quantized inside the kernel (no x_scale, not quant_first); or 16/32-bit quantized by the
// quant kernel first (quant_first). out [M,N]; workspace_floats: the split reduction's fp32
// workspace, allocated here (0: none, splits == 1); tiles: output tiles
// (one reduction counter each).
void decode(const at::Tensor& x, const c10::optional<at::Tensor>& x_scale, const at::Tensor& w,
            const at::Tensor& w_scale, bool per_row, const c10::optional<at::Tensor>& bias,
            at::Tensor& out, int64_t workspace_floats, int64_t tiles, int64_t config,
            int64_t rows, int64_t splits, int64_t ctas_per_sm, bool pdl, bool early_trigger,
            bool quant_first) {
  const c10::cuda::CUDAGuard guard(x.device());
  fp8l::DecodeArgs d{};
  Quantized qx;
  if (quant_first) {
    // (the quant kernel under PDL: after a decode GEMM that lets its dependents launch early,
    // it starts at once and waits for its input in-kernel)
    qx = quantize(x, pdl);
    d.x = qx.q;
    d.x_dtype = fp8l::kInFP8;
    d.x_scale = qx.scale_t;  // token-minor [num_kb, ld]
    d.xs_stride_m = 1;
    d.xs_stride_kb = qx.ld;
  } else {
    d.x = x.data_ptr();
    d.x_dtype = in_code(x);
    d.x_scale = x_scale.has_value() ? x_scale->data_ptr<float>() : nullptr;
    // [M, num_kb] (block_fp8_gemm) or [num_kb, ld] views: strides say which
    d.xs_stride_m = x_scale.has_value() ? int(x_scale->stride(0)) : 0;
    d.xs_stride_kb = x_scale.has_value() ? int(x_scale->stride(1)) : 0;
  }
  at::Tensor workspace;
  if (workspace_floats > 0) {
    workspace = at::empty({workspace_floats}, x.options().dtype(at::kFloat));
    d.workspace = workspace.data_ptr<float>();
  }
  d.w = w.data_ptr();
  d.w_scale = w_scale.data_ptr<float>();
  d.w_scale_per_row = per_row;
  d.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  d.bias_f32 = bias.has_value() && bias->scalar_type() == at::kFloat;
  d.out = out.data_ptr();
  d.out_dtype = out_code(out);
  const at::Tensor counters = tile_counters(x, tiles);
  d.counters = counters.data_ptr<int>();
  d.M = int(x.size(0));
  d.N = int(w.size(0));
  d.K = int(w.size(1));
  d.config = int(config);
  d.rows = int(rows);
  d.splits = int(splits);
  d.ctas_per_sm = int(ctas_per_sm);
  d.pdl = pdl;
  d.early_trigger = early_trigger;
  d.num_sms = num_sms(x.get_device());
  check(fp8l::launch_decode(d, at::cuda::getCurrentCUDAStream()), "decode");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp8linear sm_90a kernels";
  m.def("gemm", &gemm, "large-M block-scaled fp8 GEMM (activations quantized first without "
        "a_scale_t)");
  m.def("quant", &quant, "per-token-group activation quantization");
  m.def("decode", &decode, "skinny decode GEMM (swap-AB, split-K, fused quantization)");
}
