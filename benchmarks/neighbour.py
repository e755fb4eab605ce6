"""The kernel a benchmark puts before each GEMM, standing in for a model's norm or activation.

Three kinds (decode benchmarks time a GEMM after each, as in a model step):
- "elem": torch.mul of an [M, K] bf16 tensor by a [K] vector (an RMSNorm-sized elementwise
  kernel, launched without PDL: what a vLLM CUDA kernel or an eager torch op looks like);
- "norm": an RMSNorm written in Triton, launched without PDL;
- "norm_pdl": the same kernel launched with PDL, waiting (griddepcontrol.wait) before its
  first load and releasing its dependents (griddepcontrol.launch_dependents) after its last
  load, where torch Inductor puts them with `triton.enable_pdl` (torch/_inductor/codegen/
  triton.py: _handle_pdl_before_access / _handle_pdl_after_load). That is the kernel before
  qkv_proj, gate_up_proj and down_proj in vLLM under torch.compile once our plugin turns the
  option on; a GEMM launched under PDL then runs its prologue and first weight loads while
  the norm finishes.
- "fused_norm": fp8linear's residual add + RMSNorm + FP8 quantization (kernels/
  triton_norm_quant.py, PDL), the kernel our vLLM compile pass puts before qkv_proj and
  gate_up_proj: its grid (rows x groups of 128 channels) covers every SM at 16+ tokens,
  unlike norm_pdl's one program a row;
- "fused_silu": fp8linear's SiLU-and-mul + FP8 quantization (kernels/triton_swiglu_quant.py,
  PDL) of an [M, 2K] input, the kernel before down_proj under the same pass.
"""
from __future__ import annotations

# kind -> what it stands for (tables, logs)
KINDS = {"elem": "elementwise kernel", "norm": "Triton RMSNorm", "norm_pdl": "PDL-aware RMSNorm",
         "fused_norm": "fp8linear's fused add + RMSNorm + quant",
         "fused_silu": "fp8linear's fused SiLU-and-mul + quant"}

_kernel = None


def _rmsnorm_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def rmsnorm(x_ptr, g_ptr, o_ptr, n_cols, eps, BLOCK: tl.constexpr,
                    USE_GDC: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            mask = cols < n_cols
            if USE_GDC:
                tl.extra.cuda.gdc_wait()
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if USE_GDC:
                tl.extra.cuda.gdc_launch_dependents()
            r = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
            tl.store(o_ptr + row * n_cols + cols, (x * r * g).to(o_ptr.dtype.element_ty),
                     mask=mask)

        _kernel = rmsnorm
    return _kernel


def make(kind: str, x, gamma, out):
    """A no-argument callable that runs the neighbour kernel `kind` on x [M, K] (bf16) with
    gamma [K], writing out [M, K]."""
    if kind not in KINDS:
        raise ValueError(f"neighbour kind {kind!r}: expected one of {', '.join(KINDS)}")
    import torch
    if kind == "elem":
        return lambda: torch.mul(x, gamma, out=out)
    if kind in ("fused_norm", "fused_silu"):
        from fp8linear.backends.triton import norm_quant as triton_norm_quant
        from fp8linear.norm_quant import _buffers   # (the ops' fp8 and scale_t outputs)
        m, k = x.shape
        q, scale_t = _buffers(x)                     # (allocated once: the launches reuse them)
        if kind == "fused_silu":
            from fp8linear.backends.triton import swiglu_quant as triton_swiglu_quant
            x2 = torch.randn(m, 2 * k, device=x.device).to(x.dtype)
            return lambda: triton_swiglu_quant.launch(x2, q, scale_t)
        res = torch.randn_like(x)
        return lambda: triton_norm_quant.launch(x, res, gamma, 1e-6, q, scale_t, out)
    import triton
    kernel = _rmsnorm_kernel()
    m, k = x.shape
    block = triton.next_power_of_2(k)
    pdl = kind == "norm_pdl"
    warps = 8 if block >= 4096 else 4

    def run():
        kernel[(m,)](x, gamma, out, k, 1e-6, BLOCK=block, USE_GDC=pdl, num_warps=warps,
                     launch_pdl=pdl)
    return run
