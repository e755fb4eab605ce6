"""fp8linear's fused norm and SiLU-and-mul quantization (fp8linear/norm_quant.py,
swiglu_quant.py) are defined as vLLM's native ops followed by quantize_activation: checked here
against vLLM's own code (its IR ops' native implementations, SiluAndMul.forward_native), bit
for bit, so a change on either side shows. The CPU path is what the vLLM fusion pass's
rewritten graphs compute on the CPU; the Triton kernels are held to it in
tests/test_norm_quant.py and tests/test_swiglu_quant.py."""
from __future__ import annotations

import pytest
import torch

import fp8linear
from fp8linear import norm_quant as nq
from fp8linear import swiglu_quant as smq
from fp8linear.quant import scale_view

from conftest import MISSING

if MISSING is None:
    from vllm.ir import ops as vllm_ir_ops
    from vllm.model_executor.layers.activation import SiluAndMul


def _data(m, k, dtype, w_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    res = torch.randn(m, k, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(k, generator=g)).to(w_dtype)
    return x, res, w


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
        b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


@pytest.mark.parametrize("m,k,residual,weight,dtype,w_dtype", [
    (1, 128, True, True, torch.bfloat16, torch.bfloat16),
    (7, 384, True, True, torch.float16, torch.float16),
    (5, 256, False, True, torch.bfloat16, torch.bfloat16),
    (3, 512, True, False, torch.bfloat16, torch.bfloat16),
    (4, 256, True, True, torch.float16, torch.bfloat16),    # a bf16 weight on fp16 activations
    (6, 256, False, True, torch.bfloat16, torch.float16)])
def test_rms_norm_quant_is_vllms_native_norm_then_quantize_activation(m, k, residual, weight,
                                                                       dtype, w_dtype):
    x, res, w = _data(m, k, dtype, w_dtype, seed=m + k)
    eps = 1e-6
    res = res if residual else None
    w = w if weight else None
    if residual:
        y, new_res = vllm_ir_ops.fused_add_rms_norm.impls["native"].impl_fn(
            x.clone(), res.clone(), w, eps)
    else:
        y, new_res = vllm_ir_ops.rms_norm.impls["native"].impl_fn(x.clone(), w, eps), None
    want_q, want_s = fp8linear.quantize_activation(y)
    q, scale_t, res_out = nq.rms_norm_quant(x, w, eps, residual=res)
    assert _same(q, want_q) and _same(scale_view(scale_t, m), want_s)
    assert (res_out is None) if new_res is None else _same(res_out, new_res)
    # the reference the Triton kernel is held to
    ref_y, ref_res = nq.rms_norm_reference(x, res, w, eps)
    assert _same(ref_y, y)
    assert (ref_res is None) if new_res is None else _same(ref_res, new_res)


@pytest.mark.parametrize("m,d,dtype", [(1, 128, torch.bfloat16), (7, 384, torch.float16),
                                       (5, 256, torch.bfloat16)])
def test_silu_mul_quant_is_vllms_silu_and_mul_then_quantize_activation(m, d, dtype):
    g = torch.Generator().manual_seed(m + d)
    x = (torch.randn(m, 2 * d, generator=g) * 4).to(dtype)
    y = SiluAndMul.forward_native(x)
    want_q, want_s = fp8linear.quantize_activation(y)
    q, scale_t = fp8linear.silu_mul_quant(x)
    assert _same(q, want_q) and _same(scale_view(scale_t, m), want_s)
    assert _same(smq.silu_mul_reference(x), y)
