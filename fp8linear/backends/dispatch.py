"""The backend for one call: by device, GPU capability and shape (or FP8LINEAR_BACKEND).

Imports the backends; no backend imports it back. Each backend module offers ``gemm(a,
a_scale, w, w_scale, bias, out)`` and ``linear(x, w, w_scale, bias, out)``.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .. import knobs
from . import reference
from .sm90.plan import shape_ok as sm90_shape_ok


def forced_backend() -> str | None:
    """FP8LINEAR_BACKEND=reference|triton|sm90, or None (by device)."""
    return knobs.get(knobs.BACKEND)


@functools.lru_cache(maxsize=None)
def _cuda_default(index: int) -> str:
    # Hopper (sm_90) gets our CUDA kernels: they need wgmma/TMA, which only sm_90a has.
    # Every other GPU gets the portable Triton path.
    if torch.cuda.get_device_capability(index) == (9, 0):
        from .sm90 import backend as sm90
        if sm90.available():
            return "sm90"
    return "triton"


@functools.lru_cache(maxsize=None)
def _check_sm90_device(index: int) -> None:
    # A forced sm90 backend on another GPU would build for sm_90a and fail at launch: say so
    # before anything runs (BuildError names the GPU's compute capability).
    from .sm90 import build
    build.device_arch(index)


def _require_sm90(device: torch.device) -> None:
    _check_sm90_device(device.index if device.index is not None else torch.cuda.current_device())


def _module(name: str):
    if name == "reference":
        return reference
    if name == "triton":
        from .triton import gemm as triton
        return triton
    from .sm90 import backend as sm90
    return sm90


def backend_for(device: torch.device, m: int, n: int, k: int):
    """The backend module for one [M, K] x [N, K]^T call."""
    forced = forced_backend()  # once: an environment read costs host time on every call
    if device.type != "cuda":
        # No GPU: the torch reference is the only path (and the definition of the numerics).
        if forced not in (None, "reference"):
            warnings.warn(f"{knobs.BACKEND.name}={forced} ignored for a {device.type} tensor: "
                          f"using the torch reference", stacklevel=3)
        return reference
    name = forced or _cuda_default(device.index or 0)
    if forced == "sm90":
        _require_sm90(device)
    if name == "sm90" and not sm90_shape_ok(n, k):
        if forced == "sm90":
            from .sm90 import backend as sm90
            sm90.check_shape(n, k)  # raises the ValueError that explains it
        # TMA needs 16-byte row strides (K % 16, N % 8); other shapes take the Triton path,
        # which has no such limit, instead of failing.
        name = "triton"
    return _module(name)


def moe_backend(device: torch.device, hidden: int, inter: int, block_scales: bool) -> str:
    """The MoE layer's path: "sm90" (grouped expert GEMMs, backends/sm90/moe.py) on Hopper for
    the shapes it takes, else "reference" (fp8linear.moe.moe_reference)."""
    forced = forced_backend()
    if device.type != "cuda" or forced in ("reference", "triton"):
        return "reference"
    if forced != "sm90" and _cuda_default(device.index or 0) != "sm90":
        return "reference"
    if forced == "sm90":
        _require_sm90(device)
    from .sm90 import moe as sm90_moe
    if sm90_moe.supported(hidden, inter, block_scales):
        return "sm90"
    if forced == "sm90":
        raise ValueError(f"the sm90 MoE kernels need hidden % 16 == 0, an expert "
                         f"intermediate size % 128 == 0 and 128x128 weight scales; got hidden "
                         f"{hidden}, intermediate {inter}"
                         f"{'' if block_scales else ', per-row scales'}")
    return "reference"
