"""The sm90 backend's plans: which kernel, tile and split a problem runs, by ordered rules.

``choose`` walks ``RULES`` in order; the first rule that returns a plan decides, and the plan
names it (``rule``). The large-M rule picks the cheapest tile by a waves x area cost model,
then ``REFINEMENTS`` may replace it. Each rule has an id and a one-line reason; docs/tuning.md
gives each id's measurements. Tiles and limits come from csrc/sm90/tables.def (``tiles``).

``forced(...)`` overrides parts of the plan for benchmarks and tests (never read from the
environment, so the hot path reads no knob).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Union

from ...quant import BLOCK, cdiv
from ..rules import Rule, rule_in
from .tiles import DECODE_TILES, GEMM_TILES


# ------------------------------------------------------------------------------ plans
@dataclass(frozen=True)
class DecodePlan:
    """The split-K swap-AB decode kernel (csrc/sm90/decode_kernel.cuh)."""
    config: int          # token tile DECODE_TILES[config]
    splits: int          # K ranges reduced in a deterministic workspace pass (1: none)
    ctas_per_sm: int     # 1, or 2: half the shared memory, the next kernel's CTAs fit beside
    rows: int            # weight rows a CTA owns: 64, 128, or 72..120 in a 128-row CTA
    rule: str = dataclasses.field(default="", compare=False)

    kind = "decode"

    @property
    def token_tile(self) -> int:
        return DECODE_TILES[self.config]


@dataclass(frozen=True)
class GemmPlan:
    """The persistent large-M kernel (csrc/sm90/gemm_kernel.cuh) with tile GEMM_TILES[config]."""
    config: int
    rule: str = dataclasses.field(default="", compare=False)

    kind = "gemm"

    @property
    def tile(self):
        return GEMM_TILES[self.config]


Plan = Union[DecodePlan, GemmPlan]


# -------------------------------------------------------------------------- overrides
DECODE_MAX_M = 32                      # tokens up to which the decode kernel runs by default
DECODE_ROWS = tuple(range(64, 129, 8))


@dataclass(frozen=True)
class Overrides:
    """Plan pieces forced by ``forced(...)`` (None: the rules decide)."""
    gemm_config: Optional[int] = None        # the large-M kernel with this tile, at every M
    decode_max_m: Optional[int] = None       # decode kernel up to this many tokens
    decode_ctas: Optional[int] = None        # decode CTAs an SM (2 only where it fits)
    decode_rows: Optional[int] = None        # decode CTA's weight rows
    decode_splits: Optional[int] = None      # decode K splits
    fuse_quant: Optional[bool] = None        # decode kernel quantizes x (True: wherever it fits)
    decode_early_trigger: Optional[bool] = None
    gemm_early_b: Optional[bool] = None      # large-M weight stages before the PDL wait
    gemm_early_stages: Optional[int] = None
    gemm_group_m: Optional[int] = None       # large-M tile order's band
    gemm_pdl: Optional[bool] = None

    def check(self) -> None:
        allowed = {"gemm_config": range(len(GEMM_TILES)),
                   "decode_max_m": range(1, 2 * DECODE_TILES[-1] + 1),
                   "decode_ctas": (1, 2), "decode_rows": DECODE_ROWS,
                   "decode_splits": range(1, 1025), "gemm_early_stages": range(1, 65),
                   "gemm_group_m": range(1, 1025)}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name not in allowed:
                if not isinstance(v, bool):
                    raise ValueError(f"forced {f.name}={v!r}: expected True or False")
            elif isinstance(v, bool) or v not in allowed[f.name]:  # (True == 1: not a count)
                raise ValueError(f"forced {f.name}={v!r}: expected one of {allowed[f.name]}")


NONE = Overrides()
_forced = NONE
_on_change: list[Callable[[], None]] = []


def current() -> Overrides:
    return _forced


def on_change(fn: Callable[[], None]) -> None:
    """Call fn() when the overrides change (caches of decisions made under them)."""
    _on_change.append(fn)


@contextlib.contextmanager
def forced(**pieces):
    """Force plan pieces inside the block (benchmarks, tests): ``forced(gemm_config=3)``.
    Field names as in ``Overrides``; a bad value is a ValueError before anything changes."""
    global _forced
    new = dataclasses.replace(_forced, **pieces)
    new.check()
    old, _forced = _forced, new
    for fn in _on_change:
        fn()
    try:
        yield new
    finally:
        _forced = old
        for fn in _on_change:
            fn()


# --------------------------------------------------------------------------- problem
def shape_ok(n: int, k: int) -> bool:
    # TMA global strides must be multiples of 16 bytes: K one-byte fp8 values per A/W row,
    # N two-byte values per bf16/fp16 output row.
    return k % 16 == 0 and n % 8 == 0 and k > 0 and n > 0


@dataclass(frozen=True)
class Problem:
    m: int
    n: int
    k: int
    sms: int
    after_quant: bool            # fp8_linear: the large-M GEMM runs behind our quant kernel
    over: Overrides = NONE

    @property
    def num_kb(self) -> int:
        return cdiv(self.k, BLOCK)

    @property
    def decode_max(self) -> int:
        return self.over.decode_max_m or DECODE_MAX_M

    @property
    def decode_knobs(self) -> bool:
        # the rules that move decode sizes to the large-M tiles stand aside for forced decode
        o = self.over
        return (self.decode_max != DECODE_MAX_M or o.decode_rows is not None
                or o.decode_splits is not None or o.decode_ctas is not None)


RULES: list[Rule] = []        # Problem -> Plan | None, in order
DECODE_YIELDS: list[Rule] = []  # (Problem, DecodePlan) -> True: the large-M rules decide
REFINEMENTS: list[Rule] = []  # (Problem, config) -> config | None, on the cost model's pick


def choose(m: int, n: int, k: int, sms: int, after_quant: bool = False) -> Plan:
    """The plan for one problem (cached: the same shapes repeat every step)."""
    return _choose(Problem(m, n, k, sms, after_quant, _forced))


@functools.lru_cache(maxsize=4096)
def _choose(p: Problem) -> Plan:
    for r in RULES:
        plan = r.pick(p)
        if plan is not None:
            return dataclasses.replace(plan, rule=plan.rule or r.id)
    raise AssertionError("the last rule always decides")


# ------------------------------------------------------------------ helpers of the rules
T8, T16, T32, T64 = DECODE_TILES[:4]   # token tile sizes the rules name


def _one_wave_of_64x48(p: Problem) -> bool:
    tiles = cdiv(p.m, 64) * cdiv(p.n, 48)
    return p.m <= 64 and 10 * tiles >= 9 * p.sms and tiles <= p.sms


def _few_rows(p: Problem) -> bool:
    return (T32 < p.m <= T64 and 4 * cdiv(p.n, 16) < 3 * p.sms
            and p.over.decode_rows is None)


def _waves_x_area(p: Problem, config: int) -> float:
    # wave count (a partial last wave costs a full one) x tile area x the tile's relative time;
    # a pair's odd tile count along its shared side still runs whole pairs
    t = GEMM_TILES[config]
    tiles_m, tiles_n = cdiv(p.m, t.bm), cdiv(p.n, t.bn)
    if t.share_a:
        tiles_n = cdiv(tiles_n, t.cluster) * t.cluster
    else:
        tiles_m = cdiv(tiles_m, t.cluster) * t.cluster
    return (cdiv(tiles_m * tiles_n, p.sms // t.cluster * t.cluster) * t.bm * t.bn
            * TILE_COST.get((t.bm, t.bn), 1.0))


# a tile's time per unit of area relative to 128x128, fitted on full waves (docs/tuning.md)
TILE_COST = {(128, 192): 0.86, (256, 128): 0.87, (128, 64): 1.5}
SPLIT_TAIL_CONFIG = next(i for i, t in enumerate(GEMM_TILES) if t.split_tail)
SPLIT_TAIL_MIN_PART_KB = 32


def split_tail_parts(m: int, n: int, k: int, sms: int) -> int:
    """K ranges the split-tail tile would split its ragged last wave's tiles into, where that
    pays (else 0): a tail of at most half the SMs, parts of >= 32 K blocks."""
    t = GEMM_TILES[SPLIT_TAIL_CONFIG]
    units = cdiv(m, t.bm) * cdiv(n, t.bn)
    tail = units if units <= sms else units % sms
    if tail == 0:
        return 0
    num_kb = cdiv(k, BLOCK)
    parts = min(num_kb, sms // tail)
    return parts if parts >= 2 and num_kb // parts >= SPLIT_TAIL_MIN_PART_KB else 0


# ---------------------------------------------------------------------------- the rules
@rule_in(RULES, "forced-config", "an override: the large-M kernel with the forced tile")
def _forced_config(p):
    c = p.over.gemm_config
    return None if c is None else GemmPlan(c)


@rule_in(RULES, "tiles-17-32-short-k",
         "17-32 tokens over <= 32 K blocks: one wave of 64x64 (or 64x48) tiles beats decode")
def _tiles_17_32_short_k(p):
    tiles64 = cdiv(p.m, 64) * cdiv(p.n, 64)
    if (T16 < p.m <= min(T32, p.decode_max) and p.num_kb <= 32 and tiles64 <= p.sms
            and p.over.decode_rows is None):
        return GemmPlan(12 if _one_wave_of_64x48(p) else 6)
    return None


@rule_in(RULES, "tiles-64x32-one-wave",
         "8-32 tokens where one wave of 64x32 tiles fills >= 3/4 of the SMs: no split reduction")
def _tiles_64x32_one_wave(p):
    if (T8 <= p.m <= T32 and 3 * p.sms <= 4 * cdiv(p.n, 32) <= 4 * p.sms
            and not p.decode_knobs):
        return GemmPlan(8)
    return None


@rule_in(RULES, "decode",
         "up to 32 tokens (or few weight rows at 33-64) reading the weights once is the cost")
def _decode(p):
    if not (p.m <= p.decode_max or _few_rows(p)):
        return None
    plan = decode_plan(p)
    for y in DECODE_YIELDS:
        if y.pick(p, plan):
            return None
    return plan


def decode_plan(p: Problem) -> DecodePlan:
    o = p.over
    # the smallest token tile >= M wastes no tensor-core work (past 128 tokens, 128-token tiles)
    config = next((i for i, t in enumerate(DECODE_TILES) if t >= p.m), len(DECODE_TILES) - 1)
    bt = DECODE_TILES[config]
    rows = o.decode_rows or _decode_rows(p.n, cdiv(p.m, bt), p.sms)
    if bt > T64 and rows == 64:
        rows = 128
    tiles = cdiv(p.n, rows) * cdiv(p.m, bt)
    # split K until every SM streams weights, within one wave
    splits = o.decode_splits or max(1, min(p.num_kb, p.sms // tiles))
    # shared memory holds the token scales of the CTA's whole K range (<= 32 KB)
    splits = min(max(splits, cdiv(p.num_kb, 32768 // (bt * 4))), p.num_kb)
    ctas = (_decode_ctas_per_sm(bt, cdiv(p.num_kb, splits), rows, o.decode_ctas)
            if rows in (64, 128) else 1)
    rule = ""
    if (rows == 64 and splits > 1 and ctas == 1 and bt <= T16 and o.decode_splits is None
            and o.decode_ctas is None):
        new = _decode_four_splits(p.num_kb, tiles, splits, p.sms)
        if new != (splits, ctas):
            (splits, ctas), rule = new, "decode-four-splits"
    return DecodePlan(config, splits, ctas, rows, rule)


DECODE_TWO_PER_SM_MAX_BT = 32
DECODE_ROWS64_MAX_BT = 64


def _decode_rows(n: int, m_tiles: int, sms: int) -> int:
    """decode-rows: 64-row CTAs while they fit one wave (or make >= 6 waves); between those,
    128-row CTAs owning just the rows (a multiple of 8) that make one full wave."""
    tiles64 = cdiv(n, 64) * m_tiles
    if tiles64 <= sms or tiles64 >= 6 * sms:
        return 64
    fill = cdiv(cdiv(n, max(1, sms // m_tiles)), 8) * 8
    return fill if fill < 128 else 128


def _decode_ctas_per_sm(bt: int, kbs: int, rows: int, forced: Optional[int]) -> int:
    """decode-two-per-sm: two CTAs an SM for token tiles <= 32 over short K ranges (<= 16
    blocks): the next kernel's CTAs fit beside ours and stream under PDL."""
    if forced is not None:
        # the scale state must still leave a ring of >= 2 stages in half the memory
        fits = bt <= DECODE_TWO_PER_SM_MAX_BT and kbs * (bt + rows) * 4 <= 65536
        return 2 if forced == 2 and fits else 1
    return 2 if bt <= DECODE_TWO_PER_SM_MAX_BT and kbs <= 16 else 1


