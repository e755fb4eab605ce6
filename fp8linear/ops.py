"""Validated entry points, backend dispatch and the torch custom ops.

Checks here read only metadata (dtype, device, shape, stride), never tensor values, so the
hot path has no host synchronisation and stays capturable by CUDA graphs and torch.compile.
Value checks (finite, positive scales) run once when weights load: see
``fp8linear.quant.check_scale_values``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .quant import BLOCK, FP8_DTYPE, cdiv, check_weight_scale_shape, scale_view
from .backends import dispatch

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- checks
def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)} {t.dtype}"
    return type(t).__name__


def _fail(msg: str):
    raise ValueError(msg)


def _check_typed_shape(t: torch.Tensor, name: str, dtype, shape):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        _fail(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_2d_contiguous(t: torch.Tensor, name: str, dtype, shape):
    _check_typed_shape(t, name, dtype, shape)
    if t.numel() and not t.is_contiguous():
        _fail(f"{name} must be contiguous (row-major), got strides {t.stride()}")


def _check_activation_scale(s: torch.Tensor, m: int, kb: int):
    # Row-major [M, Kb], or column-major (strides (1, ld), ld >= M): the layout of vLLM's
    # per_token_group_quant_fp8(column_major_scales=True) and what DeepGEMM takes. With ld a
    # multiple of 4 the Hopper kernel reads it in place (TMA rows of 16 bytes); any other
    # layout costs it a transposing copy.
    _check_typed_shape(s, "a_scale", torch.float32, (m, kb))
    if s.numel() and not (s.is_contiguous() or (s.stride(0) == 1 and s.stride(1) >= m)):
        _fail(f"a_scale must be row-major, or column-major (strides (1, ld) with ld >= {m}), "
              f"got strides {s.stride()}")


def check_weight(w: torch.Tensor, w_scale: torch.Tensor, name: str = "weight") -> None:
    """Metadata checks for an fp8 weight and its scales (block or per-row)."""
    # The common case first, in as few attribute reads as the checks need (this runs on every
    # eager call, where each read costs ~0.15 us of host time); anything else goes through
    # the step-by-step checks below, which name what is wrong.
    try:
        if (w.dtype == FP8_DTYPE and w_scale.dtype == torch.float32 and w.dim() == 2
                and w_scale.dim() == 2 and w.is_contiguous() and w_scale.is_contiguous()
                and w_scale.device == w.device):
            n, k = w.shape
            sn, skb = w_scale.shape
            if skb == cdiv(k, BLOCK) and (sn == n or sn == cdiv(n, BLOCK)):
                return
    except (AttributeError, TypeError):
        pass
    _check_weight_steps(w, w_scale, name)


def _check_weight_steps(w, w_scale, name):
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        _fail(f"{name} must be a 2-D [N, K] tensor, got "
              f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    n, k = w.shape
    _check_2d_contiguous(w, name, FP8_DTYPE, (n, k))
    kb = cdiv(k, BLOCK)
    if not isinstance(w_scale, torch.Tensor) or w_scale.dim() != 2:
        _fail(f"{name}_scale_inv must be a 2-D fp32 tensor of shape "
              f"({cdiv(n, BLOCK)}, {kb}) (128x128 blocks) or ({n}, {kb}) (per row), got "
              + _describe(w_scale))
    check_weight_scale_shape((n, k), w_scale.shape, name)
    _check_2d_contiguous(w_scale, f"{name}_scale_inv", torch.float32, w_scale.shape)
    if w_scale.device != w.device:
        _fail(f"{name}_scale_inv is on {w_scale.device} but {name} is on {w.device}")


def _check_bias(bias, n, device, name="bias"):
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,):
        _fail(f"{name} must have shape ({n},), got "
              f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    if bias.dtype not in _OUT_DTYPES:
        _fail(f"{name} must be bf16/fp16/fp32, got {bias.dtype}")
    if bias.device != device:
        _fail(f"{name} is on {bias.device} but the weight is on {device}")
    if not bias.is_contiguous():
        _fail(f"{name} must be contiguous")


def _check_gemm(a, a_scale, w, w_scale, bias, out_dtype):
    check_weight(w, w_scale)
    n, k = w.shape
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        _fail(f"a (activations) must be a 2-D [M, {k}] float8_e4m3fn tensor, got "
              + _describe(a))
    m = a.shape[0]
    _check_2d_contiguous(a, "a (activations)", FP8_DTYPE, (m, k))
    _check_activation_scale(a_scale, m, cdiv(k, BLOCK))
    for t, nm in ((a, "a (activations)"), (a_scale, "a_scale")):
        if t.device != w.device:
            _fail(f"{nm} is on {t.device} but the weight is on {w.device}")
    _check_bias(bias, n, w.device)
    if out_dtype not in _OUT_DTYPES:
        _fail(f"out_dtype must be one of bf16/fp16/fp32, got {out_dtype}")
    return m, n, k


# ------------------------------------------------------------------------ custom ops
# The GEMMs run as custom ops in our own namespace, with fake (meta) implementations, so
# torch.compile traces through them and CUDA graphs capture them.
def _gemm_impl(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(a.shape[0], w.shape[0], dtype=out_dtype, device=a.device)
    if a.shape[0]:  # an empty batch launches nothing
        dispatch.backend_for(a.device, *_gemm_dims(a, w)).gemm(a, a_scale, w, w_scale, bias,
                                                                 out)
    return out


_gemm_op = torch.library.custom_op("fp8linear::block_fp8_gemm", _gemm_impl, mutates_args=())


@_gemm_op.register_fake
def _(a, a_scale, w, w_scale, bias, out_dtype):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


def _gemm_scale_t_impl(a: torch.Tensor, scale_t: torch.Tensor, w: torch.Tensor,
                      w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                      out_dtype: torch.dtype) -> torch.Tensor:
    # block_fp8_gemm with the activation scales as fp8linear.norm_quant writes them:
    # scale_t [K/128, ld], token m's at [g, m] (custom ops cannot take or return views, so
    # the [M, K/128] view is made here)
    return _gemm_impl(a, scale_view(scale_t, a.shape[0]), w, w_scale, bias, out_dtype)


gemm_scale_t_op = torch.library.custom_op("fp8linear::block_fp8_gemm_scale_t",
                                          _gemm_scale_t_impl, mutates_args=())


@gemm_scale_t_op.register_fake
def _(a, scale_t, w, w_scale, bias, out_dtype):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


def _linear_impl(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0]:  # an empty batch launches nothing
        dispatch.backend_for(x.device, *_gemm_dims(x, w)).linear(x, w, w_scale, bias, out)
    return out


_linear_op = torch.library.custom_op("fp8linear::fp8_linear", _linear_impl, mutates_args=())


@_linear_op.register_fake
def _(x, w, w_scale, bias):
    return x.new_empty((x.shape[0], w.shape[0]))


def _gemm_dims(a, w):
    return a.shape[0], w.shape[0], w.shape[1]


def _run(op, impl, *args):
    # torch.compile must see the custom op (opaque, with its fake impl); eager calls and CUDA
    # graph capture run the implementation directly, since the op's dispatcher round trip
    # costs ~9 us of host time per call and custom models often run eagerly.
    if torch.compiler.is_compiling():
        return op(*args)
    return impl(*args)


# ----------------------------------------------------------------------- public API
def block_fp8_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor,
                   w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                   out: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """C[M,N] = sum over 128-wide K blocks of (A.Wt)_blk x a_scale[m,kb] x w_scale[n,kb].

    a_fp8 [M,K] float8_e4m3fn; a_scale fp32 [M, ceil(K/128)], row-major or column-major
    (strides (1, ld): vLLM's and DeepGEMM's layout; on Hopper with ld % 4 == 0 it is read in
    place, other layouts cost a copy); w_fp8 [N,K] float8_e4m3fn;
    w_scale fp32 [ceil(N/128), ceil(K/128)] (128x128 blocks) or [N, ceil(K/128)] (per row).
    """
    m, n, _ = _check_gemm(a_fp8, a_scale, w_fp8, w_scale, bias, out_dtype)
    if out is None:
        return _run(_gemm_op, _gemm_impl, a_fp8, a_scale, w_fp8, w_scale, bias, out_dtype)
    _check_2d_contiguous(out, "out", out_dtype, (m, n))
    if out.device != w_fp8.device:
        _fail(f"out is on {out.device} but the weight is on {w_fp8.device}")
    if m:
        dispatch.backend_for(a_fp8.device, *_gemm_dims(a_fp8, w_fp8)).gemm(
            a_fp8, a_scale, w_fp8, w_scale, bias, out)
    return out


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ dequant(W)^T + bias, x bf16/fp16/fp32 of any leading shape, y in x's dtype.

    x is quantized on the fly per token per 128 channels (fused into the GEMM launch where
    the backend can).
    """
    check_weight(w_fp8, w_scale)
    n, k = w_fp8.shape
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != k:
        _fail(f"x must have last dimension {k} (the weight is [{n}, {k}]), got "
              f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in _OUT_DTYPES:
        _fail(f"x must be bf16/fp16/fp32, got {x.dtype}")
    if x.device != w_fp8.device:
        _fail(f"x is on {x.device} but the weight is on {w_fp8.device}")
    _check_bias(bias, n, w_fp8.device)
    if x.dim() == 2 and x.is_contiguous():  # (a reshape and a view cost ~2 us each)
        return _run(_linear_op, _linear_impl, x, w_fp8, w_scale, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = _run(_linear_op, _linear_impl, x2, w_fp8, w_scale, bias)
    return y.view(*lead, n)
