"""FP8Linear, the nn.Module, and quantize_model, which swaps nn.Linear layers for it (and a
transformers MoE layer's fused experts for FP8Experts)."""
from __future__ import annotations

import fnmatch
import warnings
from typing import Iterable

import torch
from torch import nn

from .experts import FP8Experts, fused_experts_problem
from .fixed_dtypes import FixedDtypes
from .ops import check_weight, fp8_linear
from .quant import (BLOCK, FP8_DTYPE, SCALE_LOAD_DTYPES, cdiv, check_block_size,
                    check_scale_values, dequantize_weight, quantize_weight, require_values,
                    weight_scale_shapes)


class FP8Linear(FixedDtypes):
    """y = x @ W^T + b with W stored as block-scaled float8_e4m3fn (128x128 blocks).

    Parameters (state_dict names match DeepSeek-V3 / Qwen3-FP8 checkpoints):
      weight            float8_e4m3fn [out_features, in_features]
      weight_scale_inv  fp32 [ceil(out/128), ceil(in/128)] (a dequant multiplier)
      bias              optional, in ``dtype``
    ``dtype`` is the bias dtype (the output follows the input's dtype).
    """

    FIXED_DTYPES = ("weight", "weight_scale_inv")

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None, block_size: int = BLOCK):
        super().__init__()
        check_block_size(block_size)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.block_size = block_size
        # Parameters (not buffers) so that model.to()/parameters() treat them like nn.Linear's;
        # never trained.
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(cdiv(out_features, BLOCK), cdiv(in_features, BLOCK),
                       dtype=torch.float32, device=device), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_features, dtype=dtype or torch.bfloat16, device=device),
                requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._register_load_state_dict_pre_hook(self._check_loaded, with_module=False)
        self.register_load_state_dict_post_hook(_validate_after_load)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ue8m0: bool = False) -> "FP8Linear":
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device=w.device, dtype=w.dtype)
        q, s = quantize_weight(w, ue8m0=ue8m0)
        mod.weight.data = q
        mod.weight_scale_inv.data = s
        if linear.bias is not None:
            mod.bias.data = linear.bias.detach().to(mod.bias.dtype).clone()
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale_inv, dtype)

    def scales(self) -> tuple:
        return (self.weight_scale_inv,)

    def validate(self, name: str = "") -> None:
        """Shape/dtype checks plus the one data check (finite, positive scales). Runs at load
        time, never per forward call."""
        prefix = f"{name}." if name else ""
        check_weight(self.weight, self.weight_scale_inv, name=f"{prefix}weight")
        check_scale_values(self.weight_scale_inv, f"{prefix}weight_scale_inv")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=float8_e4m3fn, "
                f"block={self.block_size}x{self.block_size}")

    def _check_loaded(self, state_dict, prefix, *args):
        # Everything this layer will take from state_dict is checked before any of it is
        # copied, so a failed load leaves the layer exactly as it was.
        self._load_name = prefix[:-1]  # for the post-load check's messages ("layers.0.mlp")
        n, k = self.out_features, self.in_features
        key, skey, bkey = prefix + "weight", prefix + "weight_scale_inv", prefix + "bias"
        w = state_dict.get(key)
        if w is not None:
            if w.dtype != FP8_DTYPE:
                raise ValueError(f"{key}: expected float8_e4m3fn, got {w.dtype} (quantize it "
                                 f"first: FP8Linear.from_linear / quantize_weight)")
            if tuple(w.shape) != (n, k):
                raise ValueError(f"{key}: expected shape {(n, k)}, got {tuple(w.shape)}")
        s = state_dict.get(skey)
        if s is not None:
            blocks, rows = weight_scale_shapes(n, k)
            if tuple(s.shape) not in (blocks, rows):
                raise ValueError(f"{skey}: expected shape {blocks} (128x128 blocks) or "
                                 f"{rows} (per row), got {tuple(s.shape)}")
            if s.dtype not in SCALE_LOAD_DTYPES:
                raise ValueError(f"{skey}: expected float32 (or bfloat16/float16), got "
                                 f"{s.dtype}")
            check_scale_values(s, skey)
        b = state_dict.get(bkey)
        if b is not None and self.bias is not None and tuple(b.shape) != (n,):
            raise ValueError(f"{bkey}: expected shape {(n,)}, got {tuple(b.shape)}")
        if s is not None and tuple(s.shape) != tuple(self.weight_scale_inv.shape):
            # block <-> per-row scales (tensor-parallel shards not aligned to 128): take the
            # incoming layout; torch copies the values next
            self.weight_scale_inv.data = torch.empty(
                tuple(s.shape), dtype=torch.float32, device=self.weight_scale_inv.device)


