"""(Residual add +) RMSNorm with the FP8 quantization of its output in the same kernel.

For a norm whose output only feeds block-FP8 linear layers (a decoder's input and
post-attention norms): the linears then run ``block_fp8_gemm_scale_t`` on the fp8
activations, with no quantization step between the norm and the GEMM. The vLLM plugin
rewrites compiled graphs to this form (integrations/vllm/quant_fusion_pass.py).

Numerics are vLLM's native ``rms_norm`` / ``fused_add_rms_norm`` followed by
``quantize_activation``: the fp32 sum of input and residual (the new residual is that sum
rounded to the input dtype), the fp32 mean of its squares, ``y = x * rsqrt(var + eps)``
rounded to the weight's dtype, times the weight, rounded; then per token, per 128 channels,
scale = amax / 448.

Activation scales come as ``scale_t`` [K/128, ld], ld = M rounded up to 4: token m's scale of
group g at ``scale_t[g, m]``, the column-major layout the Hopper kernels read in place
(``quant.scale_view(scale_t, M)`` is the [M, K/128] view ``block_fp8_gemm`` takes).
"""
from __future__ import annotations

from typing import Optional

import torch

from .quant import BLOCK, FP8_DTYPE, empty_scale_t, quantize_activation

DTYPES = (torch.bfloat16, torch.float16)  # activations the fused norm and SiLU-and-mul take


def _fail(msg: str):
    raise ValueError(msg)


def _check_x(x, shape: str, multiple: int, what: str, why: str = ""):
    """The input of a fused quantization op (``what``): a contiguous 2-D bf16/fp16 ``shape``
    tensor whose channels are a multiple of ``multiple`` (``why``, if said)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(f"x must be a 2-D {shape} tensor, got "
              + (f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
    if x.dtype not in DTYPES:
        _fail(f"x must be bf16 or fp16, got {x.dtype}")
    if x.shape[1] % multiple:
        _fail(f"x has {x.shape[1]} channels: {what} needs a multiple of {multiple}{why}")
    if not x.is_contiguous():
        _fail(f"x must be contiguous, got strides {x.stride()}")


def _check(x, residual, weight):
    _check_x(x, "[M, K]", BLOCK, "the fused norm + quantization")
    m, k = x.shape
    for t, name, shape in ((residual, "residual", (m, k)), (weight, "weight", (k,))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            _fail(f"{name} must have shape {shape}, got "
                  + (f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
        if name == "residual" and t.dtype != x.dtype:
            _fail(f"residual must have x's dtype ({x.dtype}), got {t.dtype}")
        if t.dtype not in DTYPES:
            _fail(f"{name} must be bf16 or fp16, got {t.dtype}")
        if t.device != x.device:
            _fail(f"{name} is on {t.device} but x is on {x.device}")
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous, got strides {t.stride()}")


def _buffers(x: torch.Tensor):
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    return q, empty_scale_t(m, k // BLOCK, x.device)


def _quantize_into(y: torch.Tensor, q: torch.Tensor, scale_t: torch.Tensor) -> None:
    """quantize_activation(y) written into _buffers' q and scale_t (the reference path)."""
    qq, s = quantize_activation(y)
    q.copy_(qq)
    scale_t[:, :y.shape[0]].copy_(s.t())


def rms_norm_reference(x, residual, weight, eps: float):
    """vLLM's native (fused_add_)rms_norm: (y, new residual or None)."""
    orig = x.dtype
    h = x.float()
    if residual is not None:
        h = h + residual.float()
    res_out = h.to(orig) if residual is not None else None
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        h = h.to(weight.dtype) * weight
    return h.to(orig), res_out


def _impl(x, residual, weight, eps):
    q, scale_t = _buffers(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if x.shape[0]:
        if x.device.type == "cuda":
            from .backends.triton import norm_quant as triton_norm_quant
            triton_norm_quant.launch(x, residual, weight, eps, q, scale_t, res_out)
        else:
            y, r = rms_norm_reference(x, residual, weight, eps)
            _quantize_into(y, q, scale_t)
            if r is not None:
                res_out.copy_(r)
    return q, scale_t, res_out


def _norm_op_impl(x: torch.Tensor, weight: Optional[torch.Tensor],
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale_t, _ = _impl(x, None, weight, eps)
    return q, scale_t


def _add_norm_op_impl(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor],
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl(x, residual, weight, eps)


# Custom ops (opaque to torch.compile, with fake implementations), for compiled graphs.
norm_op = torch.library.custom_op("fp8linear::rms_norm_quant", _norm_op_impl, mutates_args=())
add_norm_op = torch.library.custom_op("fp8linear::add_rms_norm_quant", _add_norm_op_impl,
                                      mutates_args=())


@norm_op.register_fake
def _(x, weight, eps):
    return _buffers(x)


@add_norm_op.register_fake
def _(x, residual, weight, eps):
    q, scale_t = _buffers(x)
    return q, scale_t, torch.empty_like(x)


def rms_norm_quant(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                   residual: Optional[torch.Tensor] = None):
    """-> (fp8 [M, K], scale_t [K/128, ld] fp32, new residual [M, K] or None); see the module
    docstring. x bf16/fp16 [M, K], K a multiple of 128; weight [K] or None."""
    _check(x, residual, weight)
    if residual is None:
        q, scale_t = norm_op(x, weight, eps) if torch.compiler.is_compiling() \
            else _norm_op_impl(x, weight, eps)
        return q, scale_t, None
    if torch.compiler.is_compiling():
        return add_norm_op(x, residual, weight, eps)
    return _add_norm_op_impl(x, residual, weight, eps)
