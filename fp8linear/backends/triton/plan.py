"""The Triton backend's plans: tiles, stages and split-K of the GEMM, and the launch split of
the kernels that quantize their own output (norm, SiLU-and-mul). Fixed rules, no run-time
autotuning; docs/tuning.md gives their measurements. Importable without Triton (CPU tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ...quant import BLOCK, cdiv


@dataclass(frozen=True)
class Overrides:
    fused_quant_early_trigger: Optional[bool] = None


_forced = Overrides()


@contextlib.contextmanager
def forced(**pieces):
    """Force plan pieces inside the block (benchmarks, tests)."""
    global _forced
    new = dataclasses.replace(_forced, **pieces)
    for f in dataclasses.fields(new):
        v = getattr(new, f.name)
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"forced {f.name}={v!r}: expected True, False or None")
    old, _forced = _forced, new
    try:
        yield new
    finally:
        _forced = old


class TritonConfig(NamedTuple):
    bm: int
    bn: int
    warps: int
    stages: int
    split: int = 1          # requested split-K; _plan makes every split non-empty
    group_m: int = 8


class TritonDevice(NamedTuple):
    sms: int
    smem: int          # bytes of shared memory one program may use
    hip: bool
    capability: tuple


@functools.lru_cache(maxsize=None)
def device_info(dev_type: str, index: int) -> TritonDevice:
    if dev_type != "cuda":
        # TRITON_INTERPRET=1 on CPU tensors (tests): plan as for an H100
        return TritonDevice(132, 227 * 1024, False, (9, 0))
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or 48 * 1024
    hip = torch.version.hip is not None
    cap = torch.cuda.get_device_capability(index)
    return TritonDevice(p.multi_processor_count, smem, hip, cap)


def choose(m: int, n: int, k: int, a_bytes: int, weight_only: bool,
                  dev: TritonDevice) -> TritonConfig:
    """Triton tile rules: a handful of fixed configurations; no run-time autotuning."""
    kb = cdiv(k, BLOCK)
    if m <= 16:
        # triton-decode-narrow: reading the weight is the whole cost; narrow tiles make many
        # programs (N/64), each streaming 64x128 weight tiles with deep pipelining.
        cfg = TritonConfig(16, 64, 4, 6)
        if kb <= 12 and cdiv(n, 256) * 10 >= dev.sms * 7 and (m <= 8 or kb <= 4):
            # triton-wide-short-k: very wide N over few K steps, where a program is mostly
            # prologue and epilogue: 4x fewer 256-column programs (>= 0.7 of a wave)
            # amortise them; at 16 tokens only for the shortest K (docs/tuning.md).
            cfg = TritonConfig(16, 256, 8, 3)
    elif m <= 32:
        cfg = TritonConfig(32, 64, 4, 6)  # triton-17-32
    elif m <= 64:
        # triton-33-64: 128-column tiles for short K, as in triton-wide-short-k
        cfg = TritonConfig(64, 128, 4, 3) if kb <= 4 else TritonConfig(64, 64, 4, 5)
    elif m <= 128:
        # triton-65-128: still mostly weight-bound; 64x128 with one warpgroup keeps the fp32
        # total plus the per-block product at 128 registers a thread.
        cfg = TritonConfig(64, 128, 4, 4)
    else:
        # triton-large: compute-bound, 128x128 with 8 warps (128x256 would need ~256 registers
        # a thread for the total plus the per-block product the promotion needs).
        cfg = TritonConfig(128, 128, 8, 4)
        # triton-ragged-128x64: 128x64 where 128-column tiles leave a ragged last wave that
        # 64-column ones fill (waves x tile area, 64-column tiles counted 15% less efficient).
        def cost(bm, bn, eff):
            return cdiv(cdiv(m, bm) * cdiv(n, bn), dev.sms) * bm * bn * eff
        if cost(128, 64, 1.15) < cost(128, 128, 1.0):
            cfg = TritonConfig(128, 64, 4, 4)
        if kb <= 4:
            # triton-large-short-k: a tile is mostly prologue and epilogue; 64x128 tiles with
            # 4 warps let programs share an SM, one's epilogue overlapping another's loads.
            cfg = TritonConfig(64, 128, 4, 3)

    if cfg.bn == 128 and cdiv(m, cfg.bm) * cdiv(n, 128) < dev.sms:
        # triton-halve-width: too few tiles to fill the GPU; halve the tile width before
        # resorting to split-K, which costs a workspace round trip.
        cfg = cfg._replace(bn=64)

    # triton-stages: as many as the shared memory holds (Ada and sm_86 ~100 KB, H100 227 KB).
    def buffers_that_fit(c):
        stage = c.bm * 128 * a_bytes + 128 * c.bn          # A and W tiles of one K step
        extra = 0
        if weight_only:                                      # decoded fp16 tiles for the dot
            extra = 128 * c.bn * 2 + (c.bm * 128 * 2 if a_bytes == 1 else 0)
        return (dev.smem - extra - 4096) // stage

    # Triton keeps num_stages buffers in flight on sm_90+, num_stages - 1 before that.
    extra_stage = 1 if (not dev.hip and dev.capability < (9, 0)) else 0
    while buffers_that_fit(cfg) + extra_stage < 2 and (cfg.bm > 16 or cfg.bn > 64):
        # Two stages must fit (e.g. fp32 activations on a 100 KB SM, or a 64 KB LDS):
        # shrink the tile, rows first.
        bm, bn = (cfg.bm // 2, cfg.bn) if cfg.bm > 16 else (cfg.bm, 64)
        cfg = cfg._replace(bm=bm, bn=bn, warps=8 if bm * bn >= 128 * 128 else 4)
    cfg = cfg._replace(stages=max(2, min(cfg.stages, buffers_that_fit(cfg) + extra_stage)))

    # triton-split-k: when the output tiles cannot fill the SMs, split K so that about two
    # waves of programs run (several in flight an SM hide memory latency), keeping >= 4 K
    # blocks a split (the pipeline's steady state) and the fp32 workspace traffic
    # (2 x split x M x N x 4 bytes) under a quarter of the weight bytes. Between half and all
    # the SMs only for long K and few tokens (docs/tuning.md).
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    split = 1
    if tiles < dev.sms and kb >= 8 and (2 * tiles <= dev.sms or (kb >= 32 and m <= 16)):
        split = min(cdiv(2 * dev.sms, tiles), kb // 4, 16, max(1, k // (32 * m)))
    return cfg._replace(split=max(1, split))


# ------------------------------------------------- fused (norm | SiLU-and-mul) + quantization
FUSED_QUANT_SPLIT_MIN_ROWS = 32


def fused_quant_split(m: int, groups: int, sms: int, cap: int, whole_row: bool):
    """(128-channel groups a program, a power of 2; num_warps) of the Triton kernels that
    quantize their own output over m rows of ``groups`` groups, at most ``cap`` a program:
    the norm (norm_quant.py, whole_row: a program may take its whole row) and SiLU-and-mul
    (swiglu_quant.py). docs/tuning.md: triton-fused-quant-split."""
    # - Below 32 rows, 4 groups a program (4 warps): decode sizes still give the GPU hundreds
    #   of programs (a row a program ran longer than the hop it removes).
    # - The norm from 32 rows: the whole row, ~8 values of each operand a thread (16 warps at
    #   K 4096): it reads the row once, where a split program re-reads it for the sum of
    #   squares.
    # - SiLU-and-mul (its groups are independent: no row-wide sum) from 32 rows to one row an
    #   SM: 8 groups, 8 warps; from there 16 groups, 4 warps.
    if m < FUSED_QUANT_SPLIT_MIN_ROWS:
        return 4, 4
    if whole_row:
        cg = _next_pow2(groups)
        return cg, max(4, min(16, cg * 128 // 256))
    if m < sms:
        return min(8, max(4, _next_pow2(groups))), 8
    cg = max(4, min(_next_pow2(groups), _next_pow2(cap)))
    return cg, max(4, min(16, cg * 128 // 1024))


def fused_quant_early_trigger(m: int, norm: bool) -> bool:
    """Let the GEMM after a fused norm (norm) / SiLU-and-mul quantization kernel launch (PDL)
    as soon as the kernel's programs start, instead of after their loads? The GEMM waits for
    the kernel's completion before it reads the activations either way; earlier, its CTAs
    that fit beside the kernel's (lean tiles, the decode kernel at two CTAs an SM) run their
    prologue (and full-register tiles their early weight loads) meanwhile. It pays after the
    norm below 32 rows only, where its rows are split over many short programs
    (docs/tuning.md: triton-fused-quant-early-trigger).
    ``forced(fused_quant_early_trigger=...)`` forces it (both kernels)."""
    v = _forced.fused_quant_early_trigger
    if v is not None:
        return v
    return norm and m < FUSED_QUANT_SPLIT_MIN_ROWS


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
