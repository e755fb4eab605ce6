"""The torch reference backend: the CPU compute path and the numerics' definition."""
from __future__ import annotations

from ..quant import quantize_activation, reference_gemm

name = "reference"


def gemm(a, a_scale, w, w_scale, bias, out):
    reference_gemm(a, a_scale, w, w_scale, bias=bias, out=out)


def linear(x, w, w_scale, bias, out):
    xq, xs = quantize_activation(x)
    reference_gemm(xq, xs, w, w_scale, bias=bias, out=out)


def grouped_gemm(a, a_scale, w, w_scale, r, out, which):
    """The grouped expert GEMM (fp8linear.moe_routing): token tile i against expert
    r.tile_expert[i]'s weights; unused tiles (-1) are left as they are."""
    t = r.token_tile
    for i, e in enumerate(r.tile_expert.tolist()):  # (the reference: a host sync is fine)
        if e >= 0:
            rows = slice(i * t, (i + 1) * t)
            reference_gemm(a[rows], a_scale[rows], w[e], w_scale[e], out=out[rows])


def moe_stages():
    """The MoE layer's sorted-row stages in torch (fp8linear.moe_routing), for tests of the
    sorted pipeline on the CPU."""
    from .. import moe_routing as mr
    return mr.Stages(mr.route, mr.gather_quant, grouped_gemm, mr.silu_mul_quant_rows, mr.combine)
