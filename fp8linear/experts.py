"""FP8Experts: the experts of a transformers mixture-of-experts layer in block FP8, run by
``fp8linear.fused_moe``.

transformers (>= 5) holds a layer's experts as two stacks, ``gate_up_proj`` [E, 2I, H] (gate
rows first) and ``down_proj`` [E, H, I], called as ``experts(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` (Qwen3-MoE, Mixtral, DeepSeek-V3,
...). FP8Experts keeps those stacks in float8_e4m3fn with fp32 scales per 128x128 block of
each projection, and its state_dict is the per-expert layout of Hugging Face and vLLM
checkpoints (``<j>.gate_proj.weight`` / ``.weight_scale_inv``, ``<j>.up_proj.*``,
``<j>.down_proj.*``, or the names the model's checkpoints use: Mixtral's w1 / w3 / w2): views
of the stacks, so checkpoints load and save expert by expert.
"""
from __future__ import annotations

import functools
import re
from typing import Optional

import torch
from torch import nn

from .fixed_dtypes import FixedDtypes
from .moe import fused_moe
from .quant import (BLOCK, FP8_DTYPE, SCALE_LOAD_DTYPES, cdiv, check_scale_values,
                    quantize_weight)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's gate, up, down on disk


@functools.lru_cache(maxsize=None)
def checkpoint_names(model_type: Optional[str]) -> tuple[str, str, str]:
    """The names a ``model_type``'s checkpoints give an expert's gate, up and down
    projections, as transformers' own loading maps them into its fused stacks (Mixtral-style
    models: w1, w3, w2); PROJECTIONS where transformers names none."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        rules = get_checkpoint_conversion_mapping(model_type) or []
    except Exception:  # (no transformers, or another version's internals: the common names)
        return PROJECTIONS
    found = {}
    for rule in rules:
        targets, sources = (getattr(rule, a, None) or [] for a in ("target_patterns",
                                                                    "source_patterns"))
        targets, sources = ([t] if isinstance(t, str) else list(t) for t in (targets, sources))
        names = [m.group(1) for m in (re.search(r"experts\.\*\.(\w+)\.weight$", p)
                                      for p in sources) if m]
        for stack, want in (("gate_up_proj", 2), ("down_proj", 1)):
            if any(t.endswith(f"experts.{stack}") for t in targets) and len(names) == want:
                found[stack] = names
    if set(found) != {"gate_up_proj", "down_proj"}:
        return PROJECTIONS
    return (*found["gate_up_proj"], *found["down_proj"])


def layer_names(experts: nn.Module) -> tuple[str, str, str]:
    """``checkpoint_names`` of a transformers experts layer's model type."""
    return checkpoint_names(getattr(getattr(experts, "config", None), "model_type", None))


