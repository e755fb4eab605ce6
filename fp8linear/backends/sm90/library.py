"""The kernel library loaded through ctypes, with the calls the sm90 backend makes.

The library (build.py) has plain C entry points (csrc/capi.cpp) that take one argument struct:
device pointers, sizes, the CUDA stream. Nothing here is tied to a torch or Python version.
A call packs its struct in one ``struct.pack`` (the layout from csrc/sm90/tables.def, checked
against the library's at load) and passes it by pointer, holding the GIL (the entry points
only launch kernels): far cheaper than ctypes' per-argument conversions. No allocation per
call: the library keeps its scratch per stream.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading
import warnings
from pathlib import Path

import torch

from . import build
from .tiles import ABI_VERSION, DTYPE_CODES, ENTRY_ARGS, MOE_PREFILL_CONFIG

_ENTRIES = ("quant", "gemm", "decode")  # fp8l_arg_size's numbering
_KIND = {"ptr": "P", "i64": "q", "i32": "i"}


def _layout(entry: str, names: tuple) -> struct.Struct:
    """The packed layout of an entry's struct; ``names`` is the order this module passes its
    fields in, which must be tables.def's."""
    fields = ENTRY_ARGS[entry]
    if tuple(n for _, n in fields) != names:
        raise AssertionError(f"fp8l_{entry}: fields {names} differ from tables.def's")
    return struct.Struct("@" + "".join(_KIND[k] for k, _ in fields))


_QUANT = _layout("quant", ("x", "q", "scale_t", "stream", "x_dtype", "scale_ld", "m", "k",
                           "pdl", "device"))
_GEMM = _layout("gemm", ("a", "a_scale_t", "w", "w_scale", "bias", "out", "stream",
                         "tile_expert", "row_token", "out_scale_t", "ws_floats", "tiles",
                         "a_dtype", "a_scale_ld", "out_scale_ld", "per_row", "bias_f32",
                         "out_dtype", "m", "n", "k", "config", "pdl", "quant_pdl", "early_b",
                         "group_m", "experts", "device"))
