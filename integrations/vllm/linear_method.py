"""The linear method for block-FP8 checkpoints: load, shard, check once, warm up, run
``fp8linear.fp8_linear``."""
from __future__ import annotations


import torch

from fp8linear import fp8_linear, knobs
from fp8linear.ops import check_weight
from fp8linear.quant import BLOCK, FP8_DTYPE, cdiv, check_scale_values as check_values

from . import compat
from .sharding import ShardPlan, expand_block_rows, plan_shard, reblock_k_shard

# Token counts the GEMM runs once per layer shape at load: the decode (small M) and the
# prefill (large M) kernel paths, so JIT builds and first-launch setup happen while weights
# load, never in the middle of a request.
WARMUP_TOKENS = (1, 16, 64, 512)
_warmed: set = set()

# Tests set FP8LINEAR_VLLM_COUNT_CALLS=1 to count apply() calls per layer (eager mode only:
# under torch.compile the Python body runs at trace time).
COUNT_CALLS = knobs.get(knobs.VLLM_COUNT_CALLS) == "1"


def warm_up(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Run the GEMM once per warm-up size on the layer's device (CUDA only)."""
    if weight.device.type != "cuda":
        return
    n, k = weight.shape
    key = (weight.device.index, n, k, tuple(scale.shape) == (n, cdiv(k, BLOCK)), dtype)
    if key in _warmed:
        return
    with torch.no_grad():
        for m in WARMUP_TOKENS:
            fp8_linear(torch.zeros(m, k, dtype=dtype, device=weight.device), weight, scale)
    torch.cuda.synchronize(weight.device)
    _warmed.add(key)


def set_plain_parameter(layer: torch.nn.Module, name: str, data: torch.Tensor) -> None:
    """Replace a vLLM parameter by a plain frozen Parameter (what torch.compile and CUDA
    graphs see); the loader-specific subclass has done its job."""
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, torch.nn.Parameter(data.contiguous(), requires_grad=False))


def check_scale_values(layer, scale: torch.Tensor, scale_name: str) -> None:
    """The one data check (finite, positive scales), run once per layer at load. Scales start as
    NaN, so a scale the checkpoint did not provide fails here too."""
    try:
        check_values(scale, f"{layer_name(layer)}.{scale_name}")
    except ValueError as e:
        raise ValueError(f"{e} (a scale missing from the checkpoint shows up as NaN too)") \
            from None


def set_layer_geometry(layer, output_partition_sizes, input_size_per_partition,
                       params_dtype) -> tuple[int, int]:
    """The per-rank sizes and block size vLLM's linear layers expect; returns (N, K)."""
    n, k = sum(output_partition_sizes), input_size_per_partition
    layer.logical_widths = list(output_partition_sizes)
    layer.input_size_per_partition = k
    layer.output_size_per_partition = n
    layer.orig_dtype = params_dtype
    layer.weight_block_size = [BLOCK, BLOCK]
    return n, k


def layer_name(layer) -> str:
    """The layer's name in the model (vLLM's prefix), for error messages."""
    return getattr(layer, "prefix", "") or type(layer).__name__


