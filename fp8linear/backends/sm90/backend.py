"""The Hopper backend: our sm_90a CUDA kernels (csrc/sm90), behind the backend protocol.

Two kernels, chosen by ``plan.choose`` (via ``launch.decide``): decode (swap-AB, split-K; it
quantizes the activations itself where its slice is small, else our quant kernel runs first
and lets it start early under PDL) and the persistent large-M GEMM (behind the quant kernel
for fp8_linear). Python only hands the kernel library its tensors; the library keeps its
scratch per stream (csrc/capi.cpp), so CUDA-graph capture works. Every check that matters ran
in fp8linear/ops.py before we get here.
"""
from __future__ import annotations

import sys

import torch

from ... import knobs
from ...quant import empty_scale_t, has_row_scales, scale_view
from . import library
from .launch import Launch, decide
from .plan import shape_ok

name = "sm90"


def available() -> bool:
    return library.available()


def check_shape(n: int, k: int) -> None:
    if not shape_ok(n, k):
        raise ValueError(
            f"the sm90 backend needs K % 16 == 0 and N % 8 == 0 (TMA needs 16-byte row "
            f"strides); got N={n}, K={k}. Unset FP8LINEAR_BACKEND to use the Triton path.")


# FP8LINEAR_LOG_DISPATCH=1: each distinct decision once (read once; off costs a bool test)
_LOG_DISPATCH = knobs.get(knobs.LOG_DISPATCH) == "1"
_logged: set = set()


def _log(op, x, w, out, path):
    key = (op, tuple(x.shape), tuple(w.shape), x.dtype, out.dtype, path)
    if key not in _logged:
        _logged.add(key)
        print(f"fp8linear dispatch: {op} x{tuple(x.shape)} {x.dtype} w{tuple(w.shape)} -> "
              f"{out.dtype}: {path}", file=sys.stderr, flush=True)


def _bias(bias, out):
    # The kernels add the bias in fp32, reading it in the output dtype or as fp32: a bias in
    # any other dtype goes as fp32 (exact for fp16/bf16), never rounded to the output type
    # first (an fp32 bias rounded to bf16 alone costs up to 2^-9 of its magnitude).
    if bias is None:
        return None
    if bias.dtype not in (out.dtype, torch.float32):
        bias = bias.float()
    if bias.data_ptr() % 8:  # the kernels read bias pairs: an odd-offset view gets a copy
        bias = bias.clone()
    return bias


def _decode(x, x_scale, w, w_scale, bias, out, lp: Launch, quant_first: bool = False):
    p = lp.plan
    library.load().decode(x, x_scale, w, w_scale, has_row_scales(w_scale, out.shape[1]),
                          _bias(bias, out), out, lp.ws_floats, lp.tiles, p.config, p.rows,
                          p.splits, p.ctas_per_sm, lp.pdl, lp.early, quant_first)


def _gemm(a, a_scale_t, w, w_scale, bias, out, lp: Launch):
    # a_scale_t None: a holds 16/32-bit activations, which the library quantizes first
    library.load().gemm(a, a_scale_t, w, w_scale, has_row_scales(w_scale, out.shape[1]),
                        _bias(bias, out), out, lp.plan.config, lp.gemm_pdl, lp.pdl,
                        lp.gemm_early_b, lp.gemm_group_m, lp.ws_floats, lp.tiles)


def _fallback():
    # fp32 outputs and unaligned views: the Triton path (imported only when needed)
    from ..triton import gemm as triton_gemm
    return triton_gemm


def _scale_t(a_scale, m):
    # The GEMM's TMA reads per-K-block token scales as [Kb, M] rows of stride ld, ld a multiple
    # of 4 (16-byte rows). Column-major scales with such an ld (our quant kernel's, vLLM's,
    # DeepGEMM's layout) are read in place; row-major ones cost a transposing copy, a second
    # kernel on the GEMM's critical path (~2 us at M = 128-512).
    st = a_scale.t()
    if (a_scale.stride(0) == 1 and st.stride(0) % 4 == 0 and st.stride(0) >= m
            and st.data_ptr() % 16 == 0):
        return st
    t = empty_scale_t(m, a_scale.shape[1], a_scale.device)
    scale_view(t, m).copy_(a_scale)
    return t


def _tma_aligned(a, w, out) -> bool:
    # TMA descriptors need 16-byte aligned base addresses; views at odd offsets go to Triton.
    return (a.data_ptr() | w.data_ptr() | out.data_ptr()) % 16 == 0


def gemm(a, a_scale, w, w_scale, bias, out):
    # the CUDA epilogue writes 16-bit outputs only
    if out.dtype == torch.float32 or not _tma_aligned(a, w, out):
        if _LOG_DISPATCH:
            _log("block_fp8_gemm", a, w, out, "triton (fp32 output or unaligned pointer)")
        return _fallback().gemm(a, a_scale, w, w_scale, bias, out)
    m, k = a.shape
    n = w.shape[0]
    lp = decide(m, n, k, a.dtype, a.device.index, False)
    if _LOG_DISPATCH:
        _log("block_fp8_gemm", a, w, out, f"sm90 {lp.plan} ({lp.plan.rule})")
    if lp.plan.kind == "decode":
        _decode(a, a_scale, w, w_scale, bias, out, lp)
    else:
        _gemm(a, _scale_t(a_scale, m), w, w_scale, bias, out, lp)


def linear(x, w, w_scale, bias, out):
    if out.dtype == torch.float32 or not _tma_aligned(x, w, out):
        if _LOG_DISPATCH:
            _log("fp8_linear", x, w, out, "triton (fp32 output or unaligned pointer)")
        return _fallback().linear(x, w, w_scale, bias, out)
    m, k = x.shape
    n = w.shape[0]
    lp = decide(m, n, k, x.dtype, x.device.index, True)
    if _LOG_DISPATCH:
        _log("fp8_linear", x, w, out,
             f"sm90 {'fused quant' if lp.fused else 'quant kernel'} + {lp.plan} "
             f"({lp.plan.rule})")
    if lp.plan.kind == "decode":
        # fused: the decode kernel quantizes x itself; else the library runs the quant
        # kernel first (under PDL: it lets the GEMM start streaming weights early)
        _decode(x, None, w, w_scale, bias, out, lp, quant_first=not lp.fused)
    else:
        _gemm(x, None, w, w_scale, bias, out, lp)