def _validate_after_load(module: FP8Linear, incompatible_keys) -> None:
    # metadata only: the values were checked before the copy (_check_loaded)
    name = getattr(module, "_load_name", "")
    check_weight(module.weight, module.weight_scale_inv,
                 name=f"{name}.weight" if name else "weight")


def quantize_model(model: nn.Module, skip: Iterable[str] | str = ("lm_head",),
                   ue8m0: bool = False, min_features: int = 0) -> nn.Module:
    """Replace every nn.Linear inside ``model`` (in place) by an FP8Linear, and the fused
    experts of transformers MoE layers (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
    by FP8Experts; returns ``model``.

    ``skip``: fnmatch patterns or plain substrings of module names left in high precision
    (default: the lm_head, whose logits are the most precision-sensitive layer); a string is
    one pattern. ``min_features``: layers with in or out features below this stay
    unquantized. Layers on the meta device become empty FP8 layers on the meta device, to be
    filled by ``load_fp8_checkpoint``. Experts FP8Experts does not take (biases, another
    activation than SiLU, an intermediate size off the 128 grid) stay, with a warning naming
    them. ``model`` itself cannot be an nn.Linear (it cannot be replaced in place): use
    ``FP8Linear.from_linear`` for a single layer.
    """
    if isinstance(model, nn.Linear):
        raise TypeError("quantize_model(nn.Linear) cannot replace the layer in place: use "
                        "FP8Linear.from_linear(linear) for a single layer")
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model expects an nn.Module, got {type(model).__name__}")
    skip = (skip,) if isinstance(skip, str) else tuple(skip)

    def skipped(name: str) -> bool:
        return any(p in name or fnmatch.fnmatch(name, p) for p in skip)

    targets = [n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not skipped(n)
               and min(m.in_features, m.out_features) >= min_features]
    experts, kept = [], []
    for n, m in model.named_modules():
        problem = "" if skipped(n) else fused_experts_problem(m)
        if problem is None and min(m.down_proj.shape[1:]) >= min_features:  # (H, I)
            experts.append(n)
        elif problem:
            kept.append(f"'{n}' ({problem})")
    if kept:
        warnings.warn(f"quantize_model: {len(kept)} MoE experts layer(s) stay in high "
                      f"precision, e.g. {kept[0]}", stacklevel=2)
    _require_finite(model, [f"{n}.weight" for n in targets]
                    + [f"{n}.{p}" for n in experts for p in ("gate_up_proj", "down_proj")])
    replace_linears(model, targets, ue8m0)
    return replace_experts(model, experts, ue8m0)


def _require_finite(model: nn.Module, weights: list) -> None:
    """Every weight quantize_model quantizes is finite, checked before any layer is replaced
    (one read of each): a bad one leaves the model as it was."""
    for name in weights:
        w = model.get_parameter(name).detach()
        if w.device.type != "meta":
            require_values(torch.isfinite(w), w, name, "non-finite values", "cannot quantize it")


def replace_linears(model: nn.Module, names: Iterable[str], ue8m0: bool = False) -> nn.Module:
    """Replace the nn.Linear layers named ``names`` (exact module names) by FP8Linear."""
    for name in names:
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"'{name}' is a {type(lin).__name__}, not an nn.Linear")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if lin.weight.device.type == "meta":  # nothing to quantize: the shapes only
            new = FP8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                            device="meta", dtype=lin.weight.dtype)
        else:
            new = FP8Linear.from_linear(lin, ue8m0=ue8m0)
        setattr(parent, attr, new)
    return model


def replace_experts(model: nn.Module, names: Iterable[str], ue8m0: bool = False) -> nn.Module:
    """Replace the transformers fused-experts layers named ``names`` by FP8Experts."""
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, FP8Experts.from_experts(model.get_submodule(name), ue8m0=ue8m0))
    return model


def fp8_modules(model: nn.Module):
    """(name, module) pairs of a model's FP8Linear and FP8Experts layers."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))]
