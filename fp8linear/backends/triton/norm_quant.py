"""(Residual add +) RMSNorm + per-token, per-128-channel FP8 quantization in one Triton kernel.

What the vLLM plugin puts in place of a norm whose output only feeds our linear layers
(integrations/vllm/quant_fusion_pass.py): the GEMM then reads fp8 activations, with no
quantization kernel between the norm and it (a grid-dependency hop of ~1-2 us a GEMM at
16-64 tokens; docs/tuning.md: vllm-fuse-quant).

Numerics: vLLM's native rms_norm / fused_add_rms_norm (fp32 sum of the two inputs, the
residual rounded to the input dtype, fp32 mean of squares, y = (x * rsqrt(var + eps)) rounded
to the weight's dtype, times the weight, rounded), then quant_group (quant.py), so the
fp8 values and scales are exactly quantize_activation(y).

A program normalises CG groups of 128 channels of one row. For few rows a row is spread over
K / (128 CG) programs, each re-reading the whole row for its sum of squares (a few KB from
L2): with one program a row the kernel ran longer than the hop it removes (at 16 tokens only
16 programs). From 32 rows a program takes the whole row, 16 warps for K 4096, and reads it
once (plan.fused_quant_split).
Launched with PDL where the GPU has it (pdl_acquire / pdl_release): griddepcontrol.wait before
the first load, launch_dependents after the last, as torch Inductor's kernels do, or
(EARLY_TRIGGER: the norm below 32 rows, plan.fused_quant_early_trigger) right after the
wait.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import knobs
from ...quant import AMAX_EPS, BLOCK, FP8_MAX
from .plan import device_info, fused_quant_early_trigger, fused_quant_split
from .quant import _capability, needs_round_first, quant_group


# The PDL protocol of the fused quantization kernels (this one, swiglu_quant.py), in
# one place: wait for the previous kernel before the first load; let the next kernel launch
# right after that wait (EARLY_TRIGGER) or after the last load (pdl_release).
@triton.jit
def pdl_acquire(USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:   # (the next kernel waits for our completion before reading)
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release(USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr):
    if USE_GDC and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=["s_ld"])     # (ld = M rounded up to 4: no recompile per M)
def _norm_quant_kernel(x_ptr, res_ptr, w_ptr, res_out_ptr, y_ptr, q_ptr, s_ptr, s_ld, eps,
                       K: tl.constexpr, BLOCK_K: tl.constexpr, CG: tl.constexpr,
                       WHOLE_ROW: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                       STORE_Y: tl.constexpr,
                       USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
                       FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    g = c * CG + tl.arange(0, CG)
    mine = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    mmask = mine < K
    pdl_acquire(USE_GDC, EARLY_TRIGGER)
    xm = tl.load(x_ptr + row * K + mine, mask=mmask, other=0.0).to(tl.float32)
    if HAS_RES:
        xm += tl.load(res_ptr + row * K + mine, mask=mmask, other=0.0).to(tl.float32)
    if not WHOLE_ROW:       # the rest of the row, for the sum of squares
        x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(res_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + mine, mask=mmask, other=0.0)
    pdl_release(USE_GDC, EARLY_TRIGGER)
    if HAS_RES:
        tl.store(res_out_ptr + row * K + mine, xm.to(res_out_ptr.dtype.element_ty), mask=mmask)
    if WHOLE_ROW:
        ss = tl.sum(tl.sum(xm * xm, axis=1), axis=0)
    else:
        ss = tl.sum(x * x, axis=0)
    inv = tl.rsqrt(ss / K + eps)
    y = xm * inv
    if HAS_W:
        # rounded to the weight's dtype, times the weight: the fp32 product of two 16-bit
        # floats is exact, so rounding it once is torch's 16-bit multiply
        y = y.to(w.dtype).to(tl.float32) * w.to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    if STORE_Y:
        tl.store(y_ptr + row * K + mine, y, mask=mmask)
    q, s = quant_group(y.to(tl.float32), FP8_MAX_C, EPS, ROUND_FIRST)
    tl.store(q_ptr + row * K + mine, q, mask=mmask)
    tl.store(s_ptr + g.to(tl.int64) * s_ld + row, s, mask=g * 128 < K)


def pdl_available(device) -> bool:
    """PDL launches: where the GPU has them (sm_90+; not under the CPU interpreter) and
    FP8LINEAR_PDL allows."""
    return (device.type == "cuda" and _capability(device.index or 0)[0] >= 9
            and knobs.get(knobs.PDL) != "0")


def launch_settings(x, groups: int, cap: int, forced=None, pdl=None, warps=None,
                    norm: bool = True):
    """(groups a program, num_warps, pdl, early trigger) of a fused quantization kernel (this
    one, norm; or swiglu_quant.py's) over x's rows of ``groups`` output groups, at most
    ``cap`` a program (plan.fused_quant_split); ``forced`` / ``warps``: a split and
    warp count for benchmarks and tests. pdl: None = where the GPU has it (sm_90+) and
    FP8LINEAR_PDL allows."""
    index = x.device.index or 0
    m = x.shape[0]
    if pdl is None:
        pdl = pdl_available(x.device)
    cg, nw = fused_quant_split(m, groups, device_info(x.device.type, index).sms,
                                          cap, whole_row=norm)
    early = pdl and fused_quant_early_trigger(m, norm)
    return forced or cg, warps or nw, pdl, early


def launch(x, residual, weight, eps, q, scale_t, residual_out, y=None, pdl=None, groups=None,
           warps=None):
    """x [M, K] (+ residual) -> q [M, K] fp8, scale_t [K/128, ld] fp32 (token m's scale of
    group g at [g, m]), residual_out = x + residual; y, if given, receives the normalised
    output (tests). pdl, groups: see launch_settings. Validated by the caller
    (fp8linear.norm_quant)."""
    m, k = x.shape
    cg, warps, pdl, early = launch_settings(x, k // BLOCK, k // BLOCK, groups, pdl, warps)
    grid = (m, triton.cdiv(k // BLOCK, cg))
    _norm_quant_kernel[grid](
        x, residual if residual is not None else x, weight if weight is not None else x,
        residual_out if residual_out is not None else x, y if y is not None else x, q, scale_t,
        scale_t.stride(0), float(eps), K=k, BLOCK_K=triton.next_power_of_2(k), CG=cg,
        WHOLE_ROW=cg * BLOCK >= k,
        HAS_RES=residual is not None, HAS_W=weight is not None, STORE_Y=y is not None,
        USE_GDC=pdl, EARLY_TRIGGER=early, FP8_MAX_C=FP8_MAX, EPS=AMAX_EPS,
        ROUND_FIRST=needs_round_first(x.device), num_warps=warps, launch_pdl=pdl)