def _decode_four_splits(num_kb: int, tiles: int, splits: int, sms: int):
    """decode-four-splits: a 64-row plan split 2-3 ways at one CTA an SM takes 4 splits at
    two an SM where each K range is then <= 16 blocks and the grid fits one wave."""
    if splits < 4 <= num_kb and tiles * 4 <= 2 * sms and cdiv(num_kb, 4) <= 16:
        return 4, 2
    return splits, 1


TILES_OVER_DECODE_MIN_BYTES = 100_000_000


@rule_in(DECODE_YIELDS, "decode-yields-17-32",
         "17-32 tokens, unsplit decode grid, short K ranges or >= 100 MB of weights: tiles win "
         "after a kernel, as in a model")
def _yield_17_32(p, d):
    return (d.splits == 1 and not p.decode_knobs and T16 < p.m <= T32
            and (p.num_kb <= 12 or p.n * p.k >= TILES_OVER_DECODE_MIN_BYTES))


@rule_in(DECODE_YIELDS, "decode-yields-multi-wave",
         "2-32 tokens where the unsplit decode grid takes more than one wave")
def _yield_multi_wave(p, d):
    tiles = cdiv(p.n, d.rows) * cdiv(p.m, d.token_tile)
    return (d.splits == 1 and not p.decode_knobs and 2 <= p.m <= T32
            and tiles > d.ctas_per_sm * p.sms)


