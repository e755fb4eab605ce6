"""Shared test setup: GPU tests skip with a reason on machines without CUDA; Hypothesis runs
with a fixed, printed seed.

Kept light on purpose: importing it pulls in nothing beyond torch, pytest and hypothesis
(fp8linear only inside the fixture).

Hypothesis profiles (HYPOTHESIS_PROFILE):
- ``fp8linear`` (the default, CI included): a fixed seed (0, or HYPOTHESIS_SEED /
  --hypothesis-seed), no example database: every run tests the same examples, 30 a test.
- ``long``: opt-in, for hunting: a fresh random seed each run (printed in the header, so a
  failure reruns with HYPOTHESIS_SEED=<seed>), 500 examples a test, failures kept in the
  example database (.hypothesis/).
"""
import os
import random
import sys

import pytest
import torch

# benchmarks/ (scripts, not a package) importable by the tests of its scripts
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "fp8linear")
try:  # a dev extra: a GPU machine with only pytest still runs the GPU tests
    from hypothesis import settings
except ImportError:
    settings = None
else:
    # CPU machines are slow, so no per-example deadline; print_blob: a failure prints the
    # @reproduce_failure line that replays it
    settings.register_profile("fp8linear", deadline=None, print_blob=True, database=None,
                              max_examples=30)
    settings.register_profile("long", deadline=None, print_blob=True, max_examples=500)
    settings.load_profile(PROFILE)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # the seed goes through the hypothesis plugin's own --hypothesis-seed option (read by the
    # plugin's pytest_configure, which runs after this one)
    if settings is not None and config.getoption("hypothesis_seed", None) is None:
        seed = os.environ.get("HYPOTHESIS_SEED")
        if seed is None:
            seed = str(random.SystemRandom().randrange(2**32) if PROFILE == "long" else 0)
        config.option.hypothesis_seed = seed


def _hypothesis_line(config) -> str:
    return (f"hypothesis profile {PROFILE!r} (max_examples={settings.default.max_examples}), "
            f"seed {config.getoption('hypothesis_seed')} (rerun with HYPOTHESIS_SEED=<seed>; "
            f"HYPOTHESIS_PROFILE=long: a random seed, more examples)")


def pytest_report_header(config):
    return None if settings is None else "fp8linear: " + _hypothesis_line(config)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # also under -q, which drops the header
    if settings is not None and config.option.verbose < 0:
        terminalreporter.write_line(_hypothesis_line(config))


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
