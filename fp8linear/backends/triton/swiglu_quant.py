"""SiLU-and-mul + per-token, per-128-channel FP8 quantization in one Triton kernel.

What the vLLM plugin puts in place of the SiLU-and-mul before down_proj
(integrations/vllm/quant_fusion_pass.py): down_proj then reads fp8 activations, with no
quantization kernel between the activation and it.

Numerics: vLLM's native SiluAndMul in x's dtype (silu in fp32, x / (1 + exp(-x)) as torch
computes it, rounded; times the up half, rounded), then quant_group (quant.py), so the
fp8 values and scales are quantize_activation of that product.

A program takes CG groups of 128 output channels of one row (its gate and up halves: 512 bytes
of input a group): 4 for few rows, so that decode sizes make hundreds of programs, 8 or 16
for more (plan.fused_quant_split). Launched with PDL where the GPU has it, as norm_quant.py
is.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...quant import AMAX_EPS, FP8_MAX
from .norm_quant import launch_settings, pdl_acquire, pdl_release
from .quant import needs_round_first, quant_group

# the most groups a program takes (2048 outputs): the rows make the parallelism beyond that
MAX_GROUPS_PER_PROGRAM = 16


@triton.jit
def silu_mul(a, b):
    """SiLU(a) * b in a's dtype, as vLLM's SiluAndMul: silu in fp32 (x / (1 + exp(-x))),
    rounded, times b, rounded (the fp32 product of two 16-bit floats is exact: rounding it
    once is torch's multiply)."""
    af = a.to(tl.float32)
    silu = (af / (1.0 + tl.exp(-af))).to(a.dtype)
    return (silu.to(tl.float32) * b.to(tl.float32)).to(a.dtype)


@triton.jit(do_not_specialize=["s_ld"])     # (ld = M rounded up to 4: no recompile per M)
def _silu_mul_quant_kernel(x_ptr, y_ptr, q_ptr, s_ptr, s_ld,
                           D: tl.constexpr, CG: tl.constexpr,
                           STORE_Y: tl.constexpr, USE_GDC: tl.constexpr,
                           EARLY_TRIGGER: tl.constexpr, FP8_MAX_C: tl.constexpr,
                           EPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * CG + tl.arange(0, CG)
    mine = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    pdl_acquire(USE_GDC, EARLY_TRIGGER)
    mask = mine < D
    a = tl.load(x_ptr + row * (2 * D) + mine, mask=mask, other=0.0)
    b = tl.load(x_ptr + row * (2 * D) + D + mine, mask=mask, other=0.0)
    pdl_release(USE_GDC, EARLY_TRIGGER)
    y = silu_mul(a, b)
    if STORE_Y:
        tl.store(y_ptr + row * D + mine, y, mask=mask)
    q, s = quant_group(y.to(tl.float32), FP8_MAX_C, EPS, ROUND_FIRST)
    tl.store(q_ptr + row * D + mine, q, mask=mask)
    tl.store(s_ptr + g.to(tl.int64) * s_ld + row, s, mask=g * 128 < D)


def launch(x, q, scale_t, y=None, pdl=None, groups=None, warps=None):
    """x [M, 2d] -> q [M, d] fp8, scale_t [d/128, ld] fp32 (token m's scale of group g at
    [g, m]); y, if given, receives silu(x[:, :d]) * x[:, d:] (tests). pdl, groups: see
    norm_quant.launch_settings. Validated by the caller (fp8linear.swiglu_quant)."""
    m, d = x.shape[0], x.shape[1] // 2
    cg, warps, pdl, early = launch_settings(x, d // 128, MAX_GROUPS_PER_PROGRAM, groups, pdl,
                                            warps, norm=False)
    grid = (m, triton.cdiv(d // 128, cg))
    _silu_mul_quant_kernel[grid](
        x, y if y is not None else x, q, scale_t, scale_t.stride(0), D=d, CG=cg,
        STORE_Y=y is not None, USE_GDC=pdl, EARLY_TRIGGER=early, FP8_MAX_C=FP8_MAX, EPS=AMAX_EPS,
        ROUND_FIRST=needs_round_first(x.device), num_warps=warps, launch_pdl=pdl)
