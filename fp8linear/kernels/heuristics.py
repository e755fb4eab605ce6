"""Every dispatch decision lives here, each rule with its reason.

backend_for(device, M, N, K) picks the backend module (reference / triton / sm90); the sm90
backend asks ``sm90_config`` for its tile configuration.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from . import reference

BACKENDS = ("reference", "triton", "sm90")
_ENV = "FP8LINEAR_BACKEND"


def forced_backend() -> str | None:
    """FP8LINEAR_BACKEND=reference|triton|sm90 forces a backend (tests, benchmarks)."""
    v = os.environ.get(_ENV)
    if not v:
        return None
    if v not in BACKENDS:
        raise ValueError(f"{_ENV}={v!r}: expected one of {', '.join(BACKENDS)}")
    return v


@functools.lru_cache(maxsize=None)
def _cuda_default(index: int) -> str:
    # Hopper (sm_90) gets our CUDA kernels: they need wgmma/TMA, which only sm_90a has.
    # Every other GPU gets the portable Triton path.
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) == (9, 0):
        from . import sm90
        if sm90.available():
            return "sm90"
    return "triton"


def _module(name: str):
    if name == "reference":
        return reference
    if name == "triton":
        from . import triton_gemm
        return triton_gemm
    from . import sm90
    return sm90


def backend_for(device: torch.device, m: int, n: int, k: int):
    if device.type != "cuda":
        # No GPU: the torch reference is the only path (and the definition of the numerics).
        if forced_backend() not in (None, "reference"):
            warnings.warn(f"{_ENV}={forced_backend()} ignored for a {device.type} tensor: "
                          f"using the torch reference", stacklevel=3)
        return reference
    name = forced_backend() or _cuda_default(device.index or 0)
    if name == "sm90" and not sm90_shape_ok(n, k):
        if forced_backend() == "sm90":
            from . import sm90
            sm90.check_shape(n, k)  # raises the ValueError that explains it
        # TMA needs 16-byte row strides (K % 16, N % 8); other shapes take the Triton path,
        # which has no such limit, instead of failing.
        name = "triton"
    return _module(name)


def sm90_shape_ok(n: int, k: int) -> bool:
    # TMA global strides must be multiples of 16 bytes: K one-byte fp8 values per A/W row,
    # N two-byte values per bf16/fp16 output row.
    return k % 16 == 0 and n % 8 == 0 and k > 0 and n > 0
