"""The block-FP8 checkpoint format: file and tensor names, ``quantization_config``, and
which tensors of a Hugging Face checkpoint are linear-layer weights (``tensor_role``).

On disk: ``<name>.weight`` float8_e4m3fn [N, K] + ``<name>.weight_scale_inv`` fp32
[ceil(N/128), ceil(K/128)] for every quantized linear layer, everything else as it was;
shards listed in ``model.safetensors.index.json``; ``config.json`` carries
``quantization_config``, which vLLM and transformers read.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..quant import BLOCK

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size ("5GB")

# safetensors dtype strings -> (torch dtype, bytes per element)
_ST_DTYPES = {
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
    "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "F32": (torch.float32, 4),
    "F64": (torch.float64, 8), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
    "I16": (torch.int16, 2), "I32": (torch.int32, 4), "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1),
}
_FLOAT_SOURCE = ("BF16", "F16", "F32")  # what quantize_checkpoint converts


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read, written or matched to a model."""


class CheckpointWarning(UserWarning):
    """Something about a checkpoint that works but is probably not what was meant."""


def quantization_config(ue8m0: bool = False, ignored_layers: Iterable[str] = ()) -> dict:
    """The ``config.json`` entry DeepSeek-V3 and Qwen3-FP8 checkpoints carry.

    ``scale_fmt: ue8m0`` marks power-of-two scales (DeepSeek-V3.1). ``ignored_layers`` (read
    by vLLM's fp8 config) lists linear layers deliberately left in high precision.
    """
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [BLOCK, BLOCK]}
    if ue8m0:
        cfg["scale_fmt"] = "ue8m0"
    ignored = sorted(set(ignored_layers))
    if ignored:
        cfg["ignored_layers"] = ignored
    return cfg


@dataclass
class TensorEntry:
    name: str
    file: Path
    dtype: str          # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ST_DTYPES.get(self.dtype, (None, 0))[1]

    @property
    def torch_dtype(self):
        return _ST_DTYPES.get(self.dtype, (None, 0))[0]


_ROUTER_NAMES = ("gate", "router", "routing", "gating")


def _pattern_match(name: str, patterns: Iterable[str]) -> Optional[str]:
    """Same rule as quantize_model's skip: a plain substring or an fnmatch pattern, tested on
    the tensor name and its module name."""
    module = name[:-len(".weight")] if name.endswith(".weight") else name
    for p in patterns:
        if p in name or fnmatch.fnmatch(name, p) or fnmatch.fnmatch(module, p):
            return p
    return None


def _text_config_value(config: dict, *keys):
    """A key from config.json or, for multimodal models, from its text_config."""
    for cfg in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        for k in keys:
            if isinstance(cfg, dict) and cfg.get(k) is not None:
                return cfg[k]
    return None


def tensor_role(name: str, shape, dtype: str, config: Optional[dict] = None,
                skip: Iterable[str] = ()) -> tuple[bool, str]:
    """(quantize?, reason) for one checkpoint tensor, for any architecture.

    Quantized: 2-D bf16/fp16/fp32 ``*.weight`` matrices of linear layers (attention, MLP,
    MoE experts and shared experts). Kept: anything not 2-D (norms, biases, conv kernels,
    fused 3-D expert stacks), non-``.weight`` tensors, embeddings, the output head
    (``lm_head``, any vocabulary-sized matrix, tied output embeddings), MoE routers (kept in
    high precision, as the DeepSeek-V3 and Qwen3 FP8 checkpoints keep them) and ``skip``
    matches.
    """
    config = config or {}
    parts = name.split(".")
    module_parts = parts[:-1]
    if dtype in ("F8_E4M3", "F8_E5M2"):
        raise CheckpointError(f"tensor '{name}' is already {dtype}: the input checkpoint "
                              f"is quantized")
    if dtype not in _FLOAT_SOURCE:
        return False, f"{dtype} (not bf16/fp16/fp32)"
    if len(shape) != 2:
        return False, f"{len(shape)}-D (only 2-D linear weights are quantized)"
    if parts[-1] != "weight":
        return False, "not a .weight tensor"
    pat = _pattern_match(name, skip)
    if pat is not None:
        return False, f"matches --skip {pat!r}"
    lowered = [p.lower() for p in module_parts]
    if any("embed" in p or p in ("wte", "wpe", "shared") for p in lowered):
        return False, "embedding"
    if any(p == "lm_head" for p in lowered) or name == "output.weight":
        tied = " (tied to the input embeddings)" if _text_config_value(
            config, "tie_word_embeddings") else ""
        return False, f"output head{tied}"
    if any("norm" in p or p.startswith("ln") for p in lowered):
        return False, "normalization"
    # Heads and embeddings live outside the repeated blocks: a vocabulary-sized matrix with
    # no layer index in its name is one of them (an MLP whose width happens to equal the
    # vocabulary, inside layer i, is not).
    vocab = _text_config_value(config, "vocab_size")
    if vocab and int(shape[0]) == int(vocab) and not any(p.isdigit() for p in module_parts):
        return False, "vocabulary-sized matrix outside the layers (embedding or output head)"
    if module_parts and (lowered[-1] in _ROUTER_NAMES or "router" in lowered[-1]):
        return False, "MoE router"
    return True, "linear weight"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else str(n)
