"""The kernel library loaded through ctypes, with the calls the sm90 backend makes.

The library (build.py) has plain C entry points (csrc/capi.cpp): device pointers, sizes, the
CUDA stream. Nothing here is tied to a torch or Python version. Each call costs a few hundred
nanoseconds of host time beyond the kernels' launch: pointers and sizes only, no allocation
(the library keeps its scratch per stream).
"""
from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from pathlib import Path

import torch

from . import build
from .tiles import DTYPE_CODES

ABI_VERSION = 1  # csrc/capi.cpp fp8l_abi_version()

_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_SIGNATURES = {
    "fp8l_quant": [_P, _I, _P, _P, _I, _I, _I, _I, _I, _P],
    "fp8l_gemm": [_P, _I, _P, _I, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I,
                  _LL, _LL, _I, _P],
    "fp8l_decode": [_P, _I, _P, _I, _I, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _I,
                    _I, _I, _I, _LL, _LL, _I, _P],
}
_IN = {torch.bfloat16: DTYPE_CODES["kInBF16"], torch.float16: DTYPE_CODES["kInFP16"],
       torch.float32: DTYPE_CODES["kInFP32"], torch.float8_e4m3fn: DTYPE_CODES["kInFP8"]}
_OUT = {torch.bfloat16: DTYPE_CODES["kOutBF16"], torch.float16: DTYPE_CODES["kOutFP16"]}
# the current stream's handle, cheaply (CUDA builds of torch; only called on CUDA tensors)
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class KernelError(RuntimeError):
    """A kernel launch was refused (its message names the kernel and why)."""


class Library:
    """The loaded library; its methods take torch tensors and run on the current stream."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        version = lib.fp8l_abi_version()
        if version != ABI_VERSION:
            raise build.BuildError(f"fp8linear: {path} has interface version {version}, "
                                   f"expected {ABI_VERSION}; delete it to rebuild")
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_char_p
        self._quant, self._gemm, self._decode = lib.fp8l_quant, lib.fp8l_gemm, lib.fp8l_decode

    def quant(self, x, q, scale_t, pdl: bool) -> None:
        dev = x.device.index
        _check(self._quant(x.data_ptr(), _IN[x.dtype], q.data_ptr(), scale_t.data_ptr(),
                           scale_t.shape[1], x.shape[0], x.shape[1], pdl, dev, _stream(dev)))

    def gemm(self, a, a_scale_t, w, w_scale, per_row, bias, out, config, pdl, quant_pdl,
             early_b, group_m, ws_floats, tiles) -> None:
        # a_scale_t None: a holds 16/32-bit activations, quantized first by the library
        dev = a.device.index
        _check(self._gemm(
            a.data_ptr(), _IN[a.dtype], None if a_scale_t is None else a_scale_t.data_ptr(),
            0 if a_scale_t is None else a_scale_t.stride(0), w.data_ptr(), w_scale.data_ptr(),
            per_row, None if bias is None else bias.data_ptr(),
            bias is not None and bias.dtype == torch.float32, out.data_ptr(), _OUT[out.dtype],
            a.shape[0], w.shape[0], w.shape[1], config, pdl, quant_pdl, early_b, group_m,
            ws_floats, tiles, dev, _stream(dev)))

    def decode(self, x, x_scale, w, w_scale, per_row, bias, out, ws_floats, tiles, config, rows,
               splits, ctas_per_sm, pdl, early_trigger, quant_first) -> None:
        # x fp8 with x_scale (m, kb) at any strides; or bf16/fp16 quantized in the kernel, or
        # by the quant kernel first (quant_first)
        dev = x.device.index
        _check(self._decode(
            x.data_ptr(), _IN[x.dtype], None if x_scale is None else x_scale.data_ptr(),
            0 if x_scale is None else x_scale.stride(0),
            0 if x_scale is None else x_scale.stride(1), w.data_ptr(), w_scale.data_ptr(),
            per_row, None if bias is None else bias.data_ptr(),
            bias is not None and bias.dtype == torch.float32, out.data_ptr(), _OUT[out.dtype],
            x.shape[0], w.shape[0], w.shape[1], config, rows, splits, ctas_per_sm, pdl,
            early_trigger, quant_first, ws_floats, tiles, dev, _stream(dev)))


def _check(err) -> None:
    if err is not None:
        raise KernelError(err.decode(errors="replace"))


_library = None
_lock = threading.Lock()


def load() -> Library:
    """The library for the current sources (built first where needed); fast after the first
    call (the hot path calls it per launch)."""
    global _library
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            path = build.library_path()
            try:
                _library = Library(path)
            except OSError as e:  # e.g. a glibc older than the build machine's
                raise build.BuildError(f"fp8linear: {path} does not load ({e}); delete "
                                       f"{path.parent} to rebuild it") from e
    return _library


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when the sm90 kernels can run here; else False with one warning saying why."""
    try:
        if not torch.cuda.is_available():
            raise build.BuildError("fp8linear: no CUDA device")
        build.device_arch()
        load()
        return True
    except Exception as e:  # noqa: BLE001  (any failure means: use the portable path)
        head, _, detail = str(e).partition("\n")  # the verdict first, a build log after
        warnings.warn(f"{head}; falling back to the Triton path" + (f"\n{detail}" if detail
                                                                       else ""), stacklevel=2)
        return False
