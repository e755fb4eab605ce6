"""The torch reference backend: the CPU compute path and the numerics' definition."""
from __future__ import annotations

from ..quant import quantize_activation, reference_gemm

name = "reference"


def gemm(a, a_scale, w, w_scale, bias, out):
    reference_gemm(a, a_scale, w, w_scale, bias=bias, out=out)


def linear(x, w, w_scale, bias, out):
    xq, xs = quantize_activation(x)
    reference_gemm(xq, xs, w, w_scale, bias=bias, out=out)
