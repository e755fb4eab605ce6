"""fp8linear.swiglu_quant: SiLU-and-mul with the fp8 quantization of its output in one
kernel. CPU: the reference path against vLLM's native SiluAndMul + quantize_activation, the
validation; GPU (gpu marker): the Triton kernel against its own product and the reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fp8linear
from fp8linear import norm_quant as nq
from fp8linear import swiglu_quant as smq

CUDA = torch.cuda.is_available()


def _data(m, d, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(m, 2 * d, generator=g, device=device) * 4).to(dtype)


@pytest.mark.parametrize("m,d,dtype", [(1, 128, torch.bfloat16), (7, 384, torch.float16),
                                       (5, 256, torch.bfloat16), (0, 256, torch.bfloat16)])
def test_reference_is_vllm_silu_and_mul_then_quantize_activation(m, d, dtype):
    x = _data(m, d, dtype)
    q, scale_t = fp8linear.silu_mul_quant(x)
    y = F.silu(x[:, :d]) * x[:, d:]           # vLLM's SiluAndMul.forward_native
    qq, ss = fp8linear.quantize_activation(y)
    assert q.shape == (m, d) and q.dtype == fp8linear.FP8_DTYPE
    assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8))
    assert scale_t.shape == (d // 128, (m + 3) // 4 * 4)
    assert torch.equal(nq.scale_view(scale_t, m), ss)


def test_bad_inputs_are_named():
    x = _data(4, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        fp8linear.silu_mul_quant(x[:, :384].contiguous())
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fp8linear.silu_mul_quant(x.float())
    with pytest.raises(ValueError, match="x must be contiguous"):
        fp8linear.silu_mul_quant(torch.cat([x, x], 1)[:, ::2])
    with pytest.raises(ValueError, match=r"x must be a 2-D \[M, 2 \* d\] tensor, got shape"):
        fp8linear.silu_mul_quant(x[0])
    with pytest.raises(ValueError, match="got list"):
        fp8linear.silu_mul_quant([1.0])


def test_gemm_on_the_scale_buffer_equals_fp8_linear():
    x = _data(6, 256, seed=3)
    wq, ws = fp8linear.quantize_weight(torch.randn(384, 256).bfloat16())
    q, scale_t = fp8linear.silu_mul_quant(x)
    got = torch.ops.fp8linear.block_fp8_gemm_scale_t(q, scale_t, wq, ws, None, torch.bfloat16)
    assert torch.equal(got, fp8linear.fp8_linear(smq.silu_mul_reference(x), wq, ws))


def test_compiled_call_uses_the_custom_op():
    x = _data(5, 256, seed=4)
    f = torch.compile(lambda t: fp8linear.silu_mul_quant(t), backend="aot_eager",
                      fullgraph=True)
    q, scale_t = f(x)
    q0, s0 = fp8linear.silu_mul_quant(x)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    assert torch.equal(nq.scale_view(scale_t, 5), nq.scale_view(s0, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 200, 700])   # (700: bigger programs)
@pytest.mark.parametrize("d,dtype", [(14336, torch.bfloat16), (640, torch.float16),
                                     (1536, torch.bfloat16)])
def test_triton_kernel(m, d, dtype):
    """The kernel's fp8 values and scales are exactly quantize_activation of its own product,
    which is the reference's within one rounding step (the GPU's exp differs from the CPU's
    in the last fp32 bit); the scale buffer's padding columns are never read."""
    from fp8linear.backends.triton import swiglu_quant as triton_swiglu_quant
    x = _data(m, d, dtype, device="cuda", seed=m + d)
    q, scale_t = nq._buffers(x[:, :d])
    q.fill_(float("nan"))
    scale_t.fill_(float("nan"))
    y = torch.full((m, d), float("nan"), dtype=dtype, device="cuda")
    triton_swiglu_quant.launch(x, q, scale_t, y=y, pdl=True)
    torch.cuda.synchronize()
    qq, ss = fp8linear.quantize_activation(y)
    assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8))
    assert torch.equal(nq.scale_view(scale_t, m), ss)
    ref = smq.silu_mul_reference(x)            # torch's CUDA silu and multiply
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-3, err
    assert (y != ref).float().mean().item() < 0.01   # an occasional last-bit difference
    # the public entry point (PDL as configured) gives the same bits
    q2, s2 = fp8linear.silu_mul_quant(x)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(nq.scale_view(s2, m), ss)