class Fp8BlockGemmLinearMethod(compat.LinearMethodBase):
    """Block-FP8 checkpoint weights (``weight`` fp8 [N, K] + 128x128 block scales) run by
    fp8linear's kernels. Scale layout per rank: see ``sharding``."""

    def __init__(self, scale_name: str = "weight_scale_inv", count_calls: bool = COUNT_CALLS):
        self.scale_name = scale_name
        self.plan: ShardPlan | None = None
        self.count_calls = count_calls
        self.calls = 0

    # ------------------------------------------------------------------ construction
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra_weight_attrs):
        weight_loader = extra_weight_attrs.get("weight_loader")
        prefix = getattr(layer, "prefix", "")
        n, k = set_layer_geometry(layer, output_partition_sizes, input_size_per_partition,
                                  params_dtype)

        split, known = compat.layer_split(layer, weight_loader)
        tp_size = getattr(layer, "tp_size", 1)
        full_sizes = list(getattr(layer, "output_sizes", None) or [output_size])
        self.plan = plan_shard(split, output_partition_sizes, k, tp_size, known, prefix,
                               full_output_sizes=full_sizes, input_size=input_size)

        layer.register_parameter("weight", compat.ModelWeightParameter(
            data=torch.empty(n, k, dtype=FP8_DTYPE), input_dim=1, output_dim=0,
            weight_loader=weight_loader))
        kb = cdiv(k, BLOCK)
        if self.plan.row_scales:
            # per-row scales: the checkpoint's block scales are expanded to one row per
            # weight row before vLLM slices them like the weight
            scale = compat.ChannelQuantScaleParameter(
                data=torch.full((n, kb), float("nan"), dtype=torch.float32), output_dim=0,
                weight_loader=_row_expanding_loader(layer, weight_loader, self.scale_name))
        elif self.plan.reblock_k:
            # the whole layer's scales, unsliced: process_weights_after_loading picks the
            # columns of this rank's K slice
            kb_full = cdiv(input_size, BLOCK)
            scale = compat.BasevLLMParameter(
                data=torch.full((cdiv(n, BLOCK), kb_full), float("nan"), dtype=torch.float32),
                weight_loader=weight_loader)
        else:
            scale = compat.BlockQuantScaleParameter(
                data=torch.full((cdiv(n, BLOCK), kb), float("nan"), dtype=torch.float32),
                input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter(self.scale_name, scale)

    # ------------------------------------------------------------------ after loading
    def process_weights_after_loading(self, layer) -> None:
        # vLLM's own flag: its loader may call this twice, its weight-reload path clears it
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight = layer.weight.data
        scale = getattr(layer, self.scale_name).data
        check_scale_values(layer, scale, self.scale_name)
        if self.plan.reblock_k:
            origin = getattr(layer, "tp_rank", 0) * layer.input_size_per_partition
            weight, scale = reblock_k_shard(weight, scale, origin,
                                            name=f"{layer_name(layer)}.weight")
        check_weight(weight, scale, name=f"{layer_name(layer)}.weight")
        set_plain_parameter(layer, "weight", weight)
        set_plain_parameter(layer, self.scale_name, scale)
        warm_up(layer.weight, getattr(layer, self.scale_name), layer.orig_dtype)
        layer._already_called_process_weights_after_loading = True

    # ------------------------------------------------------------------ forward
    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.count_calls and not torch.compiler.is_compiling():
            self.calls += 1
        return fp8_linear(x, layer.weight, getattr(layer, self.scale_name), bias)


def _logical_rows(layer, shard_id) -> int:
    """Rows of the checkpoint tensor that a loader call for ``shard_id`` receives."""
    if hasattr(layer, "total_num_kv_heads"):          # QKVParallelLinear
        q = layer.total_num_heads * layer.head_size
        kv = layer.total_num_kv_heads * layer.head_size
        v = layer.total_num_kv_heads * getattr(layer, "v_head_size", layer.head_size)
        return {"q": q, "k": kv, "v": v, None: q + kv + v}[shard_id]
    sizes = getattr(layer, "output_sizes", None)
    if sizes is None:
        return layer.output_size
    if shard_id is None:
        return sum(sizes)
    if isinstance(shard_id, tuple):
        return sum(sizes[i] for i in shard_id)
    return sizes[shard_id]


def _row_expanding_loader(layer, weight_loader, scale_name):
    """Wraps the layer's v2 loader: expand the checkpoint's block scales to per-row
    scales, then let vLLM slice them exactly as it slices the weight's rows."""
    def load_row_scales(param, loaded_weight, *args, **kwargs):
        shard_id = args[0] if args else kwargs.get("loaded_shard_id")
        name = f"{layer_name(layer)}.{scale_name}"
        if shard_id is not None:
            name += f" (shard {shard_id!r})"
        rows = expand_block_rows(loaded_weight, _logical_rows(layer, shard_id), name)
        return weight_loader(param, rows, *args, **kwargs)
    return load_row_scales
