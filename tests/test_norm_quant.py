"""fp8linear.norm_quant: (residual add +) RMSNorm with the fp8 quantization of its output in one
kernel. CPU: the reference path (quantize_activation of the norm's output, checked against an
fp64 RMSNorm; its equality with vLLM's own native norm is tested where vLLM is installed,
tests/integrations/vllm/test_vllm_native_numerics.py), the validation, the custom ops in a
compiled graph, and the Triton kernel under Triton's interpreter (small shapes); GPU (gpu
marker): the Triton kernel at model sizes. The kernel checks (``check_kernel``) are the same
on both."""
from __future__ import annotations

import operator
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (also as the interpreter script)
import fp64_reference as R  # noqa: E402
import triton_interpreter  # noqa: E402
from expect import raises_exactly  # noqa: E402

import fp8linear  # noqa: E402
from fp8linear import norm_quant as nq  # noqa: E402
from fp8linear.quant import scale_view  # noqa: E402

CUDA = torch.cuda.is_available()


def _data(m, k, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(m, k, generator=g, device=device) * 3).to(dtype)
    res = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (1 + 0.2 * torch.randn(k, generator=g, device=device)).to(dtype)
    return x, res, w


def rms_norm_fp64(x, residual, weight, eps):
    """RMSNorm in fp64 from its definition: (y, x + residual)."""
    h = x.double() + (residual.double() if residual is not None else 0)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.double() if weight is not None else y), h


@pytest.mark.parametrize("m,k,residual,weight,dtype,w_dtype", [
    (1, 128, True, True, torch.bfloat16, torch.bfloat16),
    (7, 384, True, True, torch.float16, torch.float16),
    (5, 256, False, True, torch.bfloat16, torch.bfloat16),
    (3, 512, True, False, torch.bfloat16, None),
    (4, 256, True, True, torch.float16, torch.bfloat16),    # a bf16 weight on fp16 activations
    (0, 256, True, True, torch.bfloat16, torch.bfloat16)])
