"""Every dispatch decision lives here, each rule with its reason.

backend_for(device, M, N, K) picks the backend module (reference / triton / sm90); the sm90
backend asks ``sm90_plan`` for its kernel, tile and split-K, the Triton backend asks
``triton_config`` for its tiles, stages and split-K.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import torch

from . import reference
from ..quant import BLOCK, cdiv

BACKENDS = ("reference", "triton", "sm90")
_ENV = "FP8LINEAR_BACKEND"

# The FP8LINEAR_* knobs are read once per process: an os.environ lookup costs ~0.5-1 us of
# host time and a call would make ten of them (eager models feel every microsecond).
# reload_env() re-reads them (benchmarks that switch knobs between runs); tests turn the
# cache off (tests/conftest.py), since they change the environment between calls.
_env_cache: dict = {}
CACHE_ENV = True


def env(name: str) -> str | None:
    """The value of knob `name` ("" reads as unset)."""
    if not CACHE_ENV:
        return os.environ.get(name) or None
    try:
        return _env_cache[name]
    except KeyError:
        v = _env_cache[name] = os.environ.get(name) or None
        return v


_on_reload: list = []


def on_reload(fn) -> None:
    """Call fn() whenever reload_env() runs (caches of decisions derived from the knobs)."""
    _on_reload.append(fn)


def reload_env() -> None:
    """Forget the knob values read so far (and the plans derived from them)."""
    _env_cache.clear()
    for fn in _on_reload:
        fn()


def forced_backend() -> str | None:
    """FP8LINEAR_BACKEND=reference|triton|sm90 forces a backend (tests, benchmarks)."""
    v = env(_ENV)
    if not v:
        return None
    if v not in BACKENDS:
        raise ValueError(f"{_ENV}={v!r}: expected one of {', '.join(BACKENDS)}")
    return v


def pdl_enabled() -> bool:
    """Programmatic dependent launch for our kernels (CUDA and Triton): a kernel's prologue and
    first loads overlap the previous kernel's tail. FP8LINEAR_PDL=0 turns it off (e.g. to
    rule it out when debugging)."""
    return env("FP8LINEAR_PDL") != "0"


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


@functools.lru_cache(maxsize=None)
def _check_sm90_device(index: int) -> None:
    # A forced sm90 backend on another GPU would build for sm_90a and fail at launch: say so
    # before anything runs (BuildError names the GPU's compute capability).
    from . import build
    build.device_arch(index)


def _module(name: str):
    if name == "reference":
        return reference
    if name == "triton":
        from . import triton_gemm
        return triton_gemm
    from . import sm90
    return sm90


def backend_for(device: torch.device, m: int, n: int, k: int):
    """The backend module for one call (see the module docstring)."""
    forced = forced_backend()  # once: an environment read costs host time on every call
    if device.type != "cuda":
        # No GPU: the torch reference is the only path (and the definition of the numerics).
        if forced not in (None, "reference"):
            warnings.warn(f"{_ENV}={forced} ignored for a {device.type} tensor: "
                          f"using the torch reference", stacklevel=3)
        return reference
    name = forced or _cuda_default(device.index or 0)
    if forced == "sm90":
        _check_sm90_device(device.index if device.index is not None else
                           torch.cuda.current_device())
    if name == "sm90" and not sm90_shape_ok(n, k):
        if forced == "sm90":
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


# --------------------------------------------------------------------------- sm90 plans
SM90_DECODE_TILES = (8, 16, 32, 64, 128)  # token tile of decode config i = 8 << i
SM90_DECODE_MAX_M = 32
# weight rows a decode CTA owns: 64 (token tiles <= 64), 128, or 72..120 (a multiple of 8) in a
# 128-row CTA, one an SM
SM90_DECODE_ROWS = tuple(range(64, 129, 8))
SM90_DECODE_ROWS64_MAX_BT = 64
# The decode kernel quantizes the activations itself for up to 16 tokens and short enough
# slices (see sm90_fuse_quant).
SM90_FUSE_QUANT_MAX_M = SM90_DECODE_TILES[1]
SM90_FUSE_QUANT_MAX_GROUPS = 128
_FUSE_QUANT = "FP8LINEAR_SM90_FUSE_QUANT"
# dynamic shared memory of a decode CTA by CTAs an SM (csrc/sm90/decode.cu: smem_limit)
SM90_DECODE_SMEM = {1: 232448, 2: 115712}


# weights from which 17-32 tokens take the large-M tiles over an unsplit decode grid (sm90_plan)
SM90_TILES_OVER_DECODE_MIN_BYTES = 100_000_000
SM90_DECODE_TWO_PER_SM_MAX_BT = 32
_FORCE_DECODE_CTAS = "FP8LINEAR_SM90_DECODE_CTAS"
# (dev knobs for sweeps: the decode CTA's weight rows, 64 or 128, and its K split count)
_FORCE_DECODE_ROWS = "FP8LINEAR_SM90_DECODE_ROWS"
_FORCE_DECODE_SPLITS = "FP8LINEAR_SM90_DECODE_SPLITS"
# Token count up to which the split-K decode kernel runs (default SM90_DECODE_MAX_M; up to
# 256 with 128-token tiles): benchmarks compare it with the large-M tiles at mid M.
_DECODE_MAX_M = "FP8LINEAR_SM90_DECODE_MAX_M"


def _decode_ctas_per_sm(bt: int, kbs: int, rows: int, forced: str | None) -> int:
    if forced:
        if forced not in ("1", "2"):
            raise ValueError(f"{_FORCE_DECODE_CTAS}={forced!r}: expected 1 or 2")
        # (the scale state must still leave a ring of >= 2 stages in half the memory)
        fits = bt <= SM90_DECODE_TWO_PER_SM_MAX_BT and kbs * (bt + rows) * 4 <= 65536
        return 2 if forced == "2" and fits else 1
    # Two CTAs an SM (half the shared memory, 80 registers a thread: token tiles <= 32 only)
    # leave room for the next GEMM's CTAs beside ours, so under PDL they stream their weights
    # while we reduce and exit, instead of the launch, ring fill and reduction of every
    # decode GEMM running back to back. Needs the per-CTA scale state (token and per-row
    # weight scales of the K range) to leave room for a ring in half the memory.
    # Measured (H100): with an elementwise kernel between GEMMs, 1.1-1.3 us faster on 15-17 MB
    # weights (K ranges of <= 8 blocks a CTA); 3 us slower back to back on 117 MB weights,
    # whose long K ranges gain nothing from an earlier start and lose ring depth. Hence short
    # K ranges only.
    if bt <= SM90_DECODE_TWO_PER_SM_MAX_BT and kbs <= 16:
        return 2
    return 1


def _decode_four_splits(num_kb: int, tiles: int, splits: int, num_sms: int):
    """(splits, CTAs an SM) for a 64-row plan that splits K (2 or 3 ways) at one CTA an SM, its
    K ranges too long for two CTAs an SM (> 16 blocks): 4 splits at two an SM wherever each
    range is then <= 16 blocks and the grid fits in one wave: twice the CTAs stream, each a
    shorter K range. The read ceiling (scripts/dev_read_ceiling.py: a decode GEMM with free
    math; results/2026-11-26_decode_read_ceiling_h100.log) reaches 101% of the weight-read floor
    on 4096x7168 back to back at 4 splits and 2 CTAs an SM against 84% for our 2 and 1.
    Measured (H100, M = 1-16, same log; block_fp8_gemm; fp8_linear gains alike, and at 5-7
    tokens on 4096x7168 quantizes inside the GEMM now that a CTA's K range is short: +5-14%):
    4096x7168 x 1-6 back to back 11.3 -> 10.7 us (84 -> 88% of the floor), after an elementwise
    kernel, a PDL-aware norm or our fused norm +1-2%; on 4096x8192, 4096x6144, 3584x7168,
    3072x7168, 3072x8192, 2560x8192 (geomean by mode) back to back +3-12%, after an elementwise
    kernel +2-6%, after our fused norm +0-18% (the losses: 3072x8192 x 16 after our fused norm
    -7%, fp8_linear on 2560x8192 x 1-4 back to back -6%). More splits to fill both slots of
    every SM (5-6 on the 3072- and 2560-row weights) lose after our fused norm (up to 25%).
    Unsplit plans stay unsplit: a split adds the reduction (6144x4096 at 2 splits and 2 CTAs an
    SM: 6% faster back to back, 9-12% slower after a kernel)."""
    if splits < 4 <= num_kb and tiles * 4 <= 2 * num_sms and cdiv(num_kb, 4) <= 16:
        return 4, 2
    return splits, 1


def _decode_rows(n: int, m_tiles: int, num_sms: int) -> int:
    tiles64 = cdiv(n, 64) * m_tiles
    # 64 weight rows a CTA (the two math warpgroups on alternate K blocks) give twice the CTAs
    # of 128, so the same SMs stream with half the K splits, or none: no split reduction at
    # the end of the kernel (its write / fence / count / read chain is ~2 us). Worth it while
    # the 64-row tiles fit in one wave; past that, a second partial wave costs more
    # (10240x8192: 160 tiles, 38.0 vs 33.5 us; 28672x4096 44.8 vs 40.0), unless there are so
    # many waves that the finer last one wins (57344x8192, 896 tiles: 158.4 vs 161.5).
    # Measured at M = 1/8/16, H100, results/2026-11-23_decode_rows64_sweep_h100.log, back to
    # back: 7168x2048 7.74 -> 5.13 us, 4096x7168 14.05 -> 11.65, 6144x4096 12.17 -> 10.10,
    # 4096^2 9.01 -> 8.35, 8192^2 23.6 -> 22.6; with an elementwise kernel between GEMMs
    # 0.4-1.3 us less on the same shapes.
    # (64-row CTAs owning fewer rows, so that one wave fills the SMs where 64-row ones leave
    # a quarter idle, e.g. 6144 rows as 128 CTAs of 48: 1-8% faster back to back, no faster
    # after an elementwise kernel, up to 16% slower for fused fp8_linear back to back;
    # results/2026-11-25_decode_row_step_h100.log. Not kept.)
    if tiles64 <= num_sms or tiles64 >= 6 * num_sms:
        return 64
    # Between one wave of 64-row CTAs and two of 128-row ones (N = 8.5K-17K rows at M <= 32),
    # 128-row CTAs that each own only as many rows (a multiple of 8) as make one full wave:
    # 10240 rows as 128 CTAs of 80 rather than 80 CTAs of 128 (52 SMs idle) or 160 of 64 (a
    # second wave). The CTA's TMA box has that many rows; the rest of its 128-row stage is
    # never stored. DeepGEMM's tile here is 64x80 (non-swapped) for the same reason.
    fill = cdiv(cdiv(n, max(1, num_sms // m_tiles)), 8) * 8
    return fill if fill < 128 else 128


def _switch(name: str) -> str | None:
    """An on/off knob's setting: None (unset: the heuristic decides), "0" or "1"."""
    v = env(name)
    if v not in (None, "0", "1"):
        raise ValueError(f"{name}={v!r}: expected 0 or 1")
    return v


_DECODE_CLUSTER = "FP8LINEAR_SM90_DECODE_CLUSTER"
SM90_DECODE_CLUSTER_MAX_SPLITS = 8  # the portable cluster size


def sm90_decode_cluster_reduce(config: int, splits: int) -> bool:
    """Reduce a decode tile's K splits inside one cluster, through distributed shared memory,
    instead of through an fp32 workspace in L2?

    The workspace reduction is a chain of global round trips at the end of every decode GEMM
    (write the partial, fence, count, read the others' partials). In a cluster the partials
    stay in shared memory: two cluster barriers. But a cluster launch costs time too, and
    only PDL hides it. Measured (H100, results/2026-11-23_decode_cluster_ab_h100.log, M=1-16):
    back to back under PDL the cluster is 0.4-0.9 us faster at 2-7 splits; after an ordinary
    kernel (an elementwise op between GEMMs, as in a model) it is 0.35-0.65 us faster at 2
    splits (7168x2048, 6144x4096) but 0.3-1.2 us slower at 4-7 (4096^2, 2112x7168, 4096x7168).
    Hence pairs only. Clusters must also fit in one GPC (16-18 SMs): with one CTA an SM
    (long K ranges, where the reduction is a small share) they could strand SMs at each GPC's
    edge, so those keep the workspace. (The 'spread' cluster scheduling policy changed
    nothing.) Since the workspace handshake became one acq_rel atomic (session 11, no
    __threadfence from every thread) it beats the cluster for pairs too: 4096^2 at M = 1-16,
    results/2026-11-25_decode_plan_sweep_h100.log, workspace vs cluster +7.8% / +6.1%
    (block_fp8_gemm / fp8_linear) back to back, +3.1% / +3.1% after an elementwise kernel.
    So the default is off. FP8LINEAR_SM90_DECODE_CLUSTER=1 uses it wherever it can run (2..8
    splits, token tiles <= 32).
    """
    v = _switch(_DECODE_CLUSTER)
    can = (2 <= splits <= SM90_DECODE_CLUSTER_MAX_SPLITS
           and SM90_DECODE_TILES[config] <= SM90_DECODE_TWO_PER_SM_MAX_BT)
    return v == "1" and can


_DECODE_EARLY_TRIGGER = "FP8LINEAR_SM90_DECODE_EARLY_TRIGGER"


def sm90_decode_early_trigger(plan, tiles: int, num_sms: int) -> bool:
    """Let the next kernel launch (PDL) as soon as the decode kernel starts, rather than after
    its prologue? Only a PDL-launched next kernel (our next GEMM or quant kernel) is affected.

    Early, the next GEMM's CTAs take the SM room ours leave and stream their weights during
    our K loop and split reduction: back to back (H100, M = 1-16,
    results/2026-11-23_decode_rows64_sweep_h100.log) 2112x7168 9.1 -> 7.2 us, 4096^2 8.35 ->
    7.8, 32768x512 6.95 -> 6.33. But where our grid has no split reduction to hide and leaves
    SMs free (one unsplit wave of fewer CTAs than SMs), the early CTAs only compete with our
    weight stream: session 11, results/2026-11-25_decode_trigger_ab_h100.log, back to back,
    after the prologue instead: 7168x2048 (112 CTAs) -3 to -4% block_fp8_gemm / -2 to -6%
    fp8_linear, 6144x4096 (96) -1 to -3%; with splits or over a wave early stays ahead
    (4096^2, 2112x7168: +7 to +27% fp8_linear; 24576x1536, 32768x512: +8 to +12%).
    Those are all plans of two CTAs an SM, where the early CTAs fit beside ours. A split plan
    of one CTA an SM within a wave (4096x14336 at 1-4 tokens; 4096x7168 before it took 4
    splits at two an SM) gains nothing from it: their CTAs wait for ours to leave anyway.
    Session 19, results/2026-11-26_decode_early_trigger_one_cta_h100.log: 4096x7168 x 1-4
    back to back 0.8% faster without (block_fp8_gemm 11.34 -> 11.26 us, fp8_linear 12.06 ->
    11.93), after an elementwise kernel or a PDL-aware norm unchanged; 4096x14336 unchanged
    every way.
    FP8LINEAR_SM90_DECODE_EARLY_TRIGGER=0 / 1 forces it.
    """
    v = _switch(_DECODE_EARLY_TRIGGER)
    if v is not None:
        return v == "1"
    _, _, splits, ctas, _ = plan
    return (splits > 1 and ctas == 2) or tiles * splits > num_sms


def sm90_fuse_quant(m: int, k: int, plan) -> bool:
    """Quantize bf16/fp16 activations inside the decode kernel of ``plan`` (sm90_plan's)?

    Fused, each CTA quantizes its own activation slice (M tokens x its K range, re-done once
    per weight-row tile) into resident shared memory right after griddepcontrol.wait, all 8
    math warps at once, while its weight ring is already filling; unfused, a separate quant
    kernel runs first (~1-4 us on the step's critical path; PDL overlaps only its launch).
    The prologue is not free: it delays the first wgmma by the slice's load and quantization,
    while the quant kernel's time overlaps the GEMM's weight stream under PDL. Measured (H100,
    results/2026-11-23_decode_fused_quant_v2_h100.log, fp8_linear, back to back / after an
    elementwise kernel), by groups of 128 channels a CTA (tokens x K blocks): <= 48 groups,
    or M <= 8 over <= 8 K blocks, fused is 0.1-2.4 us faster (M = 1 on 4096x14336 and
    28672x4096: -2.4 / -0.9 us); from 56 groups it is 0.1-12 us slower. Session 6 (64-row
    CTAs, the early PDL trigger; results/2026-11-23_gemm_narrow_tiles_fuse_h100.log): fused
    wins both ways up to 64 groups (6144x4096 x 2: -2.0 / -1.5 us, 2112x7168 x 4: -2.8 /
    -1.4), from 96-112 only back to back (4096x7168 x 4: -1.5 / +1.0), from 128 neither.
    Session 11 (one reciprocal a group, 16-byte loads; A/B twice,
    results/2026-11-25_decode_quant_exact_ab_h100.log and ..._fuse_limit_ab_h100.log): at
    65-128 groups fused now wins after an elementwise kernel at every point measured (-0.4 to
    -1.1 us: 2112x7168 x 5-8, 6144x4096 x 3-4, 7168x2048 x 5-8, 4096^2 x 5-8, 28672x4096 x
    3-4, 4096x7168 x 3-4) while back to back it loses up to 2.1 us (4096^2 x 8); where the
    two disagree the model-like case decides, hence 128. From 140 groups it loses both ways.
    And the resident fp8 slice must leave most of the shared memory to the weight ring
    (<= a quarter of the CTA's).
    (Session 2's fused kernel quantized one K block ahead of the tensor cores, one warp per
    token with a block barrier per K block: +5 us at 14-16 blocks a CTA, so it was limited
    to <= 8 blocks and M <= 8.) FP8LINEAR_SM90_FUSE_QUANT=0 never fuses (=1: wherever the
    slice fits).
    """
    v = _switch(_FUSE_QUANT)
    if plan[0] != "decode" or m > SM90_FUSE_QUANT_MAX_M or v == "0":
        return False
    _, config, splits, ctas, _ = plan
    kbs = cdiv(cdiv(k, BLOCK), splits)  # K blocks a CTA
    if kbs * SM90_DECODE_TILES[config] * BLOCK > SM90_DECODE_SMEM[ctas] // 4:
        return False
    return v == "1" or m * kbs <= SM90_FUSE_QUANT_MAX_GROUPS


# The large-M kernel's tile configurations, index = config id; mirrors kConfigs in
# csrc/sm90/gemm.cu: (BM, BN, stages, cluster size, share_a, queue_next, split_tail), where a
# cluster pair multicasts the activation tile (share_a) or else the weight tile, queue_next
# gives the two math warpgroups two partial accumulators (the next K block's wgmmas queued
# before a promotion), and split_tail splits the tiles of a ragged last wave along K over the
# idle SMs. 64-row tiles of <= 64 columns are built lean (gemm_lean).
SM90_GEMM_CONFIGS = (
    (128, 128, 5, 1, False, False, False), (64, 128, 8, 1, False, False, False),
    (128, 128, 5, 2, False, False, False), (128, 192, 4, 1, False, False, False),
    (256, 128, 3, 1, False, False, False), (256, 128, 3, 2, True, False, False),
    (64, 64, 12, 1, False, False, False), (128, 64, 8, 1, False, False, False),
    (64, 32, 16, 1, False, False, False), (64, 16, 16, 1, False, False, False),
    (128, 96, 6, 1, False, False, False), (128, 160, 5, 2, False, False, False),
    (64, 48, 15, 1, False, False, False), (128, 128, 5, 1, False, True, False),
    (128, 192, 4, 2, False, False, False), (128, 192, 4, 1, False, False, True))


def gemm_lean(config: int) -> bool:
    """Is large-M config i built lean (<= 128 registers a thread, no setmaxnreg split: its
    CTAs fit beside the previous kernel's on an SM, csrc/sm90/gemm_kernel.cuh kLean)?"""
    bm, bn = SM90_GEMM_CONFIGS[config][:2]
    return bm == 64 and bn <= 64


def gemm_split_tail(config: int) -> bool:
    """Does large-M config i split the tiles of a ragged last wave along K over the idle SMs
    (a workspace of one fp32 tile a CTA and a counter a tile, csrc/sm90/gemm_kernel.cuh
    kSplitTail)?"""
    return SM90_GEMM_CONFIGS[config][6]


SM90_SPLIT_TAIL_MIN_PART_KB = 32


def split_tail_parts(m: int, n: int, k: int, num_sms: int) -> int:
    """Into how many K ranges the split-tail configuration (128x192) would split the tiles of
    its ragged last wave, where that pays (else 0).

    All parts of the tail run in one wave, so the tail takes 1/parts of a whole tile's time;
    each part writes an fp32 tile and the last sums them, a fixed cost that a part must
    amortise. H100, against whole 128x192 tiles (session 27,
    results/2026-11-26_gemm_split_tail_h100.log runs 4-5): 7168x16384 x 640 (58 tail tiles, 2 parts of 64 K blocks) +16-19% interleaved,
    +10% alone; parts of 1-2 K blocks (24576x1536) 5-9% slower, of 28 (2112x7168 x 2304) +1.4%.
    So: a tail of at most half the SMs (two parts or more), parts of >= 32 K blocks. At the
    points this picks (..._gemm_split_tail_rule_h100.log, 16 of them over six shapes at 640-3584
    tokens): 15 faster by 0.7-14% (8192x28672 x 1664 625.8 -> 566.6 us), one 1.6% slower
    (57344x8192 x 1152); none of the benchmark's M is among them."""
    bm, bn = SM90_GEMM_CONFIGS[15][:2]
    units = cdiv(m, bm) * cdiv(n, bn)
    tail = units if units <= num_sms else units % num_sms
    if tail == 0:
        return 0
    num_kb = cdiv(k, BLOCK)
    parts = min(num_kb, num_sms // tail)
    return parts if parts >= 2 and num_kb // parts >= SM90_SPLIT_TAIL_MIN_PART_KB else 0


_FORCE_GEMM = "FP8LINEAR_SM90_GEMM_CONFIG"


# A tile's time per unit of area, relative to 128x128 (measured on full waves):
#   128x192 keeps one partial accumulator (registers); since its promotion selects the
#     second scale block once per K block instead of per 8 columns (session 4), 6144x4096 and
#     2112x7168 at M = 1024-4096 run 0.87-0.9x the time of 128x128 per area -> 0.9 (before:
#     1.63x the time for 1.5x the area, 1.1). Against the 256x128 pairs at M = 1024-8192 on
#     all 14 benchmark shapes (two runs, sessions 20-21, results/2026-11-26_gemm_128x192_
#     vs_pairs_h100.log), the costs that fit the measured ratios put 128x192 at 0.82-0.87 of
#     128x128 (the pairs at 0.87): -> 0.86. Plans that change (17 of those 56 points, e.g.
#     8192^2 x 8192 887 -> 830 us, 28672x4096 x 4096 806 -> 739, 6144x4096 x 8192 345 -> 328):
#     0.995 / 0.991 of the time in geomean over the 56 points, the worst point 1.039 / 1.008;
#     0.85 was as good, 0.84 and below made 4096x14336 x 8192 up to 11% slower.
#   256x128 (two 64-row waves per warpgroup) moves less shared memory and L2 data per FLOP,
#     and since its operand descriptors moved to uniform registers (session 4) it issues the
#     next wave right after a promotion: 0.84-0.89x the time of 128x128 per area on 8192^2,
#     4096x7168, 28672x4096 at M = 2048-8192 -> 0.87 (rounded up, so that near-ties keep the
#     smaller tile).
#   128x64 runs a full wave in 0.69-0.81x the time of a 128x128 wave for half the area
#     (4096x14336: 39.3 us at M=256 vs 57.3 at M=512; 2112x7168: 21.8 at 512 vs 80.7/3 at
#     2048) -> 1.5; it pays where 128-wide tiles leave a wave ragged (2112x7168 x 512: 132
#     tiles of 128x64, 21.8 us, vs 68 of 128x128, 28.5).
_TILE_COST = {(128, 192): 0.86, (256, 128): 0.87, (128, 64): 1.5}


def _waves_x_area(m: int, n: int, num_sms: int, cfg) -> float:
    # A configuration costs its wave count (a last, partial wave costs a full one) times its
    # tile's time. A pair's CTAs take adjacent tiles along M (sharing the weight tile) or N
    # (sharing the activation tile, share_a): an odd tile count there still runs whole pairs
    # (the spare CTA loads its half of the shared tile and stores nothing). Counted as single
    # tiles, 128x160 pairs won the model at M = 513-640 (5 M tiles: 135 pair units, 3 waves,
    # not 2) and lost 1.3-1.7x to 128x192: 7168x16384 x 640 181.8 vs 136.9 us, 3584x7168 x
    # 640 52.2 vs 30.6 (H100, results/2026-11-26_gemm_split_tail_h100.log, sweep 2; the fix
    # checked at M = 640-1664: ..._gemm_waves_whole_pairs_h100.log).
    bm, bn, _, cluster, share_a = cfg[:5]
    tiles_m, tiles_n = cdiv(m, bm), cdiv(n, bn)
    if share_a:
        tiles_n = cdiv(tiles_n, cluster) * cluster
    else:
        tiles_m = cdiv(tiles_m, cluster) * cluster
    return (cdiv(tiles_m * tiles_n, num_sms // cluster * cluster) * bm * bn
            * _TILE_COST.get((bm, bn), 1.0))


def _one_wave_of_64x48(m: int, n: int, num_sms: int) -> bool:
    # 17-64 tokens where one wave of 64x48 tiles fills >= 90% of the SMs (N = 5.7K-6.3K rows,
    # e.g. Llama 8B's qkv_proj, 6144): those, DeepGEMM's tile there, instead of 64x64 ones,
    # whose 96 tiles leave a quarter of the SMs idle. H100, 6144x4096 at M = 17-64,
    # results/2026-11-25_gemm_64x48_h100.log, 64x48 vs 64x64, block_fp8_gemm back to back /
    # after an elementwise kernel / after a PDL-aware norm: 10.6 vs 11.1-11.3 us / 12.1 vs
    # 12.8-13.0 / 10.9-11.0 vs 11.3-11.7; fp8_linear 12.3-12.4 vs 12.1-12.3 (2% slower) /
    # 13.2-13.3 vs 13.8-14.1 / 12.1 vs 12.3-12.6. Where they fill less (5120 rows: 107
    # tiles) 64x64 wins after an elementwise or PDL-aware kernel (2-3%) though not back to
    # back, so not there.
    tiles = cdiv(m, 64) * cdiv(n, 48)
    return m <= 64 and 10 * tiles >= 9 * num_sms and tiles <= num_sms


_GEMM_EARLY_B = "FP8LINEAR_SM90_GEMM_EARLY_B"
_GEMM_EARLY_STAGES = "FP8LINEAR_SM90_GEMM_EARLY_STAGES"
SM90_GEMM_EARLY_B_MAX_M = 256
SM90_GEMM_EARLY_B_SHORT_K_MAX_M = 128   # K loops of < 8 blocks: up to here only
# early stages: lean tiles (small weight stages, CTAs resident beside the previous kernel) /
# full-register tiles (16 KB stages, CTAs placed as the previous kernel's leave)
SM90_GEMM_EARLY_STAGES_LEAN = 8
SM90_GEMM_EARLY_STAGES_FULL = 4
# behind fp8_linear's quant kernel: only at this many tokens or fewer, 4 stages for any tile
SM90_GEMM_EARLY_B_AFTER_QUANT_MAX_M = 128
SM90_GEMM_EARLY_STAGES_AFTER_QUANT = 4


def sm90_gemm_early_weights(m: int, k: int, config: int, after_quant: bool) -> int:
    """How many of its first tile's weight stages the large-M kernel (under PDL) requests
    before griddepcontrol.wait, while the previous kernel still runs (0: none)?

    A few, not the whole ring: the early requests share DRAM with the previous kernel (our
    fused norm or SiLU-and-mul, or the previous GEMM), and a whole ring of them (12-16
    stages) delays that kernel more than it saves (session 17, lean 64x32 tiles after the
    fused norm: 4096^2 x 64 7.90 -> 8.28 us). Session 18, H100, M = 8-128 on nine shapes,
    results/2026-11-26_gemm_early_stages_h100.log, geomean vs session 17's rule (none for
    lean tiles, the whole ring for full-register ones), after our fused norm / fused
    SiLU-and-mul / back to back: lean tiles with 8 stages 1.030 / 1.029 / 1.064 (7168x2048 x
    32 after the norm 7.14 -> 6.38 us, 6144x4096 x 64 11.63 -> 11.23), with 4 1.030 / 1.026 /
    1.037, the whole ring 1.008 / 0.976 / 1.030; full-register tiles with 4 stages 1.009 /
    1.019 / 1.007 (8: 1.000 / 1.001 / 0.999). Behind fp8_linear's quant kernel (which lets
    the GEMM launch at once, so the early loads compete with the quantization) 4 stages for
    any tile up to 128 tokens (session 21, H100, two runs each,
    results/2026-11-26_linear_early_b_small_m_h100.log: fp8_linear at M = 2-16 on the five
    shapes whose plan is the large-M kernel there, back to back -0.2 to -0.85 us, 28672x4096
    x 16 41.86 -> 41.01; after a PDL-aware norm -0.15 to -0.6; after an elementwise kernel
    -0.1 to -0.2; 8 stages no better, lean 4096^2 tiles worse. At 17-64 tokens on all 14
    shapes, runs 3-4: back to back 0.961-0.973 of the time by M, after a PDL-aware norm
    0.982-0.990, after an elementwise kernel 0.992-0.998, 32768x512 x 32 9.78 -> 8.21 us; at
    96-128, runs 4-5: 0.971-0.975 / 0.982-0.984 / 0.989-0.992; at 192 level after an
    elementwise kernel in both, at 256 up to 7% slower on short K). Session 18 had found them a
    loss behind the quant kernel over 8-256 tokens (4 stages 1.005 geomean, min 0.970). Up to
    256 tokens (at 192 / 256 on all 14
    benchmark shapes, ..._gemm_early_stages_h100.log run 3: 1.028 / 1.022 / 1.022 geomean;
    2112x7168 x 256 back to back 11.9 -> 11.3 us), where the K loop has 8 blocks or more: over
    4 K blocks the stages are most of a tile, and after the fused kernels they slowed the
    256-token GEMM (32768x512 x 256: 14.6 -> 15.9 us; run 4). FP8LINEAR_SM90_GEMM_EARLY_B=0 /
    1 forces it off / on, FP8LINEAR_SM90_GEMM_EARLY_STAGES=n sets the count (at most the ring).
    """
    ring = SM90_GEMM_CONFIGS[config][2]
    stages = _forced_int(_GEMM_EARLY_STAGES, range(1, 65))
    if stages is None:
        if after_quant:
            stages = SM90_GEMM_EARLY_STAGES_AFTER_QUANT
        else:
            stages = (SM90_GEMM_EARLY_STAGES_LEAN if gemm_lean(config)
                      else SM90_GEMM_EARLY_STAGES_FULL)
    stages = min(stages, ring)
    v = _switch(_GEMM_EARLY_B)
    if v is not None:
        return stages if v == "1" else 0
    if after_quant:
        max_m = SM90_GEMM_EARLY_B_AFTER_QUANT_MAX_M
    else:
        max_m = SM90_GEMM_EARLY_B_MAX_M if cdiv(k, BLOCK) >= 8 else SM90_GEMM_EARLY_B_SHORT_K_MAX_M
    return stages if m <= max_m else 0


SM90_GEMM_PAIR192_MIN_M = 2048
SM90_GEMM_PAIR192_MIN_WEIGHTS = 1 << 27  # N x K elements (128 MiB of fp8 weights)
SM90_GEMM_PAIRS_OVER_192_MIN_M = 4096

_GEMM_GROUP_M = "FP8LINEAR_SM90_GEMM_GROUP_M"
SM90_GEMM_GROUP_M = 8
SM90_GEMM_GROUP_M_LONG = 4         # from 4096 tokens over >= 64 K blocks
SM90_GEMM_GROUP_M_LONG_MIN_M = 4096
SM90_GEMM_GROUP_M_LONG_MIN_KB = 64
SM90_GEMM_GROUP_M_SHORT = 16       # from 2048 tokens over < 64 K blocks
SM90_GEMM_GROUP_M_SHORT_MIN_M = 2048


def sm90_gemm_group_m(m: int, k: int) -> int:
    """The large-M kernel's tile order walks bands of this many M units (a unit: an M block,
    or a pair of them where pairs share the weight tile), all N units inside a band, so that
    the CTAs running at the same time share activation rows and weight rows in L2.

    8, but 4 from 4096 tokens where K has >= 64 blocks of 128, and 16 from 2048 tokens where
    it has fewer. Why is not modelled: the L2 hints keep both operands (evict_last;
    evict_normal was up to 38% slower at 1024-8192 tokens, session 21), and a guess is that
    the band of 8 units' activation rows (8 x 256 rows x K, 56 MB at K = 28672) crowds out the
    weights the band's units share; under ncu (locked clocks, one launch) the bands made no
    difference. H100, two runs on two machines,
    results/2026-11-26_gemm_tile_order_bands_h100.log, block_fp8_gemm at 1024-8192 tokens on
    the 14 shapes: band 4 57344x8192 x 4096 -6% / -4.4%, x 8192 -3.8% / -3.2%, 8192x28672 x
    8192 -3.6% / -1.5%, the other shapes with >= 64 K blocks at 4096-8192 within +-1.2%; it
    lost on short K (32768x512 +8-12%, 24576x1536 +2-4%) and on 6144x4096 x 4096 (+2.2%
    twice), and at 2048 tokens (8192^2, 10240x8192: +3% with a band of 2). A band of 2 was
    better still on the two big-N shapes (-2% against 4) but worse at K = 4096. Over fewer K
    blocks a band of 16 was 0.5-2.6% faster at 2048-4096 tokens in both runs (24576x1536,
    32768x512, 7168x2048, 6144x4096; 6144x4096 x 8192 -3% / -1.1%), at most +0.8% elsewhere
    (4096x7168 x 4096), level at 1024 tokens (24576x1536 x 1024 +1.6% once); with long K at
    8192 tokens it lost up to 7% (8192x28672).
    FP8LINEAR_SM90_GEMM_GROUP_M=n forces the band."""
    forced = _forced_int(_GEMM_GROUP_M, range(1, 1025))
    if forced is not None:
        return forced
    num_kb = cdiv(k, BLOCK)
    if m >= SM90_GEMM_GROUP_M_LONG_MIN_M and num_kb >= SM90_GEMM_GROUP_M_LONG_MIN_KB:
        return SM90_GEMM_GROUP_M_LONG
    if m >= SM90_GEMM_GROUP_M_SHORT_MIN_M and num_kb < SM90_GEMM_GROUP_M_LONG_MIN_KB:
        return SM90_GEMM_GROUP_M_SHORT
    return SM90_GEMM_GROUP_M


def forced_gemm_config() -> int | None:
    """FP8LINEAR_SM90_GEMM_CONFIG=i forces the large-M kernel with config i at every M
    (tests cover each configuration; benchmarks compare them)."""
    v = env(_FORCE_GEMM)
    if not v:
        return None
    i = int(v)
    if not 0 <= i < len(SM90_GEMM_CONFIGS):
        raise ValueError(f"{_FORCE_GEMM}={v!r}: expected 0..{len(SM90_GEMM_CONFIGS) - 1}")
    return i


def sm90_plan(m: int, n: int, k: int, num_sms: int, after_quant: bool = False):
    """-> ("decode", config, splits, ctas_per_sm, rows) or ("gemm", config). fp8_linear asks
    sm90_fuse_quant whether a decode plan also quantizes the activations itself, and passes
    after_quant: its large-M GEMM runs behind our quant kernel under PDL."""
    forced = forced_gemm_config()
    if forced is not None:
        return ("gemm", forced)
    # (the decode CTA count per SM, rows, splits and range can be set too: part of the cache key)
    return _sm90_plan(m, n, k, num_sms, decode_max_m(), env(_FORCE_DECODE_CTAS),
                      _forced_int(_FORCE_DECODE_ROWS, SM90_DECODE_ROWS),
                      _forced_int(_FORCE_DECODE_SPLITS, range(1, 1025)), after_quant)


def _forced_int(name: str, allowed) -> int | None:
    v = env(name)
    if v is None:
        return None
    if not v.isdigit() or int(v) not in allowed:
        raise ValueError(f"{name}={v!r}: expected one of {allowed}")
    return int(v)


def decode_max_m() -> int:
    v = env(_DECODE_MAX_M)
    if not v:
        return SM90_DECODE_MAX_M
    top = SM90_DECODE_TILES[-1] * 2
    if not v.isdigit() or not 1 <= int(v) <= top:
        raise ValueError(f"{_DECODE_MAX_M}={v!r}: expected 1..{top}")
    return int(v)


@functools.lru_cache(maxsize=4096)
def _sm90_plan(m: int, n: int, k: int, num_sms: int, decode_max: int = SM90_DECODE_MAX_M,
               forced_ctas=None, forced_rows=None, forced_splits=None, after_quant=False):
    # Cached: the same shapes repeat every step.
    num_kb = cdiv(k, BLOCK)
    # the rules that move decode sizes to the large-M tiles stand aside for the decode knobs
    decode_knobs = (decode_max != SM90_DECODE_MAX_M or forced_rows is not None
                    or forced_splits is not None or forced_ctas is not None)
    # 64x64 tiles of the large-M kernel: twice the CTAs of 64x128, for the middle of the M
    # range where too few tiles would leave SMs idle; only while they fit in one wave.
    tiles64 = cdiv(m, 64) * cdiv(n, 64)
    if (SM90_DECODE_TILES[1] < m <= min(SM90_DECODE_TILES[2], decode_max) and num_kb <= 32
            and tiles64 <= num_sms and forced_rows is None):
        # 17-32 tokens over a short K: one wave of 64x64 tiles beats the split-K decode
        # kernel's 32-token tiles (H100, M=32, results/2026-11-23_midm_sweep_h100.log: 4096^2
        # 9.3 vs 10.0 us, 7168x2048 8.0 vs 8.6, 6144x4096 12.1 vs 13.9); with more K blocks
        # decode stays ahead (its time first: 2112x7168 10.2 vs 14.2, 8192^2 25.1 vs 26.6)
        # except on 4096x7168 (16.1 vs 14.8).
        return ("gemm", 12 if _one_wave_of_64x48(m, n, num_sms) else 6)
    # Few weight rows (DeepSeek-V3's 1536x7168, 576x7168) at 33-64 tokens also take the
    # decode kernel: the large-M kernel's narrowest tiles (64x16) there leave over a quarter
    # of the SMs idle and each re-reads the whole activation, where the decode kernel's K
    # splits read a quarter of it or less. H100, M = 33/48/64,
    # results/2026-11-24_decode_few_rows_midm_h100.log, fp8_linear back to back / after an
    # elementwise kernel: 1536x7168 15.3 -> 12.2 / 15.4 -> 13.8 us, 576x7168 15.0 -> 10.2 /
    # 15.2 -> 10.8. Where 64x16 tiles fill the SMs (2112x7168: 132 of them) the large-M kernel
    # wins since its loads are issued by an elected thread (session 8,
    # results/2026-11-24_midm_tiles_sweep_h100.log: M=64 8.9 vs 11.6 us, M=48 9.6 vs 11.7).
    # 8-32 tokens where one wave of the large-M kernel's 64x32 tiles fills at least 3/4 of the
    # SMs (N = 3.2K-4.2K rows, e.g. Llama 8B's o_proj and down_proj): those tiles, not the
    # split-K decode kernel (no split reduction at the end; each CTA streams 32 whole rows).
    # After an elementwise kernel, as in a model (H100, block_fp8_gemm / fp8_linear,
    # results/2026-11-25_m1_16_decode_vs_tiles_h100.log at M = 8-16 and
    # ..._n4096_m8_32_tiles_h100.log at 24-32): 4096^2 1.10 / 1.03-1.11x, 4096x7168 1.06-1.13 /
    # 1.06-1.14x, 4096x14336 1.04-1.09 / 1.04-1.09x; back to back 0.92-0.99 / 0.87-1.03x, where
    # PDL hides the decode kernel's reduction behind the previous GEMM. At 2-4 tokens fp8_linear's
    # fused quantization makes decode as fast after an elementwise kernel and faster back to
    # back; where 64x32 tiles fill only half the SMs (2112x7168) decode wins both ways.
    # (4096^2 at 17-32 tokens takes the 64x64 tiles above: the same time.)
    if (8 <= m <= SM90_DECODE_TILES[2] and 3 * num_sms <= 4 * cdiv(n, 32) <= 4 * num_sms
            and not decode_knobs):
        return ("gemm", 8)
    few_rows = (SM90_DECODE_TILES[2] < m <= SM90_DECODE_TILES[3]
                and 4 * cdiv(n, 16) < 3 * num_sms and forced_rows is None)
    if m <= decode_max or few_rows:
        # Up to 32 tokens (the default decode_max) decode is bound by reading the weights
        # once. Swap-AB puts the tokens on wgmma's narrow side: the smallest token tile >= M
        # wastes no tensor-core work on padding (past 128 tokens, 128-token tiles).
        config = next((i for i, t in enumerate(SM90_DECODE_TILES) if t >= m),
                      len(SM90_DECODE_TILES) - 1)
        bt = SM90_DECODE_TILES[config]
        rows = forced_rows or _decode_rows(n, cdiv(m, bt), num_sms)
        if bt > SM90_DECODE_ROWS64_MAX_BT and rows == 64:
            rows = 128
        tiles = cdiv(n, rows) * cdiv(m, bt)
        # Split K until every SM streams weights; the largest split count that still fits in
        # one wave (tiles * splits <= SMs) avoids a second, mostly idle wave.
        splits = forced_splits or max(1, min(num_kb, num_sms // tiles))
        # Shared memory holds the token scales of the CTA's whole K range (<= 32 KB).
        max_kb = 32768 // (bt * 4)
        splits = min(max(splits, cdiv(num_kb, max_kb)), num_kb)
        # (CTAs owning fewer rows than 64 / 128 run one an SM: csrc/sm90/decode_kernel.cuh)
        ctas = (_decode_ctas_per_sm(bt, cdiv(num_kb, splits), rows, forced_ctas)
                if rows in (64, 128) else 1)
        if (rows == 64 and splits > 1 and ctas == 1 and bt <= 16 and forced_splits is None
                and forced_ctas is None):  # (measured with token tiles of 8 and 16)
            splits, ctas = _decode_four_splits(num_kb, tiles, splits, num_sms)
        # 17-32 tokens where the decode grid needs no K split to fill the SMs (many weight
        # rows) and either each CTA streams a short K range (<= 12 blocks) or the weights are
        # large (>= 100 MB): the large-M tiles, as picked for 33-64 tokens below. After an
        # elementwise kernel, as in a model, they win (H100, M = 17/24/32,
        # results/2026-11-25_m17_32_decode_vs_tiles_h100.log, block_fp8_gemm / fp8_linear):
        # 32768x512 10.9 -> 9.2 / 11.8 -> 10.1 us, 24576x1536 17.5 -> 16.4 / 18.5 -> 17.2,
        # 28672x4096 44.4 -> 42.6 / 45.7 -> 43.5, 57344x8192 +3-4%, 7168x16384 +2-3%,
        # 8192x28672 +1-2%; back to back they lose 0-6% (the decode kernel's launch, ring
        # fill and tail hide behind the previous GEMM under PDL, which a model step rarely
        # offers) except 57344x8192 (+1-3%). On mid-size weights (8192^2, 10240x8192,
        # 12288-14336x4096, 6144x7168: 1-3% faster after an elementwise kernel, 2-12% slower
        # back to back) and where the decode kernel splits K (2112x7168: 19-24% slower both
        # ways) decode stays.
        # From 2 tokens, the same where the decode grid takes more than one wave (the most
        # rows: 28672x4096, 57344x8192; M = 2-16,
        # results/2026-11-25_m1_16_decode_vs_tiles_h100.log): after an elementwise kernel
        # block_fp8_gemm 1.04-1.07x / 1.03-1.04x, fp8_linear 1.02-1.05x / 1.02-1.04x; back to
        # back 0.97-0.98x / 1.02x, fp8_linear 0.98-1.02x / 1.01-1.02x. (One-wave grids lose
        # back to back by up to 19%: 32768x512, 24576x1536.)
        multi_wave = tiles > ctas * num_sms
        tiles_instead = splits == 1 and not decode_knobs and (
            (SM90_DECODE_TILES[1] < m <= SM90_DECODE_TILES[2]
             and (num_kb <= 12 or n * k >= SM90_TILES_OVER_DECODE_MIN_BYTES))
            or (2 <= m <= SM90_DECODE_TILES[2] and multi_wave))
        if not tiles_instead:
            return ("decode", config, splits, ctas, rows)
    # From 33 tokens the large-M kernel's 64-row tiles beat the decode kernel's 64-token
    # tiles nearly everywhere (H100, M=64, results/2026-11-23_midm_sweep_h100.log: 24576x1536
    # 16.8 vs 20.1 us, 32768x512 8.9 vs 11.2, 57344x8192 168 vs 177, 8192x28672 83.1 vs 86.9,
    # 4096x7168 14.6 vs 15.8; within 1% on 4096x14336 and 8192^2). (Not for its reduction's
    # loads: with four times as many in flight it ran no faster.) With 64-row decode CTAs
    # (session 6, results/2026-11-23_decode_midm_rows64_h100.log, M = 40/64) decode wins back
    # to back on 2112x7168 (11.5 vs 14.0 us) but after an elementwise kernel, as in a model,
    # it loses nearly everywhere (4096^2 14.1 vs 9.4, 7168x2048 11.3 vs 7.9): under PDL its
    # launch, ring fill and split reduction hide behind the previous GEMM, which no model
    # step offers.
    # 64-row tiles when 128-row ones would leave most SMs idle (twice the CTAs).
    tiles128 = cdiv(m, 128) * cdiv(n, 128)
    if tiles128 < num_sms // 2:
        # ... and 64x64 ones when even those fit in one wave (M=128: 4096^2 11.8 vs 13.5 us,
        # 2112x7168 16.7 vs 19.5; M=256 2112x7168 17.0 vs 19.6) ...
        # ... and 64x32 / 64x16 ones up to 128 tokens when those still fit in one wave: more
        # SMs streaming the weights (H100, results/2026-11-23_gemm_narrow_tiles_fuse_h100.log,
        # back to back / after an elementwise kernel: 2112x7168 x 64 with 64x16 tiles 12.9 /
        # 12.8 us vs 14.0 / 14.0; x 128 with 64x32 13.3 / 13.3 vs 13.8 / 13.9; 4096x14336 x 64
        # 24.8 / 25.7 vs 25.9 / 26.6). Where they would take a second wave they lose badly
        # (7168x2048 x 64: 9.2 vs 7.9), and so do pairs multicasting the activation tile
        # (tried, session 6: 15.0 vs 12.9).
        if SM90_DECODE_TILES[2] < m <= 128:
            for config, bn in ((9, 16), (8, 32)):
                if cdiv(m, 64) * cdiv(n, bn) <= num_sms:
                    return ("gemm", config)
        if m <= 64 and _one_wave_of_64x48(m, n, num_sms):
            return ("gemm", 12)
        if tiles64 <= num_sms:
            return ("gemm", 6)
        # ... and where 64x64 tiles would take two waves, one wave of 128x64 ones before
        # 64x128 (H100, results/2026-11-24_midm_tiles_sweep_h100.log: 8192^2 x 128 25.9 vs
        # 26.9 us, 4096x14336 x 256 32.3 vs 34.0, 4096x7168 x 256 17.0 vs 17.8, 4096^2 x 256
        # 10.6 vs 11.0; a tie on 6144x4096 and 7168x2048 x 128).
        # ... except where 128-row tiles would leave a quarter or more of their rows empty
        # (M = 129-192) and one wave of 64x128 ones fits: fewer wasted rows (DeepGEMM picks
        # 64-row tiles there too). H100, results/2026-11-24_gemm_midm_192_h100.log, M = 136 /
        # 160 / 192, block_fp8_gemm back to back: 4096x7168 15.7 / 15.6 / 16.0 us vs 17.6 /
        # 17.3 / 17.4 with 128x64, 4096x14336 30.0 / 30.5 / 31.0 vs 33.8 / 32.7 / 33.1;
        # fp8_linear after an elementwise kernel mixed, 2% faster over those points (4096^2
        # -7 to -11%, 4096x7168 x 160-192 +5%).
        if (128 < m and cdiv(m, 64) * 64 < cdiv(m, 128) * 128
                and cdiv(m, 64) * cdiv(n, 128) <= num_sms):
            return ("gemm", 1)
        if m > 64 and cdiv(m, 128) * cdiv(n, 64) <= num_sms:
            return ("gemm", 7)
        return ("gemm", 1)
    # The fewest waves x tile time among 128x128, 256x128, 128x192 and 128x64 (N = 2112: 11
    # full 192-column tiles instead of 16.5, or 33 of 64); ties keep the first listed.
    # Below 512 tokens also 64x128 and 64x64 (M=64: 28672x4096 44.5 us with 64x128 vs 48.8
    # with 128x128, 24576x1536 16.8 with 64x64; M=128: 24576x1536 17.7 with 64x128 vs 20.0,
    # 57344x8192 172 vs 181), 128x192 from 256 (M=256: 10240x8192 42.0 vs 52.3 with 256x128
    # pairs, 57344x8192 216 vs 229, 24576x1536 22.9 vs 23.5); at 128 it lost (24576x1536
    # 19.1 vs 17.7). (session 5's sweep; before the 128x192 promotion fix of session 4 it
    # lost at 256 too.)
    # 256x128 tiles always run as pairs whose leader multicasts the shared activation tile
    # (config 5, the same waves x area as unpaired config 4): a third less L2 -> SM traffic;
    # 3-8% faster than unpaired 256x128 on 8192^2, 28672x4096, 4096x7168, 2112x7168 at M =
    # 2048-8192 (H100, session 4). (Before the pair released its stages with one instruction
    # for both lanes, it was 1-5% slower.)
    # (64x64 only up to 64 tokens: above, its small tiles' L2 traffic per FLOP shows, e.g.
    # 10240x8192 x 128 42.6 us against 35.9 with one wave of 128x128.)
    candidates = ((0, 5, 3, 7) if m >= 512 else (0, 1, 5, 3, 7) if m >= 256
                  else (0, 1, 5, 7) if m > 64 else (0, 1, 5, 7, 6))
    # (At 129-192 tokens ties between 64x128 and 128x128 went to 64x128 until session 12:
    # session 6 measured 8192^2 x 192 36.7 vs 41.2 us. Since the 128-row tiles' single
    # partial and unrolled loop (session 10) 128x128 wins them: one wave of 112-128 tiles
    # instead of 1.3-1.5 of 64x128, M = 136-192, 7168x2048 / 7168x16384 / 8192^2 /
    # 8192x28672, block_fp8_gemm back to back 1.13x geomean, after an elementwise kernel
    # 1.22x, fp8_linear after one 1.21x (8192^2 x 192 34.0 -> 29.6 us, 8192x28672 x 136
    # 110.7 -> 96.9); results/2026-11-25_midm_129_192_h100.log.)
    # DeepGEMM's widths (session 10, results/2026-11-24_gemm_bn96_160_ab_h100.log, forced
    # configs against the heuristic's pick, back to back): 128x160 pairs sharing the weight
    # tile at 256-1024 tokens (10240x8192 x 256 / 512 / 1024: 39.5 -> 36.9, 73.3 -> 66.4,
    # 132.8 -> 130.8 us, DeepGEMM 37.7 / 66.4 / 151.7; 2112x7168 x 1024 29.3 -> 28.6) and
    # one wave of 128x96 tiles at 129-511 tokens (6144x4096 x 192 / 256: 17.2 -> 13.3, 14.6
    # -> 13.5; DeepGEMM 15.0 / 13.5). Listed last (ties keep the older tiles) and only where
    # measured: 128x96 lost at 512 tokens though it makes fewer waves (6144x4096: 24.4 vs
    # 21.5 us), 128x160 pairs above 2048 (10240x8192 x 4096 forced: 522.7 vs 499.9 with
    # 256x128 pairs); where either takes more waves than the others it loses as the waves
    # say (57344x8192, 8192^2 at M >= 256). At 1025-2048 tokens the 128x160 pairs win
    # wherever waves x area picks them over 128x192 (ragged N: 2112x7168 x 2048 176 tiles of
    # 128x192 in 1.33 waves): 11 points, N = 1536-10240, K = 4096-8192, two runs with the
    # order swapped, 1.05-1.10x geomean by M, each point 1.01-1.15x (2112x7168 x 2048 59.5 ->
    # 54.7 us, DeepGEMM 65.5; 3584x7168 x 1280 60.5 -> 54.4; H100, session 27,
    # results/2026-11-26_gemm_128x160_pairs_to_2048_h100.log).
    if 256 <= m <= 2048:
        candidates += (11,)
    if 128 < m < 512 and cdiv(m, 128) * cdiv(n, 96) <= num_sms:
        candidates += (10,)
    def cost(c):
        return _waves_x_area(m, n, num_sms, SM90_GEMM_CONFIGS[c])
    best = min(candidates, key=cost)
    if best == 3 and m >= SM90_GEMM_PAIR192_MIN_M and n * k >= SM90_GEMM_PAIR192_MIN_WEIGHTS:
        # Weights of >= 128M elements at >= 2048 tokens: 128x192 tiles as pairs sharing the
        # weight tile (config 14: vertically adjacent tiles, each CTA loading half of it and
        # multicasting it to both). Every band of the tile order streams the whole weight from
        # DRAM once (it far exceeds the L2), and a pair halves the bands (a unit is two M
        # blocks), so the DRAM traffic for weights halves. Smaller weights lose 1-3% (the pair's
        # cluster scheduling; 6144x4096, 24576x1536, 28672x4096). H100, block_fp8_gemm back to
        # back, forced configs, two sweeps (2 + 3 runs, orders rotated;
        # results/2026-11-26_gemm_128x192_pairs_h100.log), 128x192 -> its pairs: 57344x8192 x
        # 2048 / 4096 / 8192 +2.2 / +3.9 / +1.6% and +4.6 / +2.8 / +3.3%, 8192x28672 x 8192 +4.0%
        # and +1.7%.
        return ("gemm", 14)
    if best == 3 and m >= SM90_GEMM_PAIRS_OVER_192_MIN_M and n % 256 == 0:
        # From 4096 tokens, where N is whole 256-column pair units, the 256x128 pairs instead of
        # 128x192. Interleaved A/Bs (one replay of each variant in turn under one shared clock,
        # as bench_gemm.py times too) rank 128x192 first, but it moves the most L2 -> SM data
        # per FLOP, and at the power cap, where every GEMM here runs, that costs clock: run
        # alone for seconds, as a model's prefill runs them, the pairs win. H100, sustained
        # runs: a Llama-3.1-8B layer's four projections (fp8_linear, 4 layers of weights) with
        # the pairs everywhere vs this heuristic's 128x192 for qkv and gate_up: 4096 tokens
        # 1648 vs 1710 us a layer, 8192 3234 vs 3454 (scripts/dev_prefill_layers.py,
        # results/2026-11-26_gemm_prefill_layers_h100.log); single shapes against DeepGEMM
        # in the same process (results/2026-11-26_gemm_sustained_tiles_h100.log): 6144x4096,
        # 24576x1536, 28672x4096, 8192^2, 32768x512 at 4096-8192 tokens -0.4 to +6.7%
        # (8192^2 x 8192 0.889 -> 0.949 of DeepGEMM). Ragged N keeps 128x192 (2112 = 11 x 192:
        # 1.093 vs 1.005 of DeepGEMM at 8192 tokens). In the interleaved benchmark these
        # points lose 0-3% (session 24's forced-config sweep).
        return ("gemm", 5)
    if best == 5 and 512 <= m <= 1024 and num_kb <= 16:
        # Short K loops (<= 16 blocks) at 512-1024 tokens: 128x128 tiles whose two math
        # warpgroups keep two partial accumulators (config 13: K block kb+1's wgmmas queued
        # before kb's promotion) instead of the waves x area pick, 256x128 pairs. A tile here is a
        # few K blocks, so its start, promotions and epilogue weigh more, and the smaller tiles
        # make finer waves. H100, block_fp8_gemm back to back, five runs on five machines
        # (results/2026-11-26_gemm_two_partials_128_h100.log), 256x128 pairs -> config 13:
        # 7168x2048 x 512 16.2 -> 14.8 us (the other runs 7-9% too), x 1024 29.6 -> 27.8
        # (2-5%); 32768x512 x 512 25.2 -> 23.0 (7-9%), x 1024 45.3 -> 42.8 (1.4-5%);
        # 24576x1536 x 512 +0.3 to +2.5%, x 1024 -0.6 to -3.5%. At 2048 tokens mixed (24576x1536
        # +3% in two runs of four), from 4096 a loss or a tie; over longer K loops the single
        # partial wins (config 0 at 10240x8192 x 1024: 134 us, 142 with two partials).
        return ("gemm", 13)
    if best == 3 and split_tail_parts(m, n, k, num_sms) >= 2:
        # 128x192 tiles whose last wave is ragged, over a long K: that wave's tiles split
        # along K over the idle SMs (config 15, csrc/sm90/gemm_kernel.cuh kSplitTail).
        return ("gemm", 15)
    if best == 1 and after_quant and 128 < m <= 192 and cost(0) <= 1.3 * cost(1):
        # Behind the quant kernel three 64x128 CTAs share each weight tile through L2 only as
        # well as their placement lets them (see the 65-128 rule below): 128x128 unless its
        # waves x area is over 1.3x. H100, M = 136 / 192, fp8_linear after an elementwise
        # kernel, 128x128 vs 64x128: 57344x8192 205 / 206 vs 218 / 241 us, 24576x1536 20.9 /
        # 21.1 vs 23.4 / 24.1; where 128x128 leaves most of a second wave idle 64x128 stays
        # (10240x8192 40.7 vs 53.1); block_fp8_gemm keeps 64x128 (0.7-3% faster there)
        # (results/2026-11-25_midm_129_192_h100.log).
        return ("gemm", 0)
    if best == 1 and 64 < m <= 128:
        # At 65-128 tokens 128x64 tiles come in the same count as 64x128 ones and take them
        # over: a 128x64 CTA reads each weight tile once for both 64-row halves, where the
        # two 64x128 CTAs of an N block share it through L2 only while they run side by
        # side, which the CTAs' placement on the SMs decides. Behind the quant kernel under
        # PDL (our CTAs placed as the quant kernel's leave the SMs) the sharing breaks. H100,
        # M = 128, 128x64 vs 64x128: fp8_linear 57344x8192 175 vs 247 us, 24576x1536 17.4
        # vs 18.2; block_fp8_gemm (all CTAs placed at once) 174 vs 171, 15.6 vs 16.4
        # (results/2026-11-25_linear_pdl_placement_h100.log).
        return ("gemm", 7)
    # 128x128 pairs multicasting the shared weight tile from M >= 4096: 1-4% faster there
    # (less L2 traffic), 1-3% slower below, where the pair's lockstep costs more than it
    # saves.
    if best == 0 and m >= 4096:
        return ("gemm", 2)
    return ("gemm", best)


# ------------------------------------------------------------------------- Triton tiles
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


def triton_config(m: int, n: int, k: int, a_bytes: int, weight_only: bool,
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
    FP8LINEAR_FUSED_QUANT_EARLY_TRIGGER=0 / 1 forces it (both kernels)."""
    v = _switch("FP8LINEAR_FUSED_QUANT_EARLY_TRIGGER")
    if v is not None:
        return v == "1"
    return norm and m < FUSED_QUANT_SPLIT_MIN_ROWS


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
