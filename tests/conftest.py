"""Shared test setup: GPU tests skip with a reason on machines without CUDA.

Kept light on purpose: importing it must not pull in anything beyond torch and pytest.
"""
import pytest
import torch

try:  # hypothesis is a dev extra; CPU machines are slow, so no per-example deadline
    from hypothesis import settings

    settings.register_profile("fp8linear", deadline=None, print_blob=True)
    settings.load_profile("fp8linear")
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