def _midm(p) -> bool:
    # 128-row tiles would leave most SMs idle: the 64-row (and narrower) tiles' rules
    return cdiv(p.m, 128) * cdiv(p.n, 128) < p.sms // 2


@rule_in(RULES, "midm-narrow-one-wave",
         "33-128 tokens: one wave of 64x16 or 64x32 tiles puts more SMs on the weight stream")
def _midm_narrow(p):
    if _midm(p) and T32 < p.m <= 128:
        for config, bn in ((9, 16), (8, 32)):
            if cdiv(p.m, 64) * cdiv(p.n, bn) <= p.sms:
                return GemmPlan(config)
    return None


@rule_in(RULES, "midm-64x48-one-wave",
         "<= 64 tokens where one wave of 64x48 tiles fills >= 90% of the SMs (N ~ 6K)")
def _midm_64x48(p):
    return GemmPlan(12) if _midm(p) and _one_wave_of_64x48(p) else None


@rule_in(RULES, "midm-64x64-one-wave", "few tiles: 64x64 while they fit one wave")
def _midm_64x64(p):
    return GemmPlan(6) if _midm(p) and cdiv(p.m, 64) * cdiv(p.n, 64) <= p.sms else None


@rule_in(RULES, "midm-64x128-ragged-128",
         "129+ tokens where 128-row tiles would leave rows empty and 64x128 fits one wave")
