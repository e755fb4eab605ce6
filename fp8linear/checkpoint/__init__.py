"""Block-FP8 safetensors checkpoints in the DeepSeek-V3 / Qwen3-FP8 layout.

- ``format``: names, ``quantization_config``, ``tensor_role`` (which tensors are linear
  weights);
- ``io``: safetensors headers, the shard index, ``save_fp8_checkpoint`` /
  ``load_fp8_checkpoint``;
- ``convert``: ``quantize_checkpoint``, the converter behind ``fp8linear quantize``;
- ``info``: ``checkpoint_info`` / ``format_checkpoint_info`` for ``fp8linear info``;
- ``hf``: ``from_pretrained``, a block-FP8 checkpoint into a transformers model.
- ``hf_names``: the names transformers renames between a model and its checkpoints.
"""
from .format import (CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, INDEX_NAME, SCALE_SUFFIX,
                     SINGLE_NAME, CheckpointError, CheckpointWarning, TensorEntry,
                     quantization_config, tensor_role)
from .io import (CheckpointDir, load_fp8_checkpoint, read_safetensors_header,
                 save_fp8_checkpoint)
from .convert import QuantizeReport, quantize_checkpoint, validate_quantized_checkpoint
from .info import checkpoint_info, format_checkpoint_info
from .hf import from_pretrained

__all__ = [
    "CONFIG_NAME", "DEFAULT_MAX_SHARD_BYTES", "INDEX_NAME", "SCALE_SUFFIX", "SINGLE_NAME",
    "CheckpointError", "CheckpointWarning", "TensorEntry", "quantization_config", "tensor_role",
    "CheckpointDir",
    "load_fp8_checkpoint", "read_safetensors_header", "save_fp8_checkpoint", "QuantizeReport",
    "quantize_checkpoint", "validate_quantized_checkpoint", "checkpoint_info",
    "format_checkpoint_info", "from_pretrained",
]
