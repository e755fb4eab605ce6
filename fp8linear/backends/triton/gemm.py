"""The portable Triton backend: every GPU that is not Hopper-with-our-CUDA-kernels.

Two modes, one kernel (``_gemm_kernel``, specialised by constexpr flags):

* native (sm_89 Ada, sm_90, sm_100+, ROCm gfx950): fp8 x fp8 ``tl.dot`` per 128-wide K block,
  each block's fp32 product times a_scale[m, kb] * w_scale[n, kb] added to an fp32 total
  (DeepSeek-V3 "promotion"; it also bounds Hopper's reduced-precision fp8 accumulation to
  128 products).
* weight_only (sm_80/86 Ampere, and any GPU with FP8LINEAR_TRITON_MODE=weight_only): the
  fp8 weight bytes are decoded to fp16 with integer ops in the kernel (Triton rejects the
  e4m3fn type below sm_89, so weights travel as uint8) and multiplied with the bf16/fp16
  activations on the ordinary tensor cores, fp32 accumulation, the block scale applied per
  128-wide K block as in the native mode. The decoded value is exact, so the result equals
  ``x @ dequantize_weight(w).T`` up to fp32 summation order, and is in fact closer to the
  exact product than rounding dequantized weights to bf16 first would be.

Split-K (small M, few output tiles): each split writes an fp32 partial tile to a workspace
from the torch allocator, a second kernel adds the splits in a fixed order, adds the bias
and casts. No float atomics: results are bitwise reproducible, and the workspace comes from
the caching allocator, so CUDA-graph capture works (the graph's private pool owns it).

Portability: no inline PTX, no CUDA-only intrinsics; ROCm is untested (MI300's native fp8
is e4m3fnuz, so there the weight-only mode is the default; see ``_default_mode``).
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ... import knobs
from ...quant import AMAX_EPS, BLOCK, FP8_MAX, cdiv
from . import quant as triton_quant
from .plan import TritonConfig as Config, choose as choose_config, device_info
from .quant import quant_group

name = "triton"

MODES = knobs.TRITON_MODE.choices

# A operand kinds (constexpr A_KIND)
A_FP8 = 0        # pre-quantized fp8 activations, native fp8 dot
A_FP8_BITS = 1   # pre-quantized fp8 activations as uint8, decoded to fp16 (weight-only gemm())
A_FLOAT = 2      # bf16/fp16/fp32 activations used as they are (weight-only linear())
A_QUANT = 3      # bf16/fp16/fp32 activations quantized to fp8 inside the GEMM (small M)

# Decoding e4m3fn bits into fp16 bits by shifting gives value / 2**8 (bias 15 vs 7), exactly,
# subnormals included; the factor goes back in through the scale.
_DECODE_UNSCALE = 256.0

# linear() quantizes the activations inside the GEMM up to this M (see _linear for why).
FUSE_QUANT_MAX_M = 32


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _fp8_bits_to_f16(b):
    """uint8 e4m3fn bit patterns -> fp16 holding value / 256 (exact; NaN stays NaN)."""
    h = b.to(tl.uint16)
    h = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True)


# M changes with every batch: not specialising on it avoids a recompile per M class
@triton.jit(do_not_specialize=["M", "KB", "KB_PER_SPLIT"])
def _gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr, part_ptr,
                 M, N, K, KB, KB_PER_SPLIT,
                 A_KIND: tl.constexpr, W_BITS: tl.constexpr, SCALE_ROWS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                 DOT_PREC: tl.constexpr, UNSCALE: tl.constexpr,
                 FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    BK: tl.constexpr = 128
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped tile order: GROUP_M row-tiles walk N together so their weight tiles are
    # re-read from L2 rather than HBM (matters only when M spans several tiles).
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    # Rows past M / N wrap onto valid rows, so A/W loads need no M/N masks (keeps them
    # vectorised); those rows are never stored.
    am = (rm % M).to(tl.int64)
    wn = (rn % N).to(tl.int64)
    rk = tl.arange(0, BK)
    a_rows = a_ptr + am[:, None] * K            # [BM, 1]
    w_cols = w_ptr + wn[None, :] * K            # [1, BN]; tile is [BK, BN], K contiguous
    as_rows = as_ptr + am * KB
    # a weight scale per output column: per-row scales, or 128x128 blocks under a tile wider
    # than a block (each column gathers its block's scale)
    COL_SCALES: tl.constexpr = SCALE_ROWS == 1 or BN > 128
    if SCALE_ROWS == 1:
        ws_ptrs = ws_ptr + wn * KB              # per-row weight scales: one per output row
    elif BN > 128:
        ws_ptrs = ws_ptr + (wn // 128) * KB
    else:
        # 128x128 blocks, BN divides 128: the whole tile shares one scale row
        ws_ptrs = ws_ptr + ((pid_n * BN) // 128) * KB

    kb_lo = pid_k * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, KB)
    # Scales are prefetched one K-block ahead: Triton's pipeliner stages only the tile
    # loads, and a scale load issued in the iteration that uses it would stall the
    # promotion multiply on its latency every step.
    sw_next = tl.load(ws_ptrs + kb_lo)
    if A_KIND < 2:
        sa_next = tl.load(as_rows + kb_lo)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k = kb * BK + rk
        if EVEN_K:
            a = tl.load(a_rows + k[None, :])
            w = tl.load(w_cols + k[:, None])
        else:
            a = tl.load(a_rows + k[None, :], mask=k[None, :] < K, other=0.0)
            w = tl.load(w_cols + k[:, None], mask=k[:, None] < K, other=0.0)
        k_next = tl.minimum(kb + 1, KB - 1)
        sw = sw_next
        sw_next = tl.load(ws_ptrs + k_next)
        if A_KIND < 2:
            sa = sa_next
            sa_next = tl.load(as_rows + k_next)

        if A_KIND == 1:      # fp8 activation bits -> fp16 (weight-only gemm)
            a = _fp8_bits_to_f16(a)
            sa = sa * UNSCALE
        elif A_KIND == 3:    # quantize here, same numerics as triton_quant / quant.py
            a, sa = quant_group(a.to(tl.float32), FP8_MAX_C, EPS, ROUND_FIRST)

        if W_BITS:
            w = _fp8_bits_to_f16(w)
            sw = sw * UNSCALE
            if A_KIND == 2:
                w = w.to(a.dtype)   # exact: these values fit bf16 and fp32 too

        d = tl.dot(a, w, input_precision=DOT_PREC)
        if A_KIND == 2:
            if COL_SCALES:
                acc += d * sw[None, :]
            else:
                acc += d * sw
        else:
            if COL_SCALES:
                acc += (d * sa[:, None]) * sw[None, :]
            else:
                acc += d * (sa * sw)[:, None]

    cm = pid_m * BM + tl.arange(0, BM)
    cn = pid_n * BN + tl.arange(0, BN)
    mask = (cm[:, None] < M) & (cn[None, :] < N)
    offs = cm.to(tl.int64)[:, None] * N + cn[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cn, mask=cn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["MN", "N", "NSPLIT"])
def _splitk_reduce_kernel(part_ptr, bias_ptr, c_ptr, MN, N, NSPLIT,
                          HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr):
    # Splits are added in index order 0, 1, 2, ...: the same bits on every run.
    offs = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, NSPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------ plans
class _Plan(NamedTuple):
    cfg: Config
    grid: tuple
    split: int
    kb_per_split: int


@functools.lru_cache(maxsize=None)
def _default_mode(index: int) -> str:
    if torch.version.hip is not None:
        # Only gfx950 (MI350) has OCP e4m3fn tensor-core fp8; MI300 (gfx942) computes in
        # e4m3fnuz, a different encoding. Decoding weights in the kernel is correct everywhere.
        arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
        return "native" if arch.startswith("gfx95") else "weight_only"
    # fp8 tensor cores (and Triton's e4m3fn type) start at sm_89
    return "native" if torch.cuda.get_device_capability(index) >= (8, 9) else "weight_only"


@functools.lru_cache(maxsize=None)
def _has_fp8_dot(index: int) -> bool:
    # Triton rejects the e4m3fn type below sm_89; ROCm is left to Triton (untested)
    return torch.version.hip is not None or torch.cuda.get_device_capability(index) >= (8, 9)


def mode(device: torch.device) -> str:
    """The mode this device runs: FP8LINEAR_TRITON_MODE=native|weight_only, or by capability."""
    v = knobs.get(knobs.TRITON_MODE)
    if v:
        if v == "native" and device.type == "cuda" and not _has_fp8_dot(device.index or 0):
            cap = torch.cuda.get_device_capability(device.index or 0)
            raise ValueError(f"{knobs.TRITON_MODE.name}=native needs fp8 tensor cores (sm_89 or newer); "
                             f"this GPU is sm_{cap[0]}{cap[1]}: use weight_only")
        return v
    if device.type != "cuda":
        return "native"
    return _default_mode(device.index or 0)


@functools.lru_cache(maxsize=16384)
def _plan(dev_type: str, index: int, m: int, n: int, k: int, a_bytes: int,
          weight_only: bool, forced: Optional[Config] = None) -> _Plan:
    cfg = forced or choose_config(m, n, k, a_bytes, weight_only, device_info(dev_type, index))
    kb = cdiv(k, BLOCK)
    per = cdiv(kb, max(1, min(cfg.split, kb)))
    split = cdiv(kb, per)          # every split gets >= 1 K-block
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    return _Plan(cfg, (tiles, split), split, per)


def _dot_precision(dev_type: str, index: int) -> str:
    # Only matters for fp32 activations in weight-only mode: 3xTF32 on NVIDIA keeps ~fp32
    # accuracy (plain TF32 would truncate x to 10 bits); AMD's fp32 MFMA is exact ("ieee").
    return "ieee" if device_info(dev_type, index).hip else "tf32x3"


# --------------------------------------------------------------------------- launches
def _launch(a, a_scale, w, w_scale, bias, out, a_kind: int, w_bits: bool,
            forced: Optional[Config] = None) -> None:
    m, k = a.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return
    if k == 0:
        # empty reduction: the product is zero
        if bias is None:
            out.zero_()
        else:
            out.copy_(bias.to(torch.float32).expand(m, n))
        return
    dev = a.device
    index = dev.index if dev.index is not None else 0
    plan = _plan(dev.type, index, m, n, k, a.element_size(), w_bits, forced)
    cfg = plan.cfg
    kb = cdiv(k, BLOCK)
    split = plan.split > 1
    part = (torch.empty((plan.split, m, n), dtype=torch.float32, device=dev) if split
            else out)
    _gemm_kernel[plan.grid](
        a, a_scale if a_scale is not None else out, w, w_scale,
        bias if bias is not None else out, out, part,
        m, n, k, kb, plan.kb_per_split,
        A_KIND=a_kind, W_BITS=w_bits, SCALE_ROWS=(1 if w_scale.shape[0] == n else 128),
        HAS_BIAS=bias is not None, SPLIT=split, EVEN_K=(k % BLOCK == 0),
        BM=cfg.bm, BN=cfg.bn, GROUP_M=cfg.group_m,
        DOT_PREC=_dot_precision(dev.type, index), UNSCALE=_DECODE_UNSCALE,
        FP8_MAX_C=FP8_MAX, EPS=AMAX_EPS,
        ROUND_FIRST=a_kind == A_QUANT and triton_quant.needs_round_first(dev),
        num_warps=cfg.warps, num_stages=cfg.stages)
    if split:
        mn = m * n
        _splitk_reduce_kernel[(cdiv(mn, 1024),)](
            part, bias if bias is not None else out, out, mn, n, plan.split,
            HAS_BIAS=bias is not None, BLOCK_E=1024, num_warps=4)


def _on_device(dev: torch.device):
    # Triton launches on the *current* device: switch for tensors that live on another one
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        return torch.cuda.device(dev.index)
    return contextlib.nullcontext()


def gemm(a, a_scale, w, w_scale, bias, out, config: Optional[Config] = None) -> None:
    """out[M,N] = blockwise-scaled fp8 GEMM of pre-quantized a (fp8 [M,K]) and w (fp8 [N,K]).

    ``config`` overrides the tile rules (tests, benchmarks); leave it None in serving code.
    """
    with _on_device(a.device):
        _gemm(a, a_scale, w, w_scale, bias, out, config)


def linear(x, w, w_scale, bias, out, config: Optional[Config] = None) -> None:
    """out[M,N] = x @ dequant(w)^T + bias; x bf16/fp16/fp32 [M,K] contiguous."""
    with _on_device(x.device):
        _linear(x, w, w_scale, bias, out, config)


def _gemm(a, a_scale, w, w_scale, bias, out, config):
    a_scale = a_scale.contiguous()  # the kernel indexes row-major [M, Kb] scales
    if mode(a.device) == "weight_only":
        # no fp8 tensor cores assumed: both operands are decoded to fp16 in the kernel
        _launch(a.view(torch.uint8), a_scale, w.view(torch.uint8), w_scale, bias, out,
                A_FP8_BITS, True, config)
    else:
        _launch(a, a_scale, w, w_scale, bias, out, A_FP8, False, config)


def _linear(x, w, w_scale, bias, out, config):
    m = x.shape[0]
    if mode(x.device) == "weight_only":
        _launch(x, None, w.view(torch.uint8), w_scale, bias, out, A_FLOAT, True, config)
    elif m <= FUSE_QUANT_MAX_M:
        # Small M: each program quantizes its own BM x 128 activation slice (one launch
        # instead of two; re-reading x from L2 per N tile is cheap at this M).
        _launch(x, None, w, w_scale, bias, out, A_QUANT, False, config)
    else:
        q, s = triton_quant.quantize_activation(x)
        _launch(q, s, w, w_scale, bias, out, A_FP8, False, config)
