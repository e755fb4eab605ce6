"""fp8linear.norm_quant: (residual add +) RMSNorm with the fp8 quantization of its output in one
kernel. CPU: the reference path against vLLM's native norm + quantize_activation, the
validation; GPU (gpu marker): the Triton kernel against its own normalised output and the
reference."""
from __future__ import annotations

import pytest
import torch

import fp8linear
from fp8linear import norm_quant as nq

CUDA = torch.cuda.is_available()


def _data(m, k, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(m, k, generator=g, device=device) * 3).to(dtype)
    res = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (1 + 0.2 * torch.randn(k, generator=g, device=device)).to(dtype)
    return x, res, w


@pytest.mark.parametrize("m,k,residual,weight,dtype", [
    (1, 128, True, True, torch.bfloat16), (7, 384, True, True, torch.float16),
    (5, 256, False, True, torch.bfloat16), (3, 512, True, False, torch.bfloat16),
    (0, 256, True, True, torch.bfloat16)])
def test_reference_is_vllm_norm_then_quantize_activation(m, k, residual, weight, dtype):
    x, res, w = _data(m, k, dtype)
    res = res if residual else None
    w = w if weight else None
    q, scale_t, res_out = nq.rms_norm_quant(x, w, 1e-6, residual=res)
    # vLLM's native fused_add_rms_norm / rms_norm, written out
    h = x.float() + (res.float() if residual else 0)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = (y.to(w.dtype) * w if weight else y).to(dtype)
    qq, ss = fp8linear.quantize_activation(y)
    assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8))
    assert scale_t.shape == (k // 128, (m + 3) // 4 * 4)
    assert torch.equal(nq.scale_view(scale_t, m), ss)
    if residual:
        assert torch.equal(res_out, h.to(dtype))
    else:
        assert res_out is None


def test_bad_inputs_are_named():
    x, res, w = _data(4, 256)
    with pytest.raises(ValueError, match="multiple of 128"):
        nq.rms_norm_quant(x[:, :144].contiguous(), w[:144], 1e-6)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        nq.rms_norm_quant(x.float(), w, 1e-6)
    with pytest.raises(ValueError, match="residual must have shape"):
        nq.rms_norm_quant(x, w, 1e-6, residual=res[:2])
    with pytest.raises(ValueError, match="weight must have shape"):
        nq.rms_norm_quant(x, w[:128], 1e-6)
    with pytest.raises(ValueError, match="x must be contiguous"):
        nq.rms_norm_quant(torch.cat([x, x], 1)[:, ::2], w, 1e-6)
    with pytest.raises(ValueError, match="residual must be x's dtype"):
        nq.rms_norm_quant(x, w, 1e-6, residual=res.half())
    with pytest.raises(ValueError, match=r"x must be a 2-D \[M, K\] tensor, got shape \(256,\)"):
        nq.rms_norm_quant(x[0], w, 1e-6)
    with pytest.raises(ValueError, match="weight must be bf16/fp16's dtype, got torch.float32"):
        nq.rms_norm_quant(x, w.float(), 1e-6)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        nq.rms_norm_quant(x, torch.stack([w, w], 1)[:, 0], 1e-6)


def test_gemm_on_the_scale_buffer_equals_fp8_linear():
    x, res, w = _data(6, 256, seed=3)
    wq, ws = fp8linear.quantize_weight(torch.randn(384, 256).bfloat16())
    q, scale_t, _ = nq.rms_norm_quant(x, w, 1e-6, residual=res)
    y, _ = nq.rms_norm_reference(x, res, w, 1e-6)
    got = torch.ops.fp8linear.block_fp8_gemm_scale_t(q, scale_t, wq, ws, None, torch.bfloat16)
    assert torch.equal(got, fp8linear.fp8_linear(y, wq, ws))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 200, 700])   # (700: a program a row)
@pytest.mark.parametrize("k,residual,weight", [(4096, True, True), (14336, False, True),
                                              (640, True, False)])
@pytest.mark.parametrize("groups", [None, 2])   # (2: rows split over programs at any M)
def test_triton_kernel(m, k, residual, weight, groups):
    """The kernel's fp8 values and scales are exactly quantize_activation of its own
    normalised output, which is the reference's within bf16 rounding (the GPU's rsqrt and
    sum order differ from the CPU's); the new residual is bit-exact; the scale buffer's
    padding columns are never read."""
    from fp8linear.backends.triton import norm_quant as triton_norm_quant
    x, res, w = _data(m, k, device="cuda", seed=m + k)
    res = res if residual else None
    w = w if weight else None
    q, scale_t = nq._buffers(x)
    q.fill_(float("nan"))
    scale_t.fill_(float("nan"))
    res_out = torch.full_like(x, float("nan")) if residual else None
    y = torch.full_like(x, float("nan"))
    triton_norm_quant.launch(x, res, w, 1e-6, q, scale_t, res_out, y=y, pdl=True,
                             groups=groups)
    torch.cuda.synchronize()
    qq, ss = fp8linear.quantize_activation(y)
    assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8))
    assert torch.equal(nq.scale_view(scale_t, m), ss)
    ref_y, ref_r = nq.rms_norm_reference(x, res, w, 1e-6)
    err = ((y.float() - ref_y.float()).norm() / ref_y.float().norm()).item()
    assert err < 2e-3, err
    if residual:
        assert torch.equal(res_out, ref_r)
    # the public entry point (PDL as configured) gives the same bits
    q2, s2, r2 = nq.rms_norm_quant(x, w, 1e-6, residual=res)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(nq.scale_view(s2, m), ss)