def _midm_64x128_ragged(p):
    if (_midm(p) and 128 < p.m and cdiv(p.m, 64) * 64 < cdiv(p.m, 128) * 128
            and cdiv(p.m, 64) * cdiv(p.n, 128) <= p.sms):
        return GemmPlan(1)
    return None


@rule_in(RULES, "midm-128x64-one-wave", "65+ tokens: one wave of 128x64 before 64x128")
def _midm_128x64(p):
    if _midm(p) and p.m > 64 and cdiv(p.m, 128) * cdiv(p.n, 64) <= p.sms:
        return GemmPlan(7)
    return None


@rule_in(RULES, "midm-64x128", "otherwise among few tiles: 64x128")
def _midm_64x128(p):
    return GemmPlan(1) if _midm(p) else None


@rule_in(RULES, "waves-x-area",
         "the fewest waves x tile time among the candidates for this M, then the refinements")
def _waves(p):
    m = p.m
    candidates = ((0, 5, 3, 7) if m >= 512 else (0, 1, 5, 3, 7) if m >= 256
                  else (0, 1, 5, 7) if m > 64 else (0, 1, 5, 7, 6))
    if 256 <= m <= 2048:
        candidates += (11,)
    if 128 < m < 512 and cdiv(m, 128) * cdiv(p.n, 96) <= p.sms:
        candidates += (10,)
    best = min(candidates, key=lambda c: _waves_x_area(p, c))  # ties keep the first
    for r in REFINEMENTS:
        c = r.pick(p, best)
        if c is not None:
            return GemmPlan(c, r.id)
    return GemmPlan(best)


