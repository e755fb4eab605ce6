"""The sm90 backend's plans (fp8linear/backends/sm90/plan.py) and launch choices
(launch.py), on the CPU: each measured rule picks what the H100 measurements it cites found
fastest (docs/tuning.md, docs/performance.md). Plans compare by their fields, not by the rule
that chose them; a few tests name the rule ids too."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from expect import raises_exactly, undocumented
from fp8linear.backends.sm90 import launch, plan, tiles
from fp8linear.backends.sm90.plan import DecodePlan, GemmPlan
from fp8linear.backends.sm90.tiles import DECODE_TILES, GEMM_TILES, SMEM_PER_CTA
from fp8linear.quant import cdiv

SMS = 132
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("m,n,k,config", [
    (128, 4096, 4096, 6),     # 32 tiles of 128x128 for 132 SMs: 64x64 tiles (128, one wave)
    (128, 7168, 2048, 7),     # 64x64 would need two waves: one of 128x64 (a tie with 64x128)
    (128, 8192, 8192, 7),     # one wave of 128x64 (25.9 us) vs 64x128 (26.9)
    (256, 4096, 14336, 7),    # 32.3 vs 34.0 us with 64x128
    (256, 2112, 7168, 6),     # 132 tiles of 64x64 still fit one wave
    (192, 6144, 4096, 10),    # one wave of 128x96 (13.3 us) vs 64x128 (17.2)
    (160, 4096, 4096, 1),     # one wave of 96 64x128 tiles: no half-empty 128-row block
    (192, 8192, 8192, 0),     # a tie of waves x area: one wave of 128x128 beats 1.5 of 64x128
    (128, 24576, 1536, 7),    # 3 waves of 64x128 beat 2 of 128x128; as 128x64 (the same count)
    (128, 57344, 8192, 7),    # ... one CTA a weight tile: no sharing through L2 to lose
    (128, 10240, 8192, 0),    # one wave of 128x128 vs two of 64x128: the tie keeps 128x128
    (64, 4096, 4096, 8),      # 33-64 tokens: the large-M kernel; one wave of 64x32 tiles
    (64, 2176, 7168, 8),      # 136 tiles of 64x16 would take two waves: 68 of 64x32
    (64, 2112, 7168, 9),      # 132 tiles of 64x16 fill the SMs: no few-rows decode
    (48, 2112, 7168, 9),
    (65, 2112, 7168, 8),      # past 64 tokens the few-rows decode rule stops
    (128, 2112, 7168, 8),     # 132 tiles of 64x32
    (64, 7168, 2048, 6),      # 64x32 would need two waves
    (64, 8192, 8192, 6),      # 128 tiles of 64x64
    (64, 28672, 4096, 1),     # 2 waves of 64x128 = 4 of 64x64: the tie keeps 64x128
    (64, 24576, 1536, 6),     # 3 waves of 64x64 vs 2 of 64x128
    (32, 4096, 4096, 6),      # 17-32 tokens over <= 32 K blocks, one wave of 64x64
    (256, 10240, 8192, 11),   # one wave of 128x160 pairs (36.9 us) vs 108 128x192 (39.5)
    (512, 10240, 8192, 11),   # 2 waves of 128x160 pairs vs 2 of 128x192 (66.4 vs 73.3 us)
    (512, 57344, 8192, 5),    # 128x160 would take more waves x area
    (2048, 10240, 8192, 5),   # 128x160 pairs would take more waves x area
    (4096, 10240, 8192, 5),   # (128x160 pairs only up to 2048 tokens)
    (256, 6144, 4096, 10),    # one wave of 128x96 (13.5 us) vs 128x128 (14.6)
    (512, 6144, 4096, 3),     # 128x96 only below 512 tokens (24.4 vs 21.5 us with 128x192)
    (512, 4096, 4096, 0),     # one full wave of 128x128; 256x128 would idle half the SMs
    (512, 8192, 8192, 5),     # two waves of 128x128 = one of 256x128, which is cheaper
    (8192, 8192, 8192, 5),    # from 4096 tokens the pairs over 128x192 where N is whole pair units
    (2048, 6144, 4096, 3),    # (not below 4096 tokens)
    (8192, 57344, 8192, 14),  # weights >= 2^27 elements: 128x192 pairs sharing the weight tile
    (2048, 57344, 8192, 14),
    (1024, 57344, 8192, 5),   # (not below 2048 tokens)
    (8192, 28672, 4096, 5),   # 117M elements: under 2^27, so the 256x128 pairs
    (2048, 4096, 4096, 5),
    (512, 28672, 4096, 3),    # 5 waves of 128x192 (0.9 an area) vs 4 of 256x128 (0.87)
    (512, 2112, 7168, 7),     # 68 tiles of 128x128 (half a wave) or 132 of 128x64
    (1024, 2112, 7168, 11),   # 56 128x160 pairs, under one wave (28.6 vs 29.3 us)
    (640, 7168, 16384, 15),   # not 128x160 pairs (3 waves); 128x192, its last 58 tiles split
    (640, 3584, 7168, 3),     # 128x160 pairs: 52.2 us, 128x192 30.6
    (1536, 7168, 16384, 15),  # 456 tiles: 3 waves + 60 split in 2
    (4096, 24576, 1536, 5),   # (no split tail where parts would be 1-12 K blocks)
    (4096, 2112, 7168, 3),    # 2112 = 11 x 192: 3 waves of 128x192 instead of 5 of 128x128
    (2048, 2112, 7168, 11),   # 1.7 waves of 128x160 pairs vs 1.33 of 128x192 (54.7 vs 59.5 us)
    (2560, 2112, 7168, 3),    # (128x160 pairs only up to 2048 tokens)
    (8192, 2112, 7168, 3),    # 6 waves of 128x192 vs 5 of 256x128 pairs
    (4096, 4096, 4096, 5),    # 4 waves of 256x128 vs 8 of 128x128
    # short K loops (<= 16 blocks) at 512-1024 tokens: 128x128 with queued K blocks
    (512, 7168, 2048, 13),    # (16.2 -> 14.8 us against 256x128 pairs)
    (1024, 32768, 512, 13),   # (45.3 -> 42.8)
    (1024, 24576, 1536, 3),   # (where 128x192 is cheaper than the pairs: 69.8 vs 71.0 us)
    (256, 32768, 512, 5),     # not below 512 tokens,
    (2048, 7168, 2048, 3),    # nor above 1024,
    (1024, 4096, 4096, 5),    # nor over 16 K blocks
])
def test_large_m_configs(m, n, k, config):
    assert plan.choose(m, n, k, SMS) == GemmPlan(config)


def test_forced_gemm_config():
    with plan.forced(gemm_config=2):
        p = plan.choose(1, 4096, 4096, SMS)       # any M, even decode sizes
        assert p == GemmPlan(2) and p.rule == "forced-config"
    assert plan.choose(1, 4096, 4096, SMS).kind == "decode"   # and only inside the block
    with raises_exactly(ValueError, f"forced gemm_config={len(GEMM_TILES)}: expected one of "
                                    f"range(0, {len(GEMM_TILES)})"):
        with plan.forced(gemm_config=len(GEMM_TILES)):
            pass
    with raises_exactly(ValueError, f"forced gemm_config=True: expected one of "
                                    f"range(0, {len(GEMM_TILES)})"):
        with plan.forced(gemm_config=True):        # a bool is no tile id, though True == 1
            pass


def test_forced_rejects_a_bad_value_before_changing_anything():
    with plan.forced(decode_rows=80):
        with raises_exactly(ValueError, "forced decode_splits=0: expected one of range(1, 1025)"):
            with plan.forced(decode_splits=0):
                pass
        assert plan.current().decode_rows == 80 and plan.current().decode_splits is None
    assert plan.current() == plan.NONE


def test_plans_compare_by_fields_not_rule():
    assert GemmPlan(3, "split-tail") == GemmPlan(3)
    assert DecodePlan(0, 2, 2, 64, "decode-four-splits") == DecodePlan(0, 2, 2, 64)
    assert DecodePlan(0, 2, 2, 64) != GemmPlan(0)
    assert DecodePlan(3, 1, 1, 64).token_tile == 64 and GemmPlan(5).tile == GEMM_TILES[5]


@pytest.mark.parametrize("m,n,k,want,rule", [
    (1, 4096, 4096, DecodePlan(0, 2, 2, 64), "decode"),
    (1, 4096, 7168, DecodePlan(0, 4, 2, 64), "decode-four-splits"),
    (32, 4096, 4096, GemmPlan(6), "tiles-17-32-short-k"),
    (8, 4096, 4096, GemmPlan(8), "tiles-64x32-one-wave"),
    (640, 7168, 16384, GemmPlan(15), "split-tail"),
    (8192, 57344, 8192, GemmPlan(14), "pairs-192-big-weights"),
    (8192, 8192, 8192, GemmPlan(5), "pairs-256-from-4096"),
    (512, 7168, 2048, GemmPlan(13), "two-partials-short-k"),
    (128, 8192, 8192, GemmPlan(7), "midm-128x64-one-wave"),
    (128, 24576, 1536, GemmPlan(7), "128x64-65-128"),
    (2048, 6144, 4096, GemmPlan(3), "waves-x-area"),
])
def test_rule_ids(m, n, k, want, rule):
    p = plan.choose(m, n, k, SMS)
    assert p == want and p.rule == rule
    assert rule in {r.id for r in plan.RULES + plan.DECODE_YIELDS + plan.REFINEMENTS} | \
        {"decode-four-splits"}


@pytest.mark.parametrize("m,n,k,tile,splits,ctas,rows", [
    (1, 4096, 4096, 0, 2, 2, 64),    # 64 tiles of 64 rows, 2 splits of 16 K blocks: two CTAs an SM
    (1, 2112, 7168, 0, 4, 2, 64),    # 33 tiles x 4 splits
    (1, 7168, 16384, 0, 1, 1, 64),   # 112 tiles: no split; 128 K blocks a CTA: one CTA an SM
    (1, 6144, 4096, 0, 1, 1, 64),    # 96 tiles, no split
    (1, 4096, 7168, 0, 4, 2, 64),    # 2 splits of 28 K blocks at one CTA an SM -> 4 of 14 at two
    (16, 2560, 8192, 1, 4, 2, 64),   # 3 splits of 22 -> 4 of 16
    (1, 4096, 14336, 0, 2, 1, 64),   # 4 splits would still leave 28 K blocks a CTA
    (32, 3072, 8192, 2, 2, 1, 64),   # (32-token tiles: not measured at 4 splits)
    (16, 2112, 7168, 1, 4, 2, 64),   # (4096 rows at 8-32 tokens: 64x32 tiles, below)
    (32, 2112, 7168, 2, 4, 2, 64),   # 56 K blocks: the decode kernel, not 64x64 tiles
    (64, 1536, 7168, 3, 5, 1, 64),   # 96 tiles of 64x16 < 3/4 of the SMs: decode, 5 splits
    (33, 576, 7168, 3, 14, 1, 64),   # 9 rows of 64 (DeepSeek-V3's kv_a_proj): 14 splits
    (32, 8192, 8192, 2, 1, 1, 64),   # 128 tiles, 64 K blocks a CTA: one CTA an SM
    (1, 10240, 8192, 0, 1, 1, 80),   # 160 tiles of 64 rows would spill into a second wave,
    (16, 12288, 4096, 1, 1, 1, 96),  # ... 128-row CTAs leave SMs idle: one wave of 80 / 96 /
    (32, 14336, 4096, 2, 1, 1, 112), # ... 112-row CTAs
    (1, 16384, 4096, 0, 1, 1, 128),  # (exactly one wave of 128 rows)
    (1, 28672, 4096, 0, 1, 1, 128),  # 224 tiles of 128 (448 of 64)
    (1, 57344, 8192, 0, 1, 1, 64),   # 896 tiles of 64: so many waves that the finer tail wins
])
def test_decode_plans(m, n, k, tile, splits, ctas, rows):
    assert plan.choose(m, n, k, SMS) == DecodePlan(tile, splits, ctas, rows)


@pytest.mark.parametrize("m,n,k,want", [
    (17, 32768, 512, GemmPlan(1)),     # no K split, 4 K blocks a CTA: the large-M tiles
    (32, 24576, 1536, GemmPlan(6)),    # ... 12 K blocks
    (24, 28672, 4096, GemmPlan(1)),    # ... 117 MB of weights
    (32, 57344, 8192, GemmPlan(6)),
    (2, 28672, 4096, GemmPlan(1)),     # from 2 tokens where the decode grid is multi-wave
    (16, 57344, 8192, GemmPlan(6)),
    (1, 28672, 4096, DecodePlan(0, 1, 1, 128)),   # (one token: decode)
    (16, 32768, 512, DecodePlan(1, 1, 2, 128)),   # one wave (2 an SM): decode up to 16 tokens
    (32, 10240, 8192, DecodePlan(2, 1, 1, 80)),   # 84 MB, 64 K blocks: decode
    (32, 12288, 4096, DecodePlan(2, 1, 1, 96)),   # 50 MB, 32 K blocks: decode
    (32, 2112, 7168, DecodePlan(2, 4, 2, 64)),    # K split 4 ways: decode
])
def test_tiles_over_unsplit_decode_grids(m, n, k, want):
    assert plan.choose(m, n, k, SMS) == want
    assert plan.choose(m, n, k, SMS, after_quant=True) == want


@pytest.mark.parametrize("m,n,k,want", [
    (8, 4096, 4096, GemmPlan(8)),      # one wave of 64x32 tiles fills the SMs: those tiles
    (16, 4096, 14336, GemmPlan(8)),
    (32, 4096, 7168, GemmPlan(8)),
    (24, 4096, 4096, GemmPlan(6)),     # (the 64x64 rule for short K comes first)
    (4, 4096, 4096, DecodePlan(0, 2, 2, 64)),     # below 8 tokens decode stays
    (16, 2112, 7168, DecodePlan(1, 4, 2, 64)),    # 64x32 would fill half the SMs: decode
    (16, 4352, 4096, DecodePlan(1, 1, 1, 64)),    # 136 tiles of 64x32: over one wave
])
def test_narrow_tiles_over_split_decode_at_8_32_tokens(m, n, k, want):
    assert plan.choose(m, n, k, SMS) == want
    assert plan.choose(m, n, k, SMS, after_quant=True) == want


@pytest.mark.parametrize("m,n,k,want", [
    (17, 6144, 4096, GemmPlan(12)),    # one wave of 128 64x48 tiles (64x64: 96, a quarter idle)
    (32, 6144, 4096, GemmPlan(12)),
    (64, 6144, 4096, GemmPlan(12)),
    (48, 5888, 4096, GemmPlan(12)),    # 123 tiles: >= 90% of the SMs
    (48, 5120, 4096, GemmPlan(6)),     # 107 tiles of 64x48 fill too few: 64x64
    (65, 6144, 4096, GemmPlan(7)),     # two M blocks: 256 tiles of 64x48, over a wave
    (16, 6144, 4096, DecodePlan(1, 1, 1, 64)),    # up to 16 tokens decode stays
    (48, 6400, 4096, GemmPlan(6)),     # 134 tiles of 64x48: over one wave
])
def test_64x48_tiles_where_one_wave_fills_the_sms(m, n, k, want):
    assert plan.choose(m, n, k, SMS) == want
    assert (GEMM_TILES[12].bm, GEMM_TILES[12].bn) == (64, 48)


def test_tiles_over_decode_rule_yields_to_decode_knobs():
    # any decode piece forced keeps the decode kernel (forcing is for sweeps)
    with plan.forced(decode_ctas=1):
        assert plan.choose(32, 32768, 512, SMS) == DecodePlan(2, 1, 1, 128)
    with plan.forced(decode_max_m=64):
        assert plan.choose(32, 32768, 512, SMS).kind == "decode"
        assert plan.choose(16, 4096, 4096, SMS).kind == "decode"


@pytest.mark.parametrize("m,n,k,alone,after_quant", [
    (136, 57344, 8192, 1, 0),   # behind the quant kernel 64x128 tiles lose their L2 sharing
    (192, 24576, 1536, 1, 0),
    (136, 10240, 8192, 1, 1),   # ... unless 128x128 would leave most of a second wave idle
    (136, 4096, 14336, 1, 1),   # one wave of 64x128
    (256, 57344, 8192, 3, 3),   # only at 129-192 tokens (measured)
])
def test_plan_after_quant_kernel(m, n, k, alone, after_quant):
    assert plan.choose(m, n, k, SMS) == GemmPlan(alone)
    assert plan.choose(m, n, k, SMS, after_quant=True) == GemmPlan(after_quant)


def test_decode_rows_and_splits_forced():
    with plan.forced(decode_rows=128):
        assert plan.choose(1, 4096, 4096, SMS) == DecodePlan(0, 4, 2, 128)
        assert plan.choose(32, 4096, 4096, SMS).kind == "decode"   # not the 64x64 tiles
    with plan.forced(decode_rows=64):
        assert plan.choose(1, 10240, 8192, SMS) == DecodePlan(0, 1, 1, 64)
        with plan.forced(decode_max_m=64):
            assert plan.choose(64, 2112, 7168, SMS).rows == 64
        with plan.forced(decode_max_m=128):
            assert plan.choose(128, 2112, 7168, SMS).rows == 128   # 128-token tiles: 128 rows only
            with plan.forced(decode_splits=3):
                assert plan.choose(1, 4096, 4096, SMS).splits == 3
                assert plan.choose(1, 4096, 256, SMS).splits == 2   # never more than the K blocks
                with plan.forced(decode_rows=80, decode_ctas=2):
                    p = plan.choose(1, 4096, 4096, SMS)
                    assert (p.ctas_per_sm, p.rows) == (1, 80)      # fewer rows: one CTA an SM
    with raises_exactly(ValueError, "forced decode_rows=48: expected one of "
                                    "(64, 72, 80, 88, 96, 104, 112, 120, 128)"):
        with plan.forced(decode_rows=48):
            pass


def test_decode_ctas_forced():
    with plan.forced(decode_ctas=1):
        assert plan.choose(1, 4096, 4096, SMS).ctas_per_sm == 1
    with plan.forced(decode_ctas=2):
        assert plan.choose(1, 7168, 16384, SMS).ctas_per_sm == 2
        assert plan.choose(32, 7168, 16384, SMS).ctas_per_sm == 2
        with plan.forced(decode_max_m=64):
            assert plan.choose(64, 2112, 7168, SMS).ctas_per_sm == 1    # not for 64-token tiles
    with raises_exactly(ValueError, "forced decode_ctas=3: expected one of (1, 2)"):
        with plan.forced(decode_ctas=3):
            pass


@pytest.mark.parametrize("m,n,k,early", [
    (1, 7168, 2048, False),         # 112 unsplit CTAs: the next GEMM's would only compete
    (16, 6144, 4096, False),        # 96 unsplit CTAs
    (1, 4096, 4096, True),          # 2 splits: the next GEMM streams during our reduction
    (1, 2112, 7168, True),          # 4 splits
    (1, 4096, 14336, False),        # 2 splits of one CTA an SM: the next GEMM's cannot fit
    (1, 4096, 7168, True),          # 4 splits of two CTAs an SM
    (1, 24576, 1536, True),         # 192 CTAs: over a wave
])
def test_decode_early_trigger(m, n, k, early):
    p = plan.choose(m, n, k, SMS)
    n_tiles = cdiv(n, p.rows) * cdiv(m, DECODE_TILES[p.config])
    assert launch.decode_early_trigger(p, n_tiles, SMS) is early
    for v in (False, True):
        with plan.forced(decode_early_trigger=v):
            assert launch.decode_early_trigger(p, n_tiles, SMS) is v
    with raises_exactly(ValueError, "forced decode_early_trigger='yes': expected True or False"):
        with plan.forced(decode_early_trigger="yes"):
            pass


@pytest.mark.parametrize("m,k,p,fused", [
    (1, 4096, DecodePlan(0, 2, 2, 128), True),    # 16 K blocks a CTA, one token
    (4, 4096, DecodePlan(0, 2, 2, 64), True),     # 4 x 16 = 64 groups
    (8, 4096, DecodePlan(0, 2, 2, 64), True),     # 8 x 16 = 128 groups: the limit
    (8, 4352, DecodePlan(0, 2, 2, 64), False),    # 8 x 17 groups
    (8, 4096, DecodePlan(0, 4, 2, 128), True),    # 8 tokens x 8 blocks
    (16, 2048, DecodePlan(1, 4, 2, 128), True),   # 16 x 4 groups
    (16, 2048, DecodePlan(1, 2, 2, 64), True),    # 16 x 8 groups
    (16, 2304, DecodePlan(1, 2, 2, 64), False),   # 16 x 9 groups
    (1, 4096, DecodePlan(0, 1, 1, 128), True),    # 32 blocks: a 32 KB slice, one CTA an SM
    (1, 8192, DecodePlan(0, 1, 1, 128), False),   # 64 blocks: the slice would crowd the ring
    (1, 7680, DecodePlan(0, 1, 2, 128), False),   # 60 blocks, two CTAs an SM
    (17, 1024, DecodePlan(2, 1, 2, 128), False),  # over 16 tokens: the quant kernel
    (1, 4096, GemmPlan(0), False),
])
def test_fuse_quant_only_small_slices(m, k, p, fused):
    assert launch.fuse_quant(m, k, p) is fused
    with plan.forced(fuse_quant=False):
        assert launch.fuse_quant(m, k, p) is False
    with plan.forced(fuse_quant=True):   # wherever the slice fits
        assert launch.fuse_quant(m, k, p) is (p.kind == "decode" and m <= 16
                                              and cdiv(cdiv(k, 128), p.splits)
                                              * (8 << p.config) * 128
                                              <= SMEM_PER_CTA[p.ctas_per_sm] // 4)
    with raises_exactly(ValueError, "forced fuse_quant=2: expected True or False"):
        with plan.forced(fuse_quant=2):
            pass


def test_decode_max_m_forced():
    # default: the decode kernel up to 32 tokens, large-M tiles above (few-row weights: 64)
    assert plan.choose(33, 4096, 4096, SMS).kind == "gemm"
    assert plan.choose(32, 2112, 7168, SMS).kind == "decode"
    with plan.forced(decode_max_m=256):
        p = plan.choose(256, 4096, 4096, SMS)
        assert p.kind == "decode" and p.config == len(DECODE_TILES) - 1
        # two 128-token tiles x 32 row tiles: 2 splits fill one wave
        assert p.splits == SMS // (2 * 32)
        assert plan.choose(257, 4096, 4096, SMS).kind == "gemm"
        p = plan.choose(64, 6144, 4096, SMS)
        assert p.kind == "decode" and p.config == 3       # 64-token tiles
    for bad in (0, 300, "x"):
        with raises_exactly(ValueError,
                            f"forced decode_max_m={bad!r}: expected one of range(1, 257)"):
            with plan.forced(decode_max_m=bad):
                pass


@pytest.mark.parametrize("m,n,k,config", [
    (192, 4096, 14336, 1),   # 128-row tiles a quarter empty, 96 tiles of 64x128: one wave
    (160, 4096, 7168, 1),
    (256, 4096, 14336, 7),   # full 128-row tiles: one wave of 128x64
    (128, 4096, 14336, 6),   # 128 tiles of 64x64
    (192, 2112, 7168, 6),    # 99 tiles of 64x64
])
def test_narrow_n_mid_m_tiles(m, n, k, config):
    assert plan.choose(m, n, k, SMS) == GemmPlan(config)


def test_tile_table_is_the_kernels():
    """csrc/sm90/tables.def is the one definition of the tiles: the C++ builds its tables from
    it field by field, tiles.py parses it (index = config id)."""
    src = REPO / "csrc" / "sm90"
    table = (src / "tables.def").read_text()
    rows = re.findall(r"^FP8L_GEMM_TILE\((\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(true|false),"
                      r"\s*(true|false),\s*(true|false)\)", table, re.M)
    assert [(int(a), int(b), int(c), int(d), e == "true", f == "true", g == "true")
            for a, b, c, d, e, f, g in rows] == \
        [(t.bm, t.bn, t.stages, t.cluster, t.share_a, t.queue_next, t.split_tail)
         for t in GEMM_TILES]
    assert len(GEMM_TILES) == 16
    assert DECODE_TILES == (8, 16, 32, 64, 128)
    assert SMEM_PER_CTA == {1: 232448, 2: 115712, 3: 76800}
    # gemm.cu's kConfigs: the same fields in the same order as tiles.GemmTile
    gemm = (src / "gemm.cu").read_text()
    fields = "bm, bn, stages, cluster, share_a, queue_next, split_tail"
    assert [f.name for f in dataclasses.fields(tiles.GemmTile)] == fields.split(", ")
    kconfigs = gemm[gemm.index("kConfigs[] = {"):]
    kconfigs = kconfigs[:kconfigs.index("};")]
    assert f"#define FP8L_GEMM_TILE({fields})" in kconfigs
    assert "{" + fields + "}," in kconfigs and '#include "sm90/tables.def"' in kconfigs
    assert "int bm, bn, stages, cluster;" in gemm
    assert "bool share_a, queue_next, split_tail;" in gemm
    # decode.cu: decode config i -> the i-th token tile
    assert '#define FP8L_DECODE_TILE(tokens)' in (src / "decode.cu").read_text()
    # the lean rule is the kernel's: 64-row tiles of <= 64 columns
    assert "return bm == 64 && bn <= 64;" in gemm
    assert [c for c, t in enumerate(GEMM_TILES) if t.lean] == [6, 8, 9, 12]


@pytest.mark.parametrize("m, k, config, after_quant, early", [
    (64, 4096, 1, False, 4),   # 64x128 tiles (full registers): 4 of their 8 stages
    (1, 4096, 0, False, 4),
    (128, 4096, 7, False, 4),
    (64, 4096, 4, False, 3),   # never more than the ring (256x128: 3 stages)
    (64, 4096, 8, False, 8),   # lean tiles: 8 of their small stages
    (64, 4096, 12, False, 8),
    (129, 4096, 1, True, 0),   # behind fp8_linear's quant kernel: not past 128 tokens
    (192, 4096, 8, True, 0),
    (128, 4096, 1, True, 4),   # ... up to 128: 4 stages, lean tiles too
    (64, 512, 0, True, 4),
    (17, 4096, 8, True, 4),
    (16, 4096, 8, True, 4),
    (2, 8192, 6, True, 4),
    (16, 4096, 1, True, 4),
    (8, 512, 4, True, 3),      # (never more than the ring)
    (256, 1024, 0, False, 4),  # 129-256 tokens where the K loop has >= 8 blocks
    (256, 896, 5, False, 0),   # ... not over 7
    (128, 512, 0, False, 4),   # (up to 128 tokens at any K)
    (257, 4096, 1, False, 0),  # past the sizes measured
])
def test_gemm_early_weights_rule(m, k, config, after_quant, early):
    assert launch.gemm_early_weights(m, k, config, after_quant) == early
    ring = GEMM_TILES[config].stages
    with plan.forced(gemm_early_b=True):
        forced = launch.gemm_early_weights(m, k, config, after_quant)
        assert 0 < forced <= ring and (early == 0 or forced == early)
        with plan.forced(gemm_early_stages=2):
            assert launch.gemm_early_weights(m, k, config, after_quant) == 2
        with plan.forced(gemm_early_stages=64):
            assert launch.gemm_early_weights(m, k, config, after_quant) == ring
    with plan.forced(gemm_early_b=False, gemm_early_stages=64):
        assert launch.gemm_early_weights(m, k, config, after_quant) == 0
    with raises_exactly(ValueError, "forced gemm_early_b=2: expected True or False"):
        with plan.forced(gemm_early_b=2):
            pass
    with raises_exactly(ValueError, "forced gemm_early_stages=0: expected one of range(1, 65)"):
        with plan.forced(gemm_early_b=True, gemm_early_stages=0):
            pass


@pytest.mark.parametrize("m, k, group", [
    (4096, 8192, 4),      # bands of 4 units from 4096 tokens over >= 64 K blocks
    (8192, 28672, 4),
    (4096, 8064, 16),     # fewer K blocks from 2048 tokens: bands of 16
    (8192, 4096, 16),
    (2048, 512, 16),
    (2048, 8192, 8),      # >= 64 K blocks below 4096 tokens
    (1024, 4096, 8),      # below 2048 tokens
    (1024, 16384, 8),
])
def test_gemm_group_m_rule(m, k, group):
    assert launch.gemm_group_m(m, k) == group
    with plan.forced(gemm_group_m=3):
        assert launch.gemm_group_m(m, k) == 3
    with raises_exactly(ValueError, "forced gemm_group_m=0: expected one of range(1, 1025)"):
        with plan.forced(gemm_group_m=0):
            pass


def test_gemm_pdl_forced():
    assert launch.gemm_pdl(True) is True and launch.gemm_pdl(False) is False
    with plan.forced(gemm_pdl=False):
        assert launch.gemm_pdl(True) is False
    with plan.forced(gemm_pdl=True):
        assert launch.gemm_pdl(False) is False      # never without PDL itself
    with raises_exactly(ValueError, "forced gemm_pdl=0: expected True or False"):
        with plan.forced(gemm_pdl=0):
            pass


def _waves(m, n, config):
    return plan._waves_x_area(plan.Problem(m, n, 4096, SMS, False), config)


def test_waves_count_whole_pairs():
    """A pair's CTAs take adjacent tiles along M (sharing the weight tile) or N (sharing the
    activation tile): an odd tile count there still takes whole pairs of CTAs."""
    # configs 11 / 5: 128x160 / 256x128 pairs
    # 5 x 45 tiles of 128x160 at M = 640, N = 7168: 3 x 45 pair units, 270 CTAs, 3 waves
    assert _waves(640, 7168, 11) == 3 * 128 * 160
    assert _waves(512, 7168, 11) == 2 * 128 * 160   # 4 x 45: 180 CTAs
    # 256x128 pairs share the activation tile along N: 17 N tiles (2112) take 9 pairs
    assert _waves(2048, 2112, 5) == _waves(2048, 2304, 5)


def test_split_tail_parts():
    """The split tail: a ragged last wave of 128x192 tiles of at most half the SMs, split into
    K ranges of >= 32 blocks, all in one wave."""
    assert plan.split_tail_parts(640, 7168, 16384, 132) == 2      # 190 tiles: 58 in the tail
    assert plan.split_tail_parts(1920, 7168, 16384, 132) == 3     # 570: tail 42, 3 x 42 blocks
    assert plan.split_tail_parts(2048, 2112, 7168, 132) == 0      # 3 parts of 18 blocks: too short
    assert plan.split_tail_parts(512, 7168, 16384, 132) == 0      # tail 20: 6 parts of 21
    assert plan.split_tail_parts(1024, 8448, 16384, 132) == 0     # 8 x 44 = 352: tail 88, over half
    assert plan.split_tail_parts(4096, 6144, 4096, 132) == 0      # 32 x 32 = 1024: tail 100
    assert GEMM_TILES[15].split_tail and not any(GEMM_TILES[c].split_tail for c in range(15))
    assert plan.SPLIT_TAIL_CONFIG == 15


def test_every_rule_has_its_measurements_in_tuning_md():
    rules = plan.RULES + plan.DECODE_YIELDS + plan.REFINEMENTS
    assert all(r.reason and "\n" not in r.reason for r in rules)
    assert undocumented(r.id for r in rules) == []
