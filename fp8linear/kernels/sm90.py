"""The Hopper backend: our sm_90a CUDA kernels (csrc/sm90), built on first use.

Two kernels sit behind the backend protocol, chosen by heuristics.sm90_plan:
- decode (M <= 32 by default, less the sizes heuristics.sm90_plan gives the large-M tiles):
  swap-AB, split-K; activation quantization fused into the launch up to M = 16 where each CTA's
  slice is small (heuristics.sm90_fuse_quant), else a separate quantization kernel first
  (it lets the GEMM start early under PDL);
- large M: quantization kernel, then the persistent TMA/wgmma GEMM.
Python here only picks the launch (decided once per problem size, see _launch) and hands
the extension its tensors; the extension allocates its scratch (quantized activations, the
split-K workspace) from the torch allocator, so CUDA-graph capture works. Every check that
matters ran in ops.py before we get here.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from . import build, heuristics
from ..quant import cdiv, has_row_scales

name = "sm90"


def available() -> bool:
    return build.available()


def check_shape(n: int, k: int) -> None:
    if not heuristics.sm90_shape_ok(n, k):
        raise ValueError(
            f"the sm90 backend needs K % 16 == 0 and N % 8 == 0 (TMA needs 16-byte row "
            f"strides); got N={n}, K={k}. Unset FP8LINEAR_BACKEND to use the Triton path.")


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# FP8LINEAR_LOG_DISPATCH=1: print each distinct dispatch decision once (to stderr), e.g. to see
# which kernel every layer of a served model runs. Read once; off costs one bool test a call.
_LOG_DISPATCH = os.environ.get("FP8LINEAR_LOG_DISPATCH", "0") not in ("", "0")
_logged: set = set()


def _log(op, x, w, out, path):
    key = (op, tuple(x.shape), tuple(w.shape), x.dtype, out.dtype, path)
    if key not in _logged:
        _logged.add(key)
        import sys
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


def _fallback():
    from . import triton_gemm
    return triton_gemm


class _Launch(NamedTuple):
    """Everything a launch needs besides its tensors, for one (M, N, K, activation dtype,
    device): decided once, then looked up (eager calls feel every microsecond of host time:
    the heuristics and knob reads cost ~5 us a call on the device machine's CPU)."""
    plan: tuple
    fused: bool           # the decode kernel quantizes the activations itself
    tiles: int            # decode, split-tail large-M: output tiles (their counters)
    ws_floats: int        # decode, split-tail large-M: fp32 partials' workspace (0: none)
    cluster: bool
    pdl: bool
    early: bool           # decode: early PDL trigger
    gemm_pdl: bool
    gemm_early_b: int     # large-M: first weight stages before griddepcontrol.wait
    gemm_group_m: int     # large-M: tile order's band of M units


_launches: dict = {}
# Prefill sees many token counts (serving: up to max_num_batched_tokens per weight shape):
# a bounded cache, emptied when full (rebuilding an entry costs ~10 us once).
_MAX_LAUNCHES = 8192


def _launch(m: int, n: int, k: int, x_dtype, index: int, linear: bool) -> _Launch:
    key = (m, n, k, x_dtype, index, linear)
    got = _launches.get(key)
    if got is not None:
        return got
    num_sms = _num_sms(index)
    # (fp8_linear's large-M GEMM runs behind the quant kernel)
    plan = heuristics.sm90_plan(m, n, k, num_sms, after_quant=linear)
    fused, tiles, ws_floats, cluster, early = False, 0, 0, False, False
    if plan[0] == "decode":
        _, config, splits, ctas, rows = plan
        fused = (linear and x_dtype != torch.float32
                 and heuristics.sm90_fuse_quant(m, k, plan))
        bt = heuristics.SM90_DECODE_TILES[config]
        tiles = cdiv(n, rows) * cdiv(m, bt)
        cluster = heuristics.sm90_decode_cluster_reduce(config, splits)
        if splits > 1 and not cluster:
            # (a split's partial tile spans the CTA's 64 or 128 rows, however many it owns)
            ws_floats = splits * tiles * bt * (64 if rows == 64 else 128)
        early = heuristics.sm90_decode_early_trigger(plan, tiles, num_sms)
    elif heuristics.gemm_split_tail(plan[1]):
        # a partial tile a CTA, at most one CTA an SM (csrc/sm90/gemm_kernel.cuh kSplitTail)
        bm, bn = heuristics.SM90_GEMM_CONFIGS[plan[1]][:2]
        tiles = cdiv(m, bm) * cdiv(n, bn)
        ws_floats = num_sms * bm * bn
    gemm_pdl = _gemm_pdl()
    early_b = (heuristics.sm90_gemm_early_weights(m, k, plan[1], linear)
               if gemm_pdl and plan[0] == "gemm" else 0)
    group_m = heuristics.sm90_gemm_group_m(m, k) if plan[0] == "gemm" else 0
    got = _Launch(plan, fused, tiles, ws_floats, cluster, heuristics.pdl_enabled(), early,
                  gemm_pdl, early_b, group_m)
    if heuristics.CACHE_ENV:  # (tests switch knobs between calls: no cache then)
        if len(_launches) >= _MAX_LAUNCHES:
            _launches.clear()
        _launches[key] = got
    return got


heuristics.on_reload(_launches.clear)  # knobs re-read: decide again


def _decode(x, x_scale, w, w_scale, bias, out, lp: _Launch, quant_first: bool = False):
    _, config, splits, ctas, rows = lp.plan
    build.load().decode(x, x_scale, w, w_scale, has_row_scales(w_scale, out.shape[1]),
                        _bias(bias, out), out, lp.ws_floats, lp.tiles, config, rows, splits,
                        ctas, lp.pdl, lp.early, lp.cluster, quant_first)


def _gemm(a, a_scale_t, w, w_scale, bias, out, lp: _Launch):
    # a_scale_t None: a holds 16/32-bit activations, which the extension quantizes first
    build.load().gemm(a, a_scale_t, w, w_scale, has_row_scales(w_scale, out.shape[1]),
                      _bias(bias, out), out, lp.plan[1], lp.gemm_pdl, lp.pdl, lp.gemm_early_b,
                      lp.gemm_group_m, lp.ws_floats, lp.tiles)


def _gemm_pdl() -> bool:
    # The large-M kernel under PDL: its launch and prologue (barrier init, descriptor
    # prefetch, register split) overlap the previous kernel's tail, e.g. fp8_linear's quant
    # kernel, which lets its dependent launch at once. H100,
    # results/2026-11-24_gemm_pdl_ab_h100.log, M = 128-512: fp8_linear -0.5 to -1.1 us back
    # to back and after an elementwise kernel (2112x7168 x 128 17.4 -> 16.4, 6144x4096 x 256
    # 18.6 -> 17.7); 4096x14336 x 256-512 back to back +0.3 to +1.3.
    # FP8LINEAR_SM90_GEMM_PDL=0 turns it off.
    return heuristics.pdl_enabled() and heuristics.env("FP8LINEAR_SM90_GEMM_PDL") != "0"


def _scale_t(a_scale, m):
    # The GEMM's TMA reads per-K-block token scales as [Kb, M] rows of stride ld, ld a multiple
    # of 4 (16-byte rows). Column-major scales with such an ld (our quant kernel's, vLLM's,
    # DeepGEMM's layout) are read in place; row-major ones cost a transposing copy, a second
    # kernel on the GEMM's critical path (~2 us at M = 128-512).
    st = a_scale.t()
    if (a_scale.stride(0) == 1 and st.stride(0) % 4 == 0 and st.stride(0) >= m
            and st.data_ptr() % 16 == 0):
        return st
    ld = cdiv(m, 4) * 4
    t = torch.empty(a_scale.shape[1], ld, dtype=torch.float32, device=a_scale.device)
    t[:, :m].copy_(a_scale.t())
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
    lp = _launch(m, n, k, a.dtype, a.device.index, False)
    if _LOG_DISPATCH:
        _log("block_fp8_gemm", a, w, out, f"sm90 {lp.plan}")
    if lp.plan[0] == "decode":
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
    lp = _launch(m, n, k, x.dtype, x.device.index, True)
    if _LOG_DISPATCH:
        _log("fp8_linear", x, w, out,
             f"sm90 {'fused quant' if lp.fused else 'quant kernel'} + {lp.plan}")
    if lp.plan[0] == "decode":
        # fused: the decode kernel quantizes x itself; else the extension runs the quant
        # kernel first (under PDL: it lets the GEMM start streaming weights early)
        _decode(x, None, w, w_scale, bias, out, lp, quant_first=not lp.fused)
    else:
        _gemm(x, None, w, w_scale, bias, out, lp)
