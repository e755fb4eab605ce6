"""Every environment variable fp8linear reads, declared once, with what it does.

Read once per process and cached: an ``os.environ`` lookup costs ~0.5-1 us of host time, and
eager models feel every microsecond. ``reload()`` re-reads them (and drops the decisions made
from them); the test suite turns the cache off, since it changes the environment between calls.
Plan-forcing for benchmarks and tests is not an environment variable: see
``fp8linear.backends.sm90.plan.forced`` and ``fp8linear.backends.triton.plan.forced``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Knob:
    name: str
    doc: str
    choices: Optional[tuple[str, ...]] = None  # None: any value (a path)


BACKEND = Knob("FP8LINEAR_BACKEND",
               "Force a backend: reference (torch), triton, sm90 (Hopper CUDA). Unset: by device.",
               ("reference", "triton", "sm90"))
TRITON_MODE = Knob("FP8LINEAR_TRITON_MODE",
                   "Triton path's mode: native (fp8 tensor cores, sm_89+) or weight_only "
                   "(fp8 weights decoded to fp16 in the kernel). Unset: by capability.",
                   ("native", "weight_only"))
PDL = Knob("FP8LINEAR_PDL",
           "0: no programmatic dependent launch for our kernels (to rule it out when debugging).",
           ("0", "1"))
LOG_DISPATCH = Knob("FP8LINEAR_LOG_DISPATCH",
                    "1: print each distinct dispatch decision once to stderr (kernel, plan, rule).",
                    ("0", "1"))
CACHE = Knob("FP8LINEAR_CACHE",
             "Directory of the JIT-built sm_90a kernels (default ~/.cache/fp8linear).")
PREBUILT = Knob("FP8LINEAR_PREBUILT",
                "Directory holding a prebuilt kernel library under its cache key: loaded as is.")
VLLM_PDL = Knob("FP8LINEAR_VLLM_PDL",
                "0: the vLLM plugin leaves Inductor's PDL setting alone.", ("0", "1"))
VLLM_FUSE_QUANT = Knob("FP8LINEAR_VLLM_FUSE_QUANT",
                       "vLLM plugin's norm/SiLU-and-mul + quantization fusion pass: 0 off, 1 on "
                       "wherever it applies. Unset: on for our sm90 backend.", ("0", "1"))
VLLM_COUNT_CALLS = Knob("FP8LINEAR_VLLM_COUNT_CALLS",
                        "1: count the plugin's apply() calls per layer (tests; eager mode only).",
                        ("0", "1"))

KNOBS = (BACKEND, TRITON_MODE, PDL, LOG_DISPATCH, CACHE, PREBUILT, VLLM_PDL, VLLM_FUSE_QUANT,
         VLLM_COUNT_CALLS)

CACHE_VALUES = True  # tests set False: every get() reads the environment
_values: dict[str, Optional[str]] = {}
_on_reload: list[Callable[[], None]] = []


def get(knob: Knob) -> Optional[str]:
    """The knob's value, None when unset or empty; ValueError naming it when not a choice."""
    if CACHE_VALUES and knob.name in _values:
        return _values[knob.name]
    v = os.environ.get(knob.name) or None
    if v is not None and knob.choices is not None and v not in knob.choices:
        raise ValueError(f"{knob.name}={v!r}: expected one of {', '.join(knob.choices)}")
    if CACHE_VALUES:
        _values[knob.name] = v
    return v


def on(knob: Knob, default: bool) -> bool:
    """A 0/1 knob as a bool (unset: default)."""
    v = get(knob)
    return default if v is None else v == "1"


def on_reload(fn: Callable[[], None]) -> None:
    """Call fn() whenever reload() runs (caches of decisions derived from the knobs)."""
    _on_reload.append(fn)


def reload() -> None:
    """Forget the values read so far, and the decisions derived from them."""
    _values.clear()
    for fn in _on_reload:
        fn()
