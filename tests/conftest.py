"""Shared test setup: GPU tests skip with a reason on machines without CUDA.

Kept light on purpose: importing it pulls in nothing beyond torch and pytest (fp8linear only
inside the fixture).
"""
import pytest
import torch

try:  # hypothesis is a dev extra; CPU machines are slow, so no per-example deadline
    from hypothesis import settings

    settings.register_profile("fp8linear", deadline=None, print_blob=True)
    settings.load_profile("fp8linear")
except ImportError:
    pass


@pytest.fixture(autouse=True)
def _knobs_read_every_call(monkeypatch):
    # fp8linear reads its FP8LINEAR_* knobs once per process (host time); tests change them
    # with monkeypatch between calls, so they read them afresh every time.
    from fp8linear import knobs
    monkeypatch.setattr(knobs, "CACHE_VALUES", False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