_DECODE = _layout("decode", ("x", "x_scale", "w", "w_scale", "bias", "out", "stream",
                             "tile_expert", "route_ids", "row_token", "ws_floats", "tiles",
                             "x_dtype", "xs_stride_m", "xs_stride_kb", "per_row", "bias_f32",
                             "out_dtype", "m", "n", "k", "config", "rows", "splits",
                             "ctas_per_sm", "pdl", "early_trigger", "quant_first", "experts",
                             "top_k", "ids_int64", "ids_ready", "silu_in", "window",
                             "route_slots", "route_top_k", "device"))
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
        lib = ctypes.PyDLL(str(path))  # the GIL stays held: launches only, no callbacks
        version = lib.fp8l_abi_version()
        if version != ABI_VERSION:
            raise build.BuildError(f"fp8linear: {path} has interface version {version}, "
                                   f"expected {ABI_VERSION}; delete it to rebuild")
        for i, (entry, layout) in enumerate(zip(_ENTRIES, (_QUANT, _GEMM, _DECODE))):
            size = lib.fp8l_arg_size(i)
            if size != -(-layout.size // 8) * 8:
                raise build.BuildError(f"fp8linear: {path}: fp8l_{entry}'s arguments take "
                                       f"{size} bytes, tables.def's {layout.size}")
        for name in ("fp8l_quant", "fp8l_gemm", "fp8l_decode"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [ctypes.c_char_p], ctypes.c_char_p
        self._quant, self._gemm, self._decode = lib.fp8l_quant, lib.fp8l_gemm, lib.fp8l_decode

    def quant(self, x, q, scale_t, pdl: bool) -> None:
        dev = x.device.index
        _check(self._quant(_QUANT.pack(
            x.data_ptr(), q.data_ptr(), scale_t.data_ptr(), _stream(dev), _IN[x.dtype],
            scale_t.shape[1], x.shape[0], x.shape[1], pdl, dev)))

    def gemm(self, a, a_scale_t, w, w_scale, per_row, bias, out, config, pdl, quant_pdl,
             early_b, group_m, ws_floats, tiles) -> None:
        # a_scale_t None: a holds 16/32-bit activations, quantized first by the library
        dev = a.device.index
        _check(self._gemm(_GEMM.pack(
            a.data_ptr(), 0 if a_scale_t is None else a_scale_t.data_ptr(), w.data_ptr(),
            w_scale.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
            _stream(dev), 0, 0, 0, ws_floats, tiles, _IN[a.dtype],
            0 if a_scale_t is None else a_scale_t.stride(0), 0, per_row,
            bias is not None and bias.dtype == torch.float32, _OUT[out.dtype], a.shape[0],
            w.shape[0], w.shape[1], config, pdl, quant_pdl, early_b, group_m, 1, dev)))

    def grouped_prefill(self, a, a_scale, w, w_scale, out, tile_expert, row_token, group_m,
                        pdl, out_scale=None, dtype=None, config=MOE_PREFILL_CONFIG) -> None:
        # the grouped expert GEMM for many tokens an expert (backends/sm90/moe.py): fp8 a
        # sorted by expert in 128-row tiles, a_scale (m, kb) a view of token-minor
        # [kb, ld] scales, tile_expert int32 [m / 128], row_token int64 [m] (-1: padding),
        # w [E, n, k], 128x128 w_scale [E, ...]; group_m: the tile order's band of M blocks.
        # out_scale: gate_up (n = 2I) with SiLU-and-mul + quantization fused: out fp8 h
        # [m, I], out_scale (m, I / 128) a view of token-minor scales; dtype: the
        # activations' (gate and up round to it first); config: the tile (MOE_PREFILL_CONFIGS)
        dev = a.device.index
        fused = out_scale is not None
        _check(self._gemm(_GEMM.pack(
            a.data_ptr(), a_scale.data_ptr(), w.data_ptr(), w_scale.data_ptr(), 0,
            out.data_ptr(), _stream(dev), tile_expert.data_ptr(), row_token.data_ptr(),
            out_scale.data_ptr() if fused else 0, 0, 0, _IN[a.dtype], a_scale.stride(1),
            out_scale.stride(1) if fused else 0, False, False,
            _OUT[dtype if fused else out.dtype], a.shape[0], w.shape[1], w.shape[2],
            config, pdl, False, 0, group_m, w.shape[0], dev)))

    def decode(self, x, x_scale, w, w_scale, per_row, bias, out, ws_floats, tiles, config, rows,
               splits, ctas_per_sm, pdl, early_trigger, quant_first) -> None:
        # x fp8 with x_scale (m, kb) at any strides; or bf16/fp16 quantized in the kernel, or
        # by the quant kernel first (quant_first)
        self._decode_call(x, x_scale, w, w_scale, per_row, bias, out, ws_floats, tiles, config,
                          rows, splits, ctas_per_sm, pdl, early_trigger, quant_first, None)

    def grouped(self, x, x_scale, w, w_scale, out, tile_expert, ws_floats, tiles, config,
                splits, ctas_per_sm, pdl, window=-1, ids=None, row_token=None) -> None:
        # the grouped expert GEMM (backends/sm90/moe.py): fp8 x sorted by expert in token
        # tiles, tile_expert int32 [m / tile], w [E, n, k], 128x128 w_scale [E, ...];
        # window: weight stages in flight (-1 the kernel's rule, 0 the whole ring); ids: the
        # contiguous topk_ids (int32/int64) that the routing sorted, written before the
        # previous kernel: the first wave's CTAs find their tile's expert from them (the
        # routing may still run), later ones read tile_expert; row_token (with ids): x is the
        # bf16/fp16 tokens [M', k], sorted row r token row_token[r] (-1: padding), read and
        # quantized in the kernel (no gather)
        slots = (0, ids is not None and ids.dtype == torch.int64, False, False)
        self._decode_call(x, x_scale, w, w_scale, False, None, out, ws_floats, tiles, config,
                          128, splits, ctas_per_sm, pdl, False, False, tile_expert, slots,
                          None if row_token is None else row_token.numel(), window, ids,
                          row_token)

    def grouped_slots(self, x, w, w_scale, out, topk_ids, ws_floats, tiles, splits,
                      ctas_per_sm, pdl, silu_in, ids_ready, window=-1) -> None:
        # the grouped expert GEMM over slot tiles (backends/sm90/moe.py): a tile a (token,
        # slot) pair of topk_ids [M, k] (int32/int64), x bf16/fp16: the tokens [M, K], or with
        # silu_in the pairs' gate | up rows [M * k, 2K]; out [M * k, n]; ids_ready: topk_ids
        # were written before the previous kernel (else read after waiting for it)
        self._decode_call(x, None, w, w_scale, False, None, out, ws_floats, tiles, 0, 128,
                          splits, ctas_per_sm, pdl, False, False, topk_ids,
                          (topk_ids.shape[1], topk_ids.dtype == torch.int64, ids_ready, silu_in),
                          out.shape[0], window)

    def _decode_call(self, x, x_scale, w, w_scale, per_row, bias, out, ws_floats, tiles, config,
                     rows, splits, ctas_per_sm, pdl, early_trigger, quant_first, tile_expert,
                     slots=(0, False, False, False), m=None, window=-1, route_ids=None,
                     row_token=None):
        dev = x.device.index
        _check(self._decode(_DECODE.pack(
            x.data_ptr(), 0 if x_scale is None else x_scale.data_ptr(), w.data_ptr(),
            w_scale.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
            _stream(dev), 0 if tile_expert is None else tile_expert.data_ptr(),
            0 if route_ids is None else route_ids.data_ptr(),
            0 if row_token is None else row_token.data_ptr(), ws_floats,
            tiles, _IN[x.dtype], 0 if x_scale is None else x_scale.stride(0),
            0 if x_scale is None else x_scale.stride(1), per_row,
            bias is not None and bias.dtype == torch.float32, _OUT[out.dtype],
            x.shape[0] if m is None else m, w.shape[-2], w.shape[-1], config, rows, splits,
            ctas_per_sm, pdl, early_trigger, quant_first,
            1 if tile_expert is None else w.shape[0], *slots, window,
            0 if route_ids is None else route_ids.numel(),
            0 if route_ids is None else route_ids.shape[-1], dev)))


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
