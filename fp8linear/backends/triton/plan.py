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
        # Decode: reading the weight is the whole cost. Narrow tiles make many programs
        # (N/64) each streaming a 64x128 weight tile per step with deep pipelining.
        cfg = TritonConfig(16, 64, 4, 6)
        if kb <= 12 and cdiv(n, 256) * 10 >= dev.sms * 7 and (m <= 8 or kb <= 4):
            # ... except very wide N with few K steps (24576x1536, 32768x512): a program is
            # then mostly prologue and epilogue, and 4x fewer 256-column programs (still
            # >= 0.7 of a wave) amortise them (H100: 0.94 -> 1.03-1.05x of vLLM's tuned
            # Triton at M=1). At 16 tokens only for the shortest K (24576x1536 x 16 ran
            # 0.93x with 256 columns, 0.97x with 64; 32768x512 x 16 1.04x).
            cfg = TritonConfig(16, 256, 8, 3)
    elif m <= 32:
        cfg = TritonConfig(32, 64, 4, 6)
    elif m <= 64:
        # 128-column tiles for short K, for the same reason (32768x512 x 64: 0.92x of vLLM
        # with 64 columns)
        cfg = TritonConfig(64, 128, 4, 3) if kb <= 4 else TritonConfig(64, 64, 4, 5)
    elif m <= 128:
        # Still mostly weight-bound: 64x128 with one warpgroup keeps the fp32 total plus
        # the per-block product at 128 registers a thread.
        cfg = TritonConfig(64, 128, 4, 4)
    else:
        # Compute-bound: 128x128 with 8 warps. Wider tiles (128x256) would need ~256
        # registers a thread for the total plus the per-block product the promotion needs.
        cfg = TritonConfig(128, 128, 8, 4)
        # ... unless 128-column tiles leave a ragged last wave that 64-column ones fill:
        # waves x tile area, 64-column tiles counted 15% less efficient (measured on the H100:
        # 2112x7168 at M=1024, 136 tiles of 128x128 for 132 SMs ran 68 us, vLLM's tuned
        # 64-column config 56 us).
        def cost(bm, bn, eff):
            return cdiv(cdiv(m, bm) * cdiv(n, bn), dev.sms) * bm * bn * eff
        if cost(128, 64, 1.15) < cost(128, 128, 1.0):
            cfg = TritonConfig(128, 64, 4, 4)
        if kb <= 4:
            # Short K (e.g. 32768x512): a tile is mostly prologue and epilogue; 64x128 tiles
            # with 4 warps let several programs share an SM and overlap one's epilogue with
            # another's loads (measured 310 vs vLLM's tuned 64x128 286 us at M=4096).
            cfg = TritonConfig(64, 128, 4, 3)

    if cfg.bn == 128 and cdiv(m, cfg.bm) * cdiv(n, 128) < dev.sms:
        # Too few tiles to fill the GPU: halve the tile width before resorting to split-K,
        # which costs a workspace round trip.
        cfg = cfg._replace(bn=64)

    # Stages: as many as the shared memory holds (Ada and sm_86 have ~100 KB, H100 227 KB).
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

    # Split-K: when the output tiles cannot fill the SMs, split K so that about two waves of
    # programs run (memory latency is hidden by having several in flight per SM), keeping
    # >= 4 K-blocks per split (enough for the pipeline to reach steady state) and the fp32
    # workspace traffic (2 x split x M x N x 4 bytes) under a quarter of the weight bytes.
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    split = 1
    # Between half and all the SMs, only for long K and few tokens: at 112 tiles on 132 SMs,
    # 7168x2048 x 16 (16 K blocks) ran 8.6 us unsplit vs 10.5 split, 7168x16384 x 64 51.7
    # vs 58.8, while 7168x16384 x 1 (128 K blocks) and 8192x28672 x 1-16 ran 10-20% faster
    # split (H100, bench_gemm).
    if tiles < dev.sms and kb >= 8 and (2 * tiles <= dev.sms or (kb >= 32 and m <= 16)):
        split = min(cdiv(2 * dev.sms, tiles), kb // 4, 16, max(1, k // (32 * m)))
    return cfg._replace(split=max(1, split))


# ------------------------------------------------- fused (norm | SiLU-and-mul) + quantization
FUSED_QUANT_SPLIT_MIN_ROWS = 32


def fused_quant_split(m: int, groups: int, sms: int, cap: int, whole_row: bool):
    """(128-channel groups a program, a power of 2; num_warps) of the Triton kernels that
    quantize their own output over m rows of ``groups`` groups, at most ``cap`` a program:
    the norm (triton_norm_quant.py, whole_row: a program may take its whole row) and
    SiLU-and-mul (triton_swiglu_quant.py)."""
    # Measured on H100 for Llama 8B's norm (K 4096, residual add) and SiLU-and-mul (d 14336),
    # us per call (scripts/dev_fused_quant_split.py; results/2026-11-25_fused_quant_split_s17
    # _h100.log; "gCwW": C groups a program, W warps):
    # - Below 32 rows, 4 groups a program (4 warps), so that decode sizes still give the GPU
    #   hundreds of programs (norm at 16 rows 2.01 us; the whole row 2.12-3.22; a row a
    #   program ran longer than the hop it removes, session 15).
    # - The norm from 32 rows: the whole row with ~8 values of each operand a thread (16
    #   warps at K 4096): it reads the row once, where a split program re-reads it for the
    #   sum of squares. 64 rows 2.37 vs 2.62 (g4w4), 128: 2.64 vs 4.69, 256: 3.22 vs 3.95
    #   (whole row, 4 warps), 1024: 7.50 vs 7.98, 8192: 81.5 vs 82.3 (at 8192 g4w4 383).
    # - SiLU-and-mul (its groups are independent: no row-wide sum) from 32 rows to one row an
    #   SM: 8 groups, 8 warps (64 rows 2.70 vs 2.73, 96: 3.43 vs 3.75, 128: 4.17 vs 4.90);
    #   from there 16 groups, 4 warps (256 rows 6.19, the best; 8192: 198 vs 277 with 4).
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
    prologue (and full-register tiles their early weight loads) meanwhile. H100,
    block_fp8_gemm after the fused kernel, 6 shapes (results/2026-11-25_gemm_lean_early_h100.log,
    run 4, with fused_quant_split's current rule): after the norm at 1-16 tokens, where its
    rows are split over many short programs, faster on 16 of 18 points (2112x7168 x 16 9.07 ->
    8.19 us, 4096x7168 x 1-4 -0.6 / -0.9, 6144x4096 x 16 -0.57; 4096x14336 x 1-4 +0.8 / +1.6,
    a shape no norm precedes in Llama); from 32 tokens (a program a row) 0.05-0.2 us slower
    on most points; after SiLU-and-mul mixed (4096^2 x 1-4 and x 32 +0.6 to +1.3, 4096x14336
    x 128 +1.7; 28672x4096 -0.2 to -0.8): the norm below 32 rows only.
    ``forced(fused_quant_early_trigger=...)`` forces it (both kernels)."""
    v = _forced.fused_quant_early_trigger
    if v is not None:
        return v
    return norm and m < FUSED_QUANT_SPLIT_MIN_ROWS


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
