"""The linear method for bf16/fp16 checkpoints: quantize each layer to block FP8 as soon
as its last weight shard has loaded.

Peak device memory stays near the FP8 model plus one layer: the weight is created on the
meta device (no storage), vLLM's layerwise loading (``compat.initialize_online_processing``)
buffers the checkpoint slices on the host until the layer is complete, then materializes
the layer, copies them in and calls ``process_weights_after_loading``, which quantizes in
128-row slabs and drops the high-precision weight before the next layer materializes.

Each rank quantizes its own slice on a 128 grid starting at the slice's origin, so any
tensor-parallel split works and nothing is re-blocked.
"""
from __future__ import annotations

import torch

from fp8linear import quantize_weight
from fp8linear.quant import BLOCK, FP8_DTYPE, cdiv

from . import compat
from .linear_method import (COUNT_CALLS, Fp8BlockGemmLinearMethod, layer_name,
                            set_layer_geometry, set_plain_parameter, warm_up)

# fp32 working set of one quantization step: rows per slab chosen so that a slab's float
# copies stay near this many elements (a multiple of 128 rows keeps blocks whole).
_SLAB_ELEMS = 4 * 2**20


def quantize_in_slabs(w: torch.Tensor):
    """quantize_weight over 128-row slabs (identical result, bounded fp32 temporaries)."""
    n, k = w.shape
    rows = max(BLOCK, (_SLAB_ELEMS // max(k, 1)) // BLOCK * BLOCK)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(cdiv(n, BLOCK), cdiv(k, BLOCK), dtype=torch.float32, device=w.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        q[r0:r1], s[r0 // BLOCK:cdiv(r1, BLOCK)] = quantize_weight(w[r0:r1])
    return q, s


class Fp8BlockGemmOnlineLinearMethod(Fp8BlockGemmLinearMethod):
    """bf16/fp16 weights in, block FP8 (weight + weight_scale_inv) out, at load time."""

    # vLLM checks this flag to run its layerwise loading for the model
    uses_meta_device = True

    def __init__(self, count_calls: bool = COUNT_CALLS):
        super().__init__("weight_scale_inv", count_calls)

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra_weight_attrs):
        n, k = set_layer_geometry(layer, output_partition_sizes, input_size_per_partition,
                                  params_dtype)
        layer.register_parameter("weight", compat.ModelWeightParameter(
            data=torch.empty(n, k, dtype=params_dtype, device="meta"), input_dim=1,
            output_dim=0, weight_loader=extra_weight_attrs.get("weight_loader")))
        compat.initialize_online_processing(layer)

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight = layer.weight
        prefix = layer_name(layer)
        if weight.is_meta:
            raise ValueError(f"fp8_blockgemm: layer '{prefix}': the checkpoint provided no "
                             f"weight for it (still on the meta device after loading)")
        try:
            q, s = quantize_in_slabs(weight.data)
        except ValueError as e:
            raise ValueError(f"fp8_blockgemm: layer '{prefix}': {e}") from None
        del weight
        set_plain_parameter(layer, "weight", q)   # drops the high-precision weight
        set_plain_parameter(layer, "weight_scale_inv", s)
        warm_up(layer.weight, layer.weight_scale_inv, layer.orig_dtype)
        layer._already_called_process_weights_after_loading = True
