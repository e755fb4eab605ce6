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
from ..rules import Rule, rule_in


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


@dataclass(frozen=True)
class Problem:
    m: int
    n: int
    k: int
    a_bytes: int          # bytes of an activation element (1: fp8)
    weight_only: bool     # fp8 weights decoded to fp16 tiles in the kernel
    dev: TritonDevice

    @property
    def kb(self) -> int:
        return cdiv(self.k, BLOCK)


TILE_RULES: list[Rule] = []   # Problem -> TritonConfig | None: the first that answers decides
ADJUSTMENTS: list[Rule] = []  # (Problem, TritonConfig) -> TritonConfig, applied in order


def choose(m: int, n: int, k: int, a_bytes: int, weight_only: bool,
           dev: TritonDevice) -> TritonConfig:
    """The Triton GEMM's tile, stages and split-K: fixed rules, no run-time autotuning
    (docs/tuning.md gives each rule id's measurements)."""
    p = Problem(m, n, k, a_bytes, weight_only, dev)
    cfg = next(c for c in (r.pick(p) for r in TILE_RULES) if c is not None)
    for r in ADJUSTMENTS:
        cfg = r.pick(p, cfg)
    return cfg


@rule_in(TILE_RULES, "triton-wide-short-k",
         "very wide N over few K steps at <= 16 tokens: 4x fewer 256-column programs")
def _wide_short_k(p):
    if (p.m <= 16 and p.kb <= 12 and cdiv(p.n, 256) * 10 >= p.dev.sms * 7
            and (p.m <= 8 or p.kb <= 4)):
        return TritonConfig(16, 256, 8, 3)
    return None


@rule_in(TILE_RULES, "triton-decode-narrow",
         "<= 16 tokens: reading the weight is the cost; many narrow programs, deep pipelines")
def _decode_narrow(p):
    return TritonConfig(16, 64, 4, 6) if p.m <= 16 else None


@rule_in(TILE_RULES, "triton-17-32", "17-32 tokens: 32x64 tiles")
def _m17_32(p):
    return TritonConfig(32, 64, 4, 6) if p.m <= 32 else None


@rule_in(TILE_RULES, "triton-33-64", "33-64 tokens: 64x64, or 64x128 over short K")
def _m33_64(p):
    if p.m > 64:
        return None
    return TritonConfig(64, 128, 4, 3) if p.kb <= 4 else TritonConfig(64, 64, 4, 5)


@rule_in(TILE_RULES, "triton-65-128",
         "65-128 tokens: 64x128 with one warpgroup (the total and the block product fit)")
def _m65_128(p):
    return TritonConfig(64, 128, 4, 4) if p.m <= 128 else None


@rule_in(TILE_RULES, "triton-large-short-k",
         "short K: 64x128 tiles with 4 warps, programs sharing an SM overlap their epilogues")
def _large_short_k(p):
    return TritonConfig(64, 128, 4, 3) if p.kb <= 4 else None


@rule_in(TILE_RULES, "triton-ragged-128x64",
         "128x64 where 128-column tiles leave a ragged last wave (64-column ones 15% dearer)")
def _ragged(p):
    def cost(bm, bn, eff):
        return cdiv(cdiv(p.m, bm) * cdiv(p.n, bn), p.dev.sms) * bm * bn * eff
    return TritonConfig(128, 64, 4, 4) if cost(128, 64, 1.15) < cost(128, 128, 1.0) else None


@rule_in(TILE_RULES, "triton-large", "compute-bound: 128x128 with 8 warps")
def _large(p):
    return TritonConfig(128, 128, 8, 4)


@rule_in(ADJUSTMENTS, "triton-halve-width",
         "too few 128-column tiles to fill the GPU: 64 columns before resorting to split-K")
def _halve_width(p, cfg):
    if cfg.bn == 128 and cdiv(p.m, cfg.bm) * cdiv(p.n, 128) < p.dev.sms:
        return cfg._replace(bn=64)
    return cfg


@rule_in(ADJUSTMENTS, "triton-stages",
         "as many stages as the shared memory holds; shrink the tile until two fit")
def _stages(p, cfg):
    def buffers_that_fit(c):
        stage = c.bm * 128 * p.a_bytes + 128 * c.bn          # A and W tiles of one K step
        extra = 0
        if p.weight_only:                                      # decoded fp16 tiles for the dot
            extra = 128 * c.bn * 2 + (c.bm * 128 * 2 if p.a_bytes == 1 else 0)
        return (p.dev.smem - extra - 4096) // stage

    # Triton keeps num_stages buffers in flight on sm_90+, num_stages - 1 before that.
    extra_stage = 1 if (not p.dev.hip and p.dev.capability < (9, 0)) else 0
    while buffers_that_fit(cfg) + extra_stage < 2 and (cfg.bm > 16 or cfg.bn > 64):
        bm, bn = (cfg.bm // 2, cfg.bn) if cfg.bm > 16 else (cfg.bm, 64)  # rows first
        cfg = cfg._replace(bm=bm, bn=bn, warps=8 if bm * bn >= 128 * 128 else 4)
    return cfg._replace(stages=max(2, min(cfg.stages, buffers_that_fit(cfg) + extra_stage)))


@rule_in(ADJUSTMENTS, "triton-split-k",
         "tiles that cannot fill the SMs: split K for ~two waves, >= 4 K blocks a split")
def _split_k(p, cfg):
    # the fp32 workspace traffic (2 x split x M x N x 4 bytes) stays under a quarter of the
    # weight bytes; between half and all the SMs only for long K and few tokens
    tiles = cdiv(p.m, cfg.bm) * cdiv(p.n, cfg.bn)
    split = 1
    if tiles < p.dev.sms and p.kb >= 8 and (2 * tiles <= p.dev.sms or (p.kb >= 32 and p.m <= 16)):
        split = min(cdiv(2 * p.dev.sms, tiles), p.kb // 4, 16, max(1, p.k // (32 * p.m)))
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
