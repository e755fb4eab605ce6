"""Expectations the tests share."""
from __future__ import annotations

import re

import pytest


def raises_exactly(exc: type[BaseException], msg: str):
    """pytest.raises for ``exc`` whose message is exactly ``msg`` (the errors name the tensor
    or path and what was expected: a test holds the whole sentence)."""
    return pytest.raises(exc, match=rf"\A{re.escape(msg)}\Z")