def fused_experts_problem(module: nn.Module) -> Optional[str]:
    """None when ``module`` is a transformers fused-experts layer FP8Experts can take; else
    why not ("" for a module that is no fused-experts layer at all)."""
    gate_up, down = (getattr(module, n, None) for n in ("gate_up_proj", "down_proj"))
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3) or isinstance(module, FP8Experts):
        return ""
    e, two_i, h = gate_up.shape
    if (getattr(module, "has_bias", False) or getattr(module, "is_transposed", False)
            or not getattr(module, "is_concatenated", True)
            or not getattr(module, "has_gate", True)):
        return "biases, transposed or interleaved stacks, or no gate"
    if tuple(down.shape) != (e, h, two_i // 2) or two_i % 2:
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are "
                f"not [E, 2I, H] and [E, H, I]")
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    # (a class's own _apply_gate changes the gating, e.g. a clamped SwiGLU)
    apply_gate = getattr(type(module), "_apply_gate", None)
    if not silu or (apply_gate is not None and apply_gate.__name__ != "_default_apply_gate"):
        return f"activation {type(act).__name__} (ours: SiLU(gate) * up)"
    if (two_i // 2) % BLOCK:
        return (f"expert intermediate size {two_i // 2} is not a multiple of {BLOCK} (gate and "
                f"up must split on the block grid)")
    return None


class FP8Experts(FixedDtypes):
    """A layer's E experts, y = sum_j w_j * down(SiLU(gate(x)) * up(x)), in block FP8.

    Parameters: ``gate_up_proj`` float8_e4m3fn [E, 2I, H] with ``gate_up_proj_scale_inv``
    fp32 [E, 2I/128, ceil(H/128)], ``down_proj`` [E, H, I] with ``down_proj_scale_inv``
    [E, ceil(H/128), I/128] (I a multiple of 128: gate and up are blocks of their own).
    ``names``: the checkpoint's names of an expert's gate, up and down projections.
    """

    FIXED_DTYPES = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 names: tuple = PROJECTIONS, device=None):
        super().__init__()
        if intermediate % BLOCK:
            raise ValueError(f"FP8Experts: the expert intermediate size must be a multiple of "
                             f"{BLOCK}, got {intermediate}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.names = tuple(names)
        e, h, i = num_experts, hidden, intermediate

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),
                                requires_grad=False)
        self.gate_up_proj = param(e, 2 * i, h, dtype=FP8_DTYPE)
        self.gate_up_proj_scale_inv = param(e, 2 * i // BLOCK, cdiv(h, BLOCK),
                                            dtype=torch.float32)
        self.down_proj = param(e, h, i, dtype=FP8_DTYPE)
        self.down_proj_scale_inv = param(e, cdiv(h, BLOCK), i // BLOCK, dtype=torch.float32)

    @classmethod
    def from_experts(cls, experts: nn.Module, ue8m0: bool = False,
                     names: Optional[tuple] = None) -> "FP8Experts":
        """Quantized from a transformers fused-experts layer, each projection of each expert
        as ``quantize_weight`` quantizes a 2-D weight (what ``fp8linear quantize`` writes
        for the per-expert checkpoint); on the meta device, the shapes only. ``names``:
        default, those of the layer's model type (``checkpoint_names``)."""
        problem = fused_experts_problem(experts)
        if problem is not None:
            raise ValueError(f"FP8Experts.from_experts takes a transformers fused-experts "
                             f"layer, got a {type(experts).__name__}: "
                             + (problem or "no 3-D gate_up_proj and down_proj"))
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        e, two_i, h = gate_up.shape
        mod = cls(e, h, two_i // 2, names or layer_names(experts), device=gate_up.device)
        if gate_up.device.type != "meta":
            for j in range(e):  # (one expert at a time: bounded memory)
                for (w, s), src in zip(mod.views(j), (gate_up[j, :two_i // 2],
                                                      gate_up[j, two_i // 2:], down[j])):
                    q, scale = quantize_weight(src, ue8m0=ue8m0)
                    w.data.copy_(q)
                    s.data.copy_(scale)
        return mod

    def views(self, j: int):
        """(weight, scale) views of expert ``j``'s gate, up and down projections."""
        i, ib = self.intermediate, self.intermediate // BLOCK
        gu, gus = self.gate_up_proj[j], self.gate_up_proj_scale_inv[j]
        return ((gu[:i], gus[:ib]), (gu[i:], gus[ib:]),
                (self.down_proj[j], self.down_proj_scale_inv[j]))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.hidden)
        out = fused_moe(x.contiguous(), self.gate_up_proj, self.gate_up_proj_scale_inv,
                        self.down_proj, self.down_proj_scale_inv,
                        top_k_weights.reshape(x.shape[0], -1).float().contiguous(),
                        top_k_index.reshape(x.shape[0], -1).contiguous())
        return out.reshape(hidden_states.shape)

    def validate(self, name: str = "") -> None:
        """The one data check (finite, positive scales), at load time."""
        prefix = f"{name}." if name else ""
        for key in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
            check_scale_values(getattr(self, key), prefix + key)

    def scales(self) -> tuple:
        return self.gate_up_proj_scale_inv, self.down_proj_scale_inv

    def state_items(self):
        """(state_dict key, view of the stacks) of every expert's weights and scales."""
        for j in range(self.num_experts):
            for proj, (w, s) in zip(self.names, self.views(j)):
                yield f"{j}.{proj}.weight", w
                yield f"{j}.{proj}.weight_scale_inv", s

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, t in self.state_items():
            destination[prefix + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # every incoming tensor checked before any is copied (a failed load changes nothing)
        ours = dict(self.state_items())
        checked, errors = [], []
        for key, target in ours.items():
            t = state_dict.get(prefix + key)
            if t is None:
                missing_keys.append(prefix + key)
                continue
            scale = key.endswith("weight_scale_inv")
            dtypes = SCALE_LOAD_DTYPES if scale else (FP8_DTYPE,)
            if t.dtype not in dtypes or tuple(t.shape) != tuple(target.shape):
                errors.append(f"{prefix + key}: expected {dtypes[0]} of shape "
                              f"{tuple(target.shape)}, got {t.dtype} {tuple(t.shape)}")
                continue
            if scale:
                try:
                    check_scale_values(t, prefix + key)
                except ValueError as e:
                    errors.append(str(e))
                    continue
            checked.append((target, t))
        if strict:
            unexpected_keys.extend(k for k in state_dict
                                   if k.startswith(prefix) and k[len(prefix):] not in ours)
        if errors:
            error_msgs.extend(errors)
            return
        with torch.no_grad():
            for target, t in checked:
                target.copy_(t)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, names={self.names}, weight=float8_e4m3fn, "
                f"block={BLOCK}x{BLOCK}")
