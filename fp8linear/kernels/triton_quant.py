"""Per-token, per-128-channel FP8 activation quantization in Triton.

Bit-identical to ``fp8linear.quant.quantize_activation`` (default, non-UE8M0 scales):
amax over the group in fp32, scale = max(amax, 1e-10) / 448 and q = clamp(x / scale, +-448)
rounded to nearest-even float8_e4m3fn. Both divisions are IEEE round-to-nearest
(``div_rn``): Triton's plain ``/`` may lower to an approximate division on some targets,
and one ulp of difference in the scale changes the quantized values.

``quant_group`` is shared with the fused small-M GEMM in triton_gemm.py, so the fused and
the standalone paths cannot drift apart numerically.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import BLOCK, FP8_DTYPE, FP8_MAX, AMAX_EPS, cdiv


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quant_group(x, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr):
    """x: fp32 [R, 128] (zeros where masked) -> (float8e4nv [R, 128], fp32 scale [R])."""
    # NaN-propagating max/clamp, like torch's amax/clamp: a NaN or inf in a token's group
    # makes that group NaN, as in the reference, instead of silently clamping to +-448.
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.math.div_rn(tl.maximum(amax, EPS, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_C)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.clamp(q, -FP8_MAX_C, FP8_MAX_C, propagate_nan=tl.PropagateNan.ALL)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, KB,
                  ROWS: tl.constexpr, GROUPS: tl.constexpr, EVEN_K: tl.constexpr,
                  FP8_MAX_C: tl.constexpr, EPS: tl.constexpr):
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
            q, s = quant_group(x, FP8_MAX_C, EPS)
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


def launch_quant(x, q, s):
    m, k = x.shape
    kb = s.shape[1]
    groups = min(8, triton.next_power_of_2(kb))      # up to 1024 channels per program
    rows = 1 if m < 1024 else 4                       # large M: amortise the program cost
    grid = (cdiv(m, rows), cdiv(kb, groups))
    _quant_kernel[grid](x, q, s, m, k, kb, ROWS=rows, GROUPS=groups, EVEN_K=(k % BLOCK == 0),
                        FP8_MAX_C=FP8_MAX, EPS=AMAX_EPS, num_warps=4)
