"""Per-token, per-128-channel FP8 activation quantization in Triton.

Bit-identical to ``fp8linear.quant.quantize_activation`` (default, non-UE8M0 scales):
amax over the group in fp32, scale = max(amax, 1e-10) / 448 and q = clamp(x / scale, +-448)
rounded to nearest-even float8_e4m3fn. Both divisions are IEEE round-to-nearest
(``div_rn``): Triton's plain ``/`` may lower to an approximate division on some targets,
and one ulp of difference in the scale changes the quantized values.

``quant_group`` is shared with the fused small-M GEMM in gemm.py, so the fused and
the standalone paths cannot drift apart numerically.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...quant import BLOCK, FP8_DTYPE, FP8_MAX, AMAX_EPS, cdiv


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def round_to_e4m3(q):
    """fp32 (|q| <= 448 or NaN) -> the nearest e4m3fn value (ties to even), still in fp32.

    Needed where Triton converts fp32 -> e4m3 through fp16 (sm_89: cvt ... e4m3x2.f16x2):
    rounding twice differs from torch's single rounding for ~1% of values. A value that
    is already exactly representable converts exactly on any path.
    """
    # normal range (|q| >= 2^-6): round the fp32 mantissa to 3 bits, ties to even; a carry
    # correctly moves into the exponent. NaN stays NaN (mantissa bits survive the mask).
    u = q.to(tl.uint32, bitcast=True)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9. Adding 1.5 * 2^23 rounds |y| < 2^22 to an integer
    # (ties to even); q * 512 is exact, so a contracted fma gives the same bits. The sign
    # bit is put back so that tiny negatives give -0 like torch.
    big: tl.constexpr = 12582912.0
    sub = ((q * 512.0 + big) - big) * 0.001953125
    sub = (sub.to(tl.uint32, bitcast=True) | (u & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(q) < 0.015625, sub, normal)


@triton.jit
def quant_group(x, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """x: fp32 [R, 128] (zeros where masked) -> (float8e4nv [R, 128], fp32 scale [R])."""
    # NaN-propagating max/clamp, like torch's amax/clamp: a NaN or inf in a token's group
    # makes that group NaN, as in the reference, instead of silently clamping to +-448.
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.math.div_rn(tl.maximum(amax, EPS, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_C)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.clamp(q, -FP8_MAX_C, FP8_MAX_C, propagate_nan=tl.PropagateNan.ALL)
    if ROUND_FIRST:
        q = round_to_e4m3(q)
    return q.to(tl.float8e4nv), scale


def needs_round_first(device: torch.device) -> bool:
    """True where Triton's fp32 -> e4m3 conversion is not one correctly rounded step.

    sm_90 and newer use cvt.rn.satfinite.e4m3x2.f32 (single rounding); sm_89 goes through
    fp16; ROCm's conversion instructions are unverified here, so round explicitly there.
    """
    if device.type != "cuda":
        return False
    if torch.version.hip is not None:
        return True
    return _capability(device.index or 0) < (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


@triton.jit(do_not_specialize=["M", "KB"])     # no recompile per batch size
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, KB,
                  ROWS: tl.constexpr, GROUPS: tl.constexpr, EVEN_K: tl.constexpr,
                  FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    # One program: ROWS tokens x GROUPS consecutive 128-channel groups, looped over rows
    # so that a program moves a few KB (tiny programs would be launch-bound at large M).
    pid_r = tl.program_id(0)
    pid_g = tl.program_id(1)
    g = pid_g * GROUPS + tl.arange(0, GROUPS)
    c = tl.arange(0, 128)
    cols = g[:, None] * 128 + c[None, :]
    if EVEN_K:
        cmask = g[:, None] < KB
    else:
        cmask = (g[:, None] < KB) & (cols < K)
    for i in range(ROWS):
        row = pid_r * ROWS + i
        if row < M:
            base = row.to(tl.int64) * K
            x = tl.load(x_ptr + base + cols, mask=cmask, other=0.0).to(tl.float32)
            q, s = quant_group(x, FP8_MAX_C, EPS, ROUND_FIRST)
            tl.store(q_ptr + base + cols, q, mask=cmask)
            tl.store(s_ptr + row.to(tl.int64) * KB + g, s, mask=g < KB)


def quantize_activation(x: torch.Tensor):
    """x [M, K] contiguous bf16/fp16/fp32 on a GPU -> (fp8 [M, K], fp32 scale [M, ceil(K/128)]).

    No validation beyond what the kernel needs: callers (fp8linear.ops) validated already.
    """
    m, k = x.shape
    kb = cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    launch_quant(x, q, s)
    return q, s


def launch_quant(x, q, s, round_first: bool | None = None):
    m, k = x.shape
    kb = s.shape[1]
    groups = min(8, triton.next_power_of_2(kb))      # up to 1024 channels per program
    rows = 1 if m < 1024 else 4                       # large M: amortise the program cost
    grid = (cdiv(m, rows), cdiv(kb, groups))
    _quant_kernel[grid](x, q, s, m, k, kb, ROWS=rows, GROUPS=groups, EVEN_K=(k % BLOCK == 0),
                        FP8_MAX_C=FP8_MAX, EPS=AMAX_EPS,
                        ROUND_FIRST=(needs_round_first(x.device) if round_first is None
                                     else round_first), num_warps=4)
