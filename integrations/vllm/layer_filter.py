"""Which linear layers a checkpoint left unquantized (``ignored_layers``,
``modules_to_not_convert``, compressed-tensors ``ignore``/``targets``). Pure Python.

A pattern matches a layer name when it is
- ``re:REGEX``: the regex matches from the start of the name (compressed-tensors' rule);
- otherwise a run of whole dotted components of the name: ``lm_head``,
  ``model.layers.0.mlp.down_proj``, ``mlp.gate`` (the MoE router, not ``mlp.gate_proj``),
  ``model.layers.3`` (everything under it).
vLLM fuses q/k/v and gate/up into one layer; a fused layer is matched by its own name or
through the names of its parts (``packed_modules_mapping``), which must then all match or
none.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping


def pattern_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    pat, parts = pattern.split("."), name.split(".")
    return any(parts[i:i + len(pat)] == pat for i in range(len(parts) - len(pat) + 1))


def _part_names(prefix: str, packed: Mapping[str, list]) -> list[str]:
    parent, _, last = prefix.rpartition(".")
    if last in packed:
        return [f"{parent}.{p}" if parent else p for p in packed[last]]
    return [prefix]


def matches_any(prefix: str, patterns: Iterable[str], packed: Mapping[str, list]) -> bool:
    """True if the layer ``prefix`` (or every part of a fused layer) matches a pattern."""
    patterns = list(patterns)
    if not patterns:
        return False
    if any(pattern_matches(p, prefix) for p in patterns):
        return True  # the fused layer named as vLLM names it
    parts = _part_names(prefix, packed)
    hits = [any(pattern_matches(p, n) for p in patterns) for n in parts]
    if any(hits) and not all(hits):
        matched = [n for n, h in zip(parts, hits) if h]
        other = [n for n, h in zip(parts, hits) if not h]
        raise ValueError(
            f"fp8_blockgemm: the fused layer '{prefix}' has parts {matched} matched by "
            f"{patterns} and parts {other} not: vLLM runs them as one GEMM, so all of its "
            f"parts must be quantized alike")
    return all(hits)
