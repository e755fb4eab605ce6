// torch <-> kernel glue: the only translation unit that includes torch headers. Python
// (fp8linear/kernels/sm90.py) has already validated dtypes, shapes and strides; here we only
// take pointers and the current stream, and turn a launch error into an exception.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

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

// a [M,K] fp8; a_scale_t [num_kb, M] fp32 with row stride ld (a multiple of 4); w [N,K] fp8;
// w_scale blocks or per-row; out [M,N].
void gemm(const at::Tensor& a, const at::Tensor& a_scale_t, const at::Tensor& w,
          const at::Tensor& w_scale, bool per_row, const c10::optional<at::Tensor>& bias,
          at::Tensor& out, int64_t config, bool pdl) {
  const c10::cuda::CUDAGuard guard(a.device());
  fp8l::GemmArgs g{};
  g.a = a.data_ptr();
  g.a_scale_t = a_scale_t.data_ptr<float>();
  g.a_scale_ld = int(a_scale_t.stride(0));
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
  check(fp8l::launch_gemm(g, at::cuda::getCurrentCUDAStream()), "gemm");
}

void quant(const at::Tensor& x, at::Tensor& q, at::Tensor& scale_t, bool pdl) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int in = x.scalar_type() == at::kBFloat16 ? fp8l::kInBF16
                 : x.scalar_type() == at::kHalf   ? fp8l::kInFP16
                                                  : fp8l::kInFP32;
  check(fp8l::launch_quant(x.data_ptr(), in, q.data_ptr(), scale_t.data_ptr<float>(),
                           int(scale_t.size(1)), int(x.size(0)), int(x.size(1)), pdl,
                           at::cuda::getCurrentCUDAStream()),
        "quant");
}

// Decode: swap-AB + split-K, activation quantization fused. x [M,K] bf16/fp16, or fp8 with
// x_scale [M, num_kb]; out [M,N]; workspace fp32 (unused when splits == 1 or cluster_reduce);
// counters int32 >= tiles, zero.
void decode(const at::Tensor& x, const c10::optional<at::Tensor>& x_scale, const at::Tensor& w, const at::Tensor& w_scale, bool per_row,
            const c10::optional<at::Tensor>& bias, at::Tensor& out, at::Tensor& workspace,
            at::Tensor& counters, int64_t config, int64_t rows, int64_t splits,
            int64_t ctas_per_sm, bool pdl, bool early_trigger, bool cluster_reduce) {
  const c10::cuda::CUDAGuard guard(x.device());
  fp8l::DecodeArgs d{};
  d.x = x.data_ptr();
  d.x_dtype = x.scalar_type() == at::kBFloat16 ? fp8l::kInBF16
              : x.scalar_type() == at::kHalf   ? fp8l::kInFP16
                                               : fp8l::kInFP8;
  d.x_scale = x_scale.has_value() ? x_scale->data_ptr<float>() : nullptr;
  // [M, num_kb] (block_fp8_gemm) or the quant kernel's [num_kb, ld]: strides say which
  d.xs_stride_m = x_scale.has_value() ? int(x_scale->stride(0)) : 0;
  d.xs_stride_kb = x_scale.has_value() ? int(x_scale->stride(1)) : 0;
  d.w = w.data_ptr();
  d.w_scale = w_scale.data_ptr<float>();
  d.w_scale_per_row = per_row;
  d.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  d.bias_f32 = bias.has_value() && bias->scalar_type() == at::kFloat;
  d.out = out.data_ptr();
  d.out_dtype = out_code(out);
  d.workspace = workspace.data_ptr<float>();
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
  d.cluster_reduce = cluster_reduce;
  check(fp8l::launch_decode(d, at::cuda::getCurrentCUDAStream()), "decode");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp8linear sm_90a kernels";
  m.def("gemm", &gemm, "large-M block-scaled fp8 GEMM");
  m.def("quant", &quant, "per-token-group activation quantization");
  m.def("decode", &decode, "skinny decode GEMM (swap-AB, split-K, fused quantization)");
}
