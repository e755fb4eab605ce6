"""The plans' rules (backends/sm90/plan.py, backends/triton/plan.py): each an id, a one-line
reason and the function that answers; docs/tuning.md holds each id's measurements."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Rule:
    id: str
    reason: str
    pick: Callable


def rule_in(table: list, id: str, reason: str):
    """Decorator: appends the function to ``table`` as the rule ``id`` (tables keep their order)."""
    def add(fn):
        table.append(Rule(id, reason, fn))
        return fn
    return add