PAIR192_MIN_M = 2048
PAIR192_MIN_WEIGHTS = 1 << 27  # N x K elements
PAIRS_OVER_192_MIN_M = 4096


@rule_in(REFINEMENTS, "pairs-192-big-weights",
         "128x192 at >= 2048 tokens on >= 2^27 weights: pairs sharing the weight tile halve "
         "its DRAM reads")
def _pairs_192(p, best):
    if best == 3 and p.m >= PAIR192_MIN_M and p.n * p.k >= PAIR192_MIN_WEIGHTS:
        return 14
    return None


@rule_in(REFINEMENTS, "pairs-256-from-4096",
         "128x192 from 4096 tokens with N in whole 256-column units: 256x128 pairs, faster "
         "run for seconds at the power cap")
def _pairs_256(p, best):
    return 5 if best == 3 and p.m >= PAIRS_OVER_192_MIN_M and p.n % 256 == 0 else None


@rule_in(REFINEMENTS, "two-partials-short-k",
         "256x128 pairs at 512-1024 tokens over <= 16 K blocks: 128x128 with two partials")
def _two_partials(p, best):
    return 13 if best == 5 and 512 <= p.m <= 1024 and p.num_kb <= 16 else None


@rule_in(REFINEMENTS, "split-tail", "128x192 with a ragged last wave over long K: split it")
def _split_tail(p, best):
    return 15 if best == 3 and split_tail_parts(p.m, p.n, p.k, p.sms) >= 2 else None


@rule_in(REFINEMENTS, "128x128-after-quant",
         "64x128 at 129-192 tokens behind the quant kernel: 128x128 unless 1.3x its cost")
def _after_quant_128(p, best):
    if (best == 1 and p.after_quant and 128 < p.m <= 192
            and _waves_x_area(p, 0) <= 1.3 * _waves_x_area(p, 1)):
        return 0
    return None


@rule_in(REFINEMENTS, "128x64-65-128",
         "64x128 at 65-128 tokens: 128x64, the same count, one CTA reads each weight tile")
def _128x64(p, best):
    return 7 if best == 1 and 64 < p.m <= 128 else None


@rule_in(REFINEMENTS, "pairs-128-from-4096",
         "128x128 from 4096 tokens: pairs multicasting the weight tile (less L2 traffic)")
def _pairs_128(p, best):
    return 2 if best == 0 and p.m >= 4096 else None