def test_reference_path_quantizes_the_rms_norm(m, k, residual, weight, dtype, w_dtype):
    """The CPU path: its fp8 values and scales are exactly quantize_activation of its norm
    output (laid out in scale_t), that output is RMSNorm within the two roundings the
    definition makes (to the weight's dtype, then to x's), the new residual is x + residual
    rounded once."""
    x, res, w = _data(m, k, dtype)
    res = res if residual else None
    w = w.to(w_dtype) if weight else None
    q, scale_t, res_out = nq.rms_norm_quant(x, w, 1e-6, residual=res)
    y, r = nq.rms_norm_reference(x, res, w, 1e-6)
    qq, ss = fp8linear.quantize_activation(y)
    assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8))
    assert scale_t.shape == (k // 128, (m + 3) // 4 * 4)
    assert torch.equal(scale_view(scale_t, m), ss)
    y64, h64 = rms_norm_fp64(x, res, w, 1e-6)
    assert y.dtype == dtype
    # roundings: to the weight's dtype and the product in it, then to x's dtype (a no-op when
    # the dtypes are the same); without a weight, to x's dtype once
    if w is None:
        bound = R.UNIT_ROUNDOFF[dtype]
    else:
        bound = 2 * R.UNIT_ROUNDOFF[w_dtype] + (R.UNIT_ROUNDOFF[dtype] if w_dtype != dtype else 0)
    bound *= 1.01   # (the fp32 mean and rsqrt)
    assert ((y.double() - y64).abs() <= bound * y64.abs() + 1e-30).all()
    if residual:
        assert torch.equal(res_out, h64.to(dtype)) and torch.equal(r, res_out)
    else:
        assert res_out is None and r is None


def test_bad_inputs_are_named():
    x, res, w = _data(4, 256)
    with raises_exactly(ValueError, "x has 144 channels: the fused norm + quantization needs a "
                                    "multiple of 128"):
        nq.rms_norm_quant(x[:, :144].contiguous(), w[:144], 1e-6)
    with raises_exactly(ValueError, "x must be bf16 or fp16, got torch.float32"):
        nq.rms_norm_quant(x.float(), w, 1e-6)
    with raises_exactly(ValueError, "x must be contiguous, got strides (512, 2)"):
        nq.rms_norm_quant(torch.cat([x, x], 1)[:, ::2], w, 1e-6)
    with raises_exactly(ValueError, "x must be a 2-D [M, K] tensor, got shape (256,)"):
        nq.rms_norm_quant(x[0], w, 1e-6)
    with raises_exactly(ValueError, "x must be a 2-D [M, K] tensor, got list"):
        nq.rms_norm_quant([1.0], w, 1e-6)
    with raises_exactly(ValueError, "residual must have shape (4, 256), got (2, 256)"):
        nq.rms_norm_quant(x, w, 1e-6, residual=res[:2])
    with raises_exactly(ValueError, "residual must have shape (4, 256), got list"):
        nq.rms_norm_quant(x, w, 1e-6, residual=[1.0])
    with raises_exactly(ValueError,
                        "residual must have x's dtype (torch.bfloat16), got torch.float16"):
        nq.rms_norm_quant(x, w, 1e-6, residual=res.half())
    with raises_exactly(ValueError, "residual is on meta but x is on cpu"):
        nq.rms_norm_quant(x, w, 1e-6, residual=res.to("meta"))
    with raises_exactly(ValueError, "residual must be contiguous, got strides (1, 4)"):
        nq.rms_norm_quant(x, w, 1e-6, residual=res.t().contiguous().t())
    with raises_exactly(ValueError, "weight must have shape (256,), got (128,)"):
        nq.rms_norm_quant(x, w[:128], 1e-6)
    with raises_exactly(ValueError, "weight must be bf16 or fp16, got torch.float32"):
        nq.rms_norm_quant(x, w.float(), 1e-6)
    with raises_exactly(ValueError, "weight must be contiguous, got strides (2,)"):
        nq.rms_norm_quant(x, torch.stack([w, w], 1)[:, 0], 1e-6)


def test_gemm_on_the_scale_buffer_equals_fp8_linear():
    x, res, w = _data(6, 256, seed=3)
    wq, ws = fp8linear.quantize_weight(torch.randn(384, 256).bfloat16())
    q, scale_t, _ = nq.rms_norm_quant(x, w, 1e-6, residual=res)
    y, _ = nq.rms_norm_reference(x, res, w, 1e-6)
    got = torch.ops.fp8linear.block_fp8_gemm_scale_t(q, scale_t, wq, ws, None, torch.bfloat16)
    assert torch.equal(got, fp8linear.fp8_linear(y, wq, ws))


def test_compiled_call_uses_the_custom_ops():
    """Under torch.compile the norm is one opaque custom op (what the vLLM fusion pass puts in
    graphs), not its traced reference path."""
    x, res, w = _data(5, 256, seed=4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    f = torch.compile(lambda a, r, g: (nq.rms_norm_quant(a, g, 1e-6),
                                       nq.rms_norm_quant(a, g, 1e-6, residual=r)),
                      backend=backend, fullgraph=True)
    (q1, s1, _), (q2, s2, r2) = f(x, res, w)
    (gm,) = graphs
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.fp8linear.rms_norm_quant.default) == 1, calls
    assert calls.count(torch.ops.fp8linear.add_rms_norm_quant.default) == 1, calls
    # nothing else but taking their outputs apart: no traced arithmetic of the reference path
    assert set(calls) - {torch.ops.fp8linear.rms_norm_quant.default,
                         torch.ops.fp8linear.add_rms_norm_quant.default,
                         operator.getitem} == set(), calls
    for (q, s_t, r), residual in (((q1, s1, None), None), ((q2, s2, r2), res)):
        q0, s0, r0 = nq.rms_norm_quant(x, w, 1e-6, residual=residual)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
        assert torch.equal(scale_view(s_t, 5), scale_view(s0, 5))
        assert (r is None and r0 is None) or torch.equal(r, r0)


# ---------------------------------------------------------------- the Triton kernel
def check_kernel(m, k, residual, weight, groups, dtype=torch.bfloat16, device="cuda",
                 pdl=True):
    """The kernel's fp8 values and scales are exactly quantize_activation of its own
    normalised output, which is the reference's within bf16 rounding (the GPU's rsqrt and
    sum order differ from the CPU's); the new residual is bit-exact; the scale buffer's
    padding columns are never read. Returns the kernel's outputs (q, scale_t, y)."""
    from fp8linear.backends.triton import norm_quant as triton_norm_quant
    x, res, w = _data(m, k, dtype, device=device, seed=m + k)
    res = res if residual else None
    w = w if weight else None
    q, scale_t = nq._buffers(x)
    q.fill_(float("nan"))
    scale_t.fill_(float("nan"))
    res_out = torch.full_like(x, float("nan")) if residual else None
    y = torch.full_like(x, float("nan"))
    triton_norm_quant.launch(x, res, w, 1e-6, q, scale_t, res_out, y=y, pdl=pdl,
                             groups=groups)
    if device == "cuda":
        torch.cuda.synchronize()
    what = f"m={m} k={k} residual={residual} weight={weight} groups={groups} {dtype}"
    qq, ss = fp8linear.quantize_activation(y)
    assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8)), what
    assert torch.equal(scale_view(scale_t, m), ss), what
    ref_y, ref_r = nq.rms_norm_reference(x, res, w, 1e-6)
    err = ((y.float() - ref_y.float()).norm() / ref_y.float().norm()).item()
    assert err < 2e-3, (what, err)
    if residual:
        assert torch.equal(res_out, ref_r), what
    return x, res, w, q, scale_t


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 200, 700])   # (700: a program a row)
@pytest.mark.parametrize("k,residual,weight", [(4096, True, True), (14336, False, True),
                                              (640, True, False)])
@pytest.mark.parametrize("groups", [None, 2])   # (2: rows split over programs at any M)
def test_triton_kernel(m, k, residual, weight, groups):
    x, res, w, q, scale_t = check_kernel(m, k, residual, weight, groups)
    # the public entry point (PDL as configured) gives the same bits
    q2, s2, r2 = nq.rms_norm_quant(x, w, 1e-6, residual=res)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scale_view(s2, m), scale_view(scale_t, m))


# (m, k, residual, weight, groups, dtype): below 32 rows 4 groups a program (a row split over
# programs where K > 512, masked groups where K < 512), a forced single group, from 32 rows
# the whole row in one program
INTERPRETED = [(3, 640, True, True, None, torch.bfloat16),
               (2, 256, False, True, None, torch.float16),
               (5, 384, True, False, 1, torch.bfloat16),
               (1, 128, False, False, None, torch.bfloat16),
               (33, 384, True, True, None, torch.float16)]


@pytest.mark.skipif(triton_interpreter.interpreting(), reason="already interpreting")
def test_triton_kernel_interpreted():
    """The Triton kernel on the CPU through Triton's interpreter (tests/triton_interpreter.py):
    the same checks as on the GPU, on small shapes."""
    triton_interpreter.run(__file__)


if __name__ == "__main__":
    triton_interpreter.start()
    for case in INTERPRETED:
        check_kernel(*case, device="cpu", pdl=False)
    triton_interpreter.passed(len(INTERPRETED))
