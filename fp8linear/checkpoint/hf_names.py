"""Tensor names between a transformers model and its checkpoints.

transformers (>= 5) renames some checkpoint names while it loads a model (Mixtral's
``block_sparse_moe`` becomes ``mlp``) and renames them back while it saves one. fp8linear's
load and save do the same, by transformers' own rules, so that a checkpoint ``fp8linear
quantize`` wrote loads into the model and one ``save_fp8_checkpoint`` writes has the names
vLLM and transformers read. Only renamings: transformers' conversions of the fused experts
(per-expert tensors into stacks) are FP8Experts' own business (its per-expert state_dict).
For any other module, or without transformers, names stay as they are.
"""
from __future__ import annotations

from typing import Callable

from torch import nn


def _identity(name: str) -> str:
    return name


def _renamings(model: nn.Module, saving: bool) -> list:
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming
    except Exception:  # (no transformers, or one without these rules: names as they are)
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    rules = get_model_conversion_mapping(model, add_legacy=not saving) or []
    # (a model built from its config: no prefix to restore, as transformers' own save does)
    rules = [r for r in rules if isinstance(r, WeightRenaming) and not isinstance(r, PrefixChange)]
    return [r.reverse_transform() for r in rules[::-1]] if saving else rules


def _chain(rules: list) -> Callable[[str], str]:
    if not rules:
        return _identity

    def rename(name: str) -> str:
        for rule in rules:
            name = rule.rename_source_key(name)[0]
        return name
    return rename


def to_model(model: nn.Module) -> Callable[[str], str]:
    """A checkpoint tensor's name -> ``model``'s state name."""
    return _chain(_renamings(model, saving=False))


def to_checkpoint(model: nn.Module) -> Callable[[str], str]:
    """``model``'s state name -> the name a checkpoint gives that tensor."""
    return _chain(_renamings(model, saving=True))
