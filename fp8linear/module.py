"""FP8Linear, the nn.Module, and quantize_model, which swaps nn.Linear layers for it."""
from __future__ import annotations

import fnmatch
from typing import Iterable

import torch
from torch import nn

from .ops import check_weight, check_weight_scale_values, fp8_linear
from .quant import BLOCK, FP8_DTYPE, cdiv, check_block_size, dequantize_weight, quantize_weight


class FP8Linear(nn.Module):
    """y = x @ W^T + b with W stored as block-scaled float8_e4m3fn (128x128 blocks).

    Parameters (state_dict names match DeepSeek-V3 / Qwen3-FP8 checkpoints):
      weight            float8_e4m3fn [out_features, in_features]
      weight_scale_inv  fp32 [ceil(out/128), ceil(in/128)] (a dequant multiplier)
      bias              optional, in ``dtype``
    ``dtype`` is the bias dtype (the output follows the input's dtype).
    """

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

    def _apply(self, fn, recurse=True):
        # torch counts float8 as floating point, so model.to(dtype) / .half() would cast the
        # fp8 weight and round its fp32 scales: keep both dtypes, follow only device moves.
        kept = {"weight": self.weight.data, "weight_scale_inv": self.weight_scale_inv.data}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            p = getattr(self, name)
            if p.dtype != old.dtype:
                p.data = old.to(device=p.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale_inv, dtype)

    def validate(self, name: str = "") -> None:
        """Shape/dtype checks plus the one data check (finite scales). Runs at load time."""
        prefix = f"{name}." if name else ""
        check_weight(self.weight, self.weight_scale_inv, name=f"{prefix}weight")
        check_weight_scale_values(self.weight_scale_inv, f"{prefix}weight_scale_inv")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=float8_e4m3fn, "
                f"block={self.block_size}x{self.block_size}")

    def _check_loaded(self, state_dict, prefix, *args):
        # Clear messages for the common mistakes, before torch's generic copy errors.
        self._load_name = prefix[:-1]  # for the post-load check's messages ("layers.0.mlp")
        key = prefix + "weight"
        if key in state_dict and state_dict[key].dtype != FP8_DTYPE:
            raise ValueError(f"{key}: expected float8_e4m3fn, got {state_dict[key].dtype} "
                             f"(quantize it first: FP8Linear.from_linear / quantize_weight)")
        skey = prefix + "weight_scale_inv"
        want = tuple(self.weight_scale_inv.shape)
        if skey in state_dict and tuple(state_dict[skey].shape) != want:
            got = tuple(state_dict[skey].shape)
            if got == (self.out_features, want[1]):
                # per-row scales (tensor-parallel shards not aligned to 128): accepted as is
                self.weight_scale_inv.data = torch.empty(
                    got, dtype=torch.float32, device=self.weight_scale_inv.device)
            else:
                raise ValueError(f"{skey}: expected shape {want} (128x128 blocks) or "
                                 f"{(self.out_features, want[1])} (per row), got {got}")


def _validate_after_load(module: FP8Linear, incompatible_keys) -> None:
    module.validate(getattr(module, "_load_name", ""))


def quantize_model(model: nn.Module, skip: Iterable[str] = ("lm_head",), ue8m0: bool = False,
                   min_features: int = 0) -> nn.Module:
    """Replace every nn.Linear in ``model`` (in place) by an FP8Linear.

    ``skip``: fnmatch patterns or plain substrings of module names left in high precision
    (default: the lm_head, whose logits are the most precision-sensitive layer).
    ``min_features``: layers with in or out features below this stay unquantized.
    """
    skip = tuple(skip)

    def skipped(name: str) -> bool:
        return any(p in name or fnmatch.fnmatch(name, p) for p in skip)

    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not skipped(n)
               and min(m.in_features, m.out_features) >= min_features]
    for name, lin in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, FP8Linear.from_linear(lin, ue8m0=ue8m0))
    return model


def fp8_modules(model: nn.Module):
    """(name, FP8Linear) pairs of a model."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear)]
