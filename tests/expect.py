"""Expectations the tests share."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

TUNING_MD = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"


def raises_exactly(exc: type[BaseException], msg: str):
    """pytest.raises for ``exc`` whose message is exactly ``msg`` (the errors name the tensor
    or path and what was expected: a test holds the whole sentence)."""
    return pytest.raises(exc, match=rf"\A{re.escape(msg)}\Z")


def undocumented(rule_ids) -> list[str]:
    """The plan rule ids without their entry (``**id**``) in docs/tuning.md, where each rule's
    measurements live (the code keeps an id and a one-line reason)."""
    tuning = TUNING_MD.read_text()
    return [r for r in rule_ids if f"**{r}**" not in tuning]
