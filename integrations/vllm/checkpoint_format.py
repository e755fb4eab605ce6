"""Which checkpoints ``--quantization fp8_blockgemm`` serves, read from config.json's
``quantization_config`` (pure Python, no vLLM).

- ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]`` and dynamic activations
  (DeepSeek-V3, Qwen3-FP8, ``fp8linear quantize``); scales named ``weight_scale_inv``;
- ``quant_method: "compressed-tensors"`` (llm-compressor) whose config groups quantize
  weights as 8-bit floats with a 128x128 block strategy; scales named ``weight_scale``;
- no quantization_config at all: a bf16/fp16 checkpoint, quantized while it loads.
Anything else raises ``UnsupportedCheckpointError`` saying what was found and what is served.
"""
from __future__ import annotations

import copy
from typing import Optional

from fp8linear.quant import BLOCK

NAME = "fp8_blockgemm"


class UnsupportedCheckpointError(ValueError):
    pass


class CheckpointFormat:
    """What the plugin needs to know about a block-FP8 checkpoint."""

    def __init__(self, method: str, scale_name: str, ignored=(), targets=None,
                 raw: Optional[dict] = None):
        self.method = method            # "fp8" | "compressed-tensors"
        self.scale_name = scale_name    # the checkpoint's name of the weight scale tensor
        self.ignored = list(ignored)    # layers left unquantized in the checkpoint
        # compressed-tensors target patterns other than the class name "Linear";
        # None: every linear layer not ignored is quantized
        self.targets = None if targets is None else list(targets)
        self.raw = copy.deepcopy(raw or {})  # for vLLM's own config (MoE, KV-cache scales)

    def __repr__(self) -> str:
        return (f"CheckpointFormat({self.method!r}, scale={self.scale_name!r}, "
                f"ignored={self.ignored}, targets={self.targets})")


def _fail(msg: str):
    raise UnsupportedCheckpointError(f"{NAME}: {msg}")


def _block_ok(block) -> bool:
    return (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b == BLOCK for b in block))


def parse_quantization_config(cfg: Optional[dict]) -> Optional[CheckpointFormat]:
    """config.json's quantization_config -> CheckpointFormat (None: not quantized)."""
    if not cfg:
        return None
    if not isinstance(cfg, dict):
        _fail(f"quantization_config must be a dict, got {type(cfg).__name__}")
    method = cfg.get("quant_method")
    if method == "fp8":
        return _parse_fp8(cfg)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    _fail(f"the checkpoint's quantization_config has quant_method {method!r}; this method "
          f"serves block-FP8 checkpoints (quant_method 'fp8' with weight_block_size "
          f"[128, 128], or 'compressed-tensors' with 128x128 block float8 weights) and "
          f"bf16/fp16 checkpoints (quantized while loading)")


def _parse_fp8(cfg: dict) -> CheckpointFormat:
    block = cfg.get("weight_block_size")
    if block is None:
        _fail("the checkpoint is per-tensor FP8 (quant_method 'fp8' without "
              "weight_block_size); fp8_blockgemm serves 128x128 block-scaled FP8 only: "
              "serve this one with --quantization fp8")
    if not _block_ok(block):
        _fail(f"unsupported weight_block_size {block}: the kernels hard-wire 128x128 "
              f"weight blocks (DeepSeek-V3 layout)")
    act = cfg.get("activation_scheme", "dynamic")
    if act != "dynamic":
        _fail(f"unsupported activation_scheme {act!r}: block FP8 quantizes activations "
              f"dynamically (per token, per 128 channels)")
    fmt = cfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        _fail(f"unsupported fmt {fmt!r}: the kernels take float8_e4m3fn weights")
    ignored = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or []
    return CheckpointFormat("fp8", "weight_scale_inv", ignored=ignored, raw=cfg)


def _parse_compressed_tensors(cfg: dict) -> CheckpointFormat:
    fmt = cfg.get("format")
    groups = cfg.get("config_groups") or {}
    if not groups:
        _fail("compressed-tensors checkpoint without config_groups")
    if cfg.get("transform_config"):
        _fail("compressed-tensors transforms (e.g. Hadamard rotations) are not supported")
    targets: list[str] = []
    all_linear = False
    for gname, group in groups.items():
        w = (group or {}).get("weights") or {}
        where = f"compressed-tensors config group {gname!r}"
        gfmt = group.get("format") or fmt
        if gfmt not in (None, "float-quantized"):
            _fail(f"{where}: format {gfmt!r}; expected 'float-quantized' (block FP8 "
                  f"weights stored as float8_e4m3fn)")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            _fail(f"{where}: weights are {w.get('num_bits')}-bit {w.get('type')}; expected "
                  f"8-bit float (FP8 e4m3)")
        if w.get("strategy") != "block":
            _fail(f"{where}: weight strategy {w.get('strategy')!r}; fp8_blockgemm serves "
                  f"the 'block' strategy with block_structure [128, 128] (for channel/tensor "
                  f"strategies use --quantization compressed-tensors)")
        if not _block_ok(w.get("block_structure")):
            _fail(f"{where}: unsupported block_structure {w.get('block_structure')}: the "
                  f"kernels hard-wire 128x128 weight blocks")
        if w.get("symmetric") is False:
            _fail(f"{where}: asymmetric weights (zero points) are not supported")
        if w.get("dynamic"):
            _fail(f"{where}: dynamic weight scales are not supported")
        act = group.get("input_activations")
        if act is not None:
            if act.get("dynamic") is False:
                _fail(f"{where}: static activation scales; block FP8 quantizes activations "
                      f"dynamically (per token, per 128 channels)")
            if act.get("type") not in (None, "float") or act.get("num_bits") not in (None, 8):
                _fail(f"{where}: activations are {act.get('num_bits')}-bit "
                      f"{act.get('type')}; expected dynamic FP8")
            if act.get("strategy") == "group" and act.get("group_size") not in (None, BLOCK):
                _fail(f"{where}: activation group_size {act.get('group_size')}; the kernels "
                      f"quantize activations in groups of 128")
        for t in group.get("targets") or []:
            if t == "Linear":
                all_linear = True
            else:
                targets.append(t)
    return CheckpointFormat("compressed-tensors", "weight_scale",
                            ignored=cfg.get("ignore") or [],
                            targets=None if all_linear else targets, raw=cfg)
