"""The dispatch rules of fp8linear/kernels/heuristics.py, on the CPU: each measured rule picks
what the H100 measurements it cites found fastest (benchmarks/NOTES.md)."""
from __future__ import annotations

import pytest

from fp8linear.kernels import heuristics as h

SMS = 132
H100 = h.TritonDevice(SMS, 227 * 1024, False, (9, 0))


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
    assert h.sm90_plan(m, n, k, SMS) == ("gemm", config)


def test_forced_gemm_config(monkeypatch):
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_CONFIG", "2")
    assert h.sm90_plan(1, 4096, 4096, SMS) == ("gemm", 2)       # any M, even decode sizes
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_CONFIG", str(len(h.SM90_GEMM_CONFIGS)))
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_GEMM_CONFIG"):
        h.sm90_plan(1, 4096, 4096, SMS)


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
    assert h.sm90_plan(m, n, k, SMS) == ("decode", tile, splits, ctas, rows)


@pytest.mark.parametrize("m,n,k,plan", [
    (17, 32768, 512, ("gemm", 1)),     # no K split, 4 K blocks a CTA: the large-M tiles
    (32, 24576, 1536, ("gemm", 6)),    # ... 12 K blocks
    (24, 28672, 4096, ("gemm", 1)),    # ... 117 MB of weights
    (32, 57344, 8192, ("gemm", 6)),
    (2, 28672, 4096, ("gemm", 1)),     # from 2 tokens where the decode grid is multi-wave
    (16, 57344, 8192, ("gemm", 6)),
    (1, 28672, 4096, ("decode", 0, 1, 1, 128)),   # (one token: decode)
    (16, 32768, 512, ("decode", 1, 1, 2, 128)),   # one wave (2 an SM): decode up to 16 tokens
    (32, 10240, 8192, ("decode", 2, 1, 1, 80)),   # 84 MB, 64 K blocks: decode
    (32, 12288, 4096, ("decode", 2, 1, 1, 96)),   # 50 MB, 32 K blocks: decode
    (32, 2112, 7168, ("decode", 2, 4, 2, 64)),    # K split 4 ways: decode
])
def test_tiles_over_unsplit_decode_grids(m, n, k, plan):
    assert h.sm90_plan(m, n, k, SMS) == plan
    assert h.sm90_plan(m, n, k, SMS, after_quant=True) == plan


@pytest.mark.parametrize("m,n,k,plan", [
    (8, 4096, 4096, ("gemm", 8)),      # one wave of 64x32 tiles fills the SMs: those tiles
    (16, 4096, 14336, ("gemm", 8)),
    (32, 4096, 7168, ("gemm", 8)),
    (24, 4096, 4096, ("gemm", 6)),     # (the 64x64 rule for short K comes first)
    (4, 4096, 4096, ("decode", 0, 2, 2, 64)),     # below 8 tokens decode stays
    (16, 2112, 7168, ("decode", 1, 4, 2, 64)),    # 64x32 would fill half the SMs: decode
    (16, 4352, 4096, ("decode", 1, 1, 1, 64)),    # 136 tiles of 64x32: over one wave
])
def test_narrow_tiles_over_split_decode_at_8_32_tokens(m, n, k, plan):
    assert h.sm90_plan(m, n, k, SMS) == plan
    assert h.sm90_plan(m, n, k, SMS, after_quant=True) == plan


@pytest.mark.parametrize("m,n,k,plan", [
    (17, 6144, 4096, ("gemm", 12)),    # one wave of 128 64x48 tiles (64x64: 96, a quarter idle)
    (32, 6144, 4096, ("gemm", 12)),
    (64, 6144, 4096, ("gemm", 12)),
    (48, 5888, 4096, ("gemm", 12)),    # 123 tiles: >= 90% of the SMs
    (48, 5120, 4096, ("gemm", 6)),     # 107 tiles of 64x48 fill too few: 64x64
    (65, 6144, 4096, ("gemm", 7)),     # two M blocks: 256 tiles of 64x48, over a wave
    (16, 6144, 4096, ("decode", 1, 1, 1, 64)),    # up to 16 tokens decode stays
    (48, 6400, 4096, ("gemm", 6)),     # 134 tiles of 64x48: over one wave
])
def test_64x48_tiles_where_one_wave_fills_the_sms(m, n, k, plan):
    assert h.sm90_plan(m, n, k, SMS) == plan
    assert h.SM90_GEMM_CONFIGS[12][:2] == (64, 48)


def test_tiles_over_decode_rule_yields_to_decode_knobs(monkeypatch):
    # any decode knob set explicitly keeps the decode kernel (the knobs are for sweeps)
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_CTAS", "1")
    assert h.sm90_plan(32, 32768, 512, SMS) == ("decode", 2, 1, 1, 128)
    monkeypatch.delenv("FP8LINEAR_SM90_DECODE_CTAS")
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_MAX_M", "64")
    assert h.sm90_plan(32, 32768, 512, SMS)[0] == "decode"
    assert h.sm90_plan(16, 4096, 4096, SMS)[0] == "decode"


@pytest.mark.parametrize("m,n,k,alone,after_quant", [
    (136, 57344, 8192, 1, 0),   # behind the quant kernel 64x128 tiles lose their L2 sharing
    (192, 24576, 1536, 1, 0),
    (136, 10240, 8192, 1, 1),   # ... unless 128x128 would leave most of a second wave idle
    (136, 4096, 14336, 1, 1),   # one wave of 64x128
    (256, 57344, 8192, 3, 3),   # only at 129-192 tokens (measured)
])
def test_plan_after_quant_kernel(m, n, k, alone, after_quant):
    assert h.sm90_plan(m, n, k, SMS) == ("gemm", alone)
    assert h.sm90_plan(m, n, k, SMS, after_quant=True) == ("gemm", after_quant)


def test_decode_rows_and_splits_forced(monkeypatch):
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_ROWS", "128")
    assert h.sm90_plan(1, 4096, 4096, SMS) == ("decode", 0, 4, 2, 128)
    assert h.sm90_plan(32, 4096, 4096, SMS)[0] == "decode"   # not the 64x64 tiles
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_ROWS", "64")
    assert h.sm90_plan(1, 10240, 8192, SMS) == ("decode", 0, 1, 1, 64)
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_MAX_M", "64")
    assert h.sm90_plan(64, 2112, 7168, SMS)[4] == 64
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_MAX_M", "128")
    assert h.sm90_plan(128, 2112, 7168, SMS)[4] == 128     # 128-token tiles: 128 rows only
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_SPLITS", "3")
    assert h.sm90_plan(1, 4096, 4096, SMS)[2] == 3
    assert h.sm90_plan(1, 4096, 256, SMS)[2] == 2           # never more than the K blocks
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_ROWS", "80")
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_CTAS", "2")
    assert h.sm90_plan(1, 4096, 4096, SMS)[3:] == (1, 80)     # fewer rows: one CTA an SM
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_ROWS", "48")
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_DECODE_ROWS"):
        h.sm90_plan(1, 4096, 4096, SMS)


def test_decode_ctas_forced(monkeypatch):
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_CTAS", "1")
    assert h.sm90_plan(1, 4096, 4096, SMS)[3] == 1
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_CTAS", "2")
    assert h.sm90_plan(1, 7168, 16384, SMS)[3] == 2
    assert h.sm90_plan(32, 7168, 16384, SMS)[3] == 2
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_MAX_M", "64")
    assert h.sm90_plan(64, 2112, 7168, SMS)[3] == 1                # not for 64-token tiles
    monkeypatch.delenv("FP8LINEAR_SM90_DECODE_MAX_M")
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_CTAS", "3")
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_DECODE_CTAS"):
        h.sm90_plan(1, 4096, 4096, SMS)


@pytest.mark.parametrize("m,n,k,cluster", [
    (1, 4096, 4096, False),         # 2 splits, two CTAs an SM: the workspace is faster
    (16, 4096, 4096, False),        # since its handshake is one atomic
    (1, 2112, 7168, False),         # 4 splits: the cluster launch costs more than it saves
    (1, 4096, 14336, False),        # 2 splits, one CTA an SM: clusters would strand SMs per GPC
    (16, 7168, 2048, False),        # one split (64-row tiles): nothing to reduce
    (1, 24576, 1536, False),        # one split
    (1, 256, 4096, False),          # 32 splits: more than a cluster holds
    (64, 2112, 7168, False),        # 64-token tiles (FP8LINEAR_SM90_DECODE_MAX_M=64): one
])                                  # CTA an SM
def test_decode_cluster_reduce(m, n, k, cluster, monkeypatch):
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_MAX_M", "64")
    plan = h.sm90_plan(m, n, k, SMS)
    assert plan[0] == "decode"
    assert h.sm90_decode_cluster_reduce(*plan[1:3]) is cluster
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_CLUSTER", "0")
    assert h.sm90_decode_cluster_reduce(*plan[1:3]) is False
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_CLUSTER", "1")
    # forced on wherever a cluster can hold the splits (2..8) and the tile is <= 32 tokens
    assert h.sm90_decode_cluster_reduce(*plan[1:3]) is (2 <= plan[2] <= 8 and plan[1] <= 2)
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_CLUSTER", "yes")
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_DECODE_CLUSTER='yes'"):
        h.sm90_decode_cluster_reduce(*plan[1:3])


@pytest.mark.parametrize("m,n,k,early", [
    (1, 7168, 2048, False),         # 112 unsplit CTAs: the next GEMM's would only compete
    (16, 6144, 4096, False),        # 96 unsplit CTAs
    (1, 4096, 4096, True),          # 2 splits: the next GEMM streams during our reduction
    (1, 2112, 7168, True),          # 4 splits
    (1, 4096, 14336, False),        # 2 splits of one CTA an SM: the next GEMM's cannot fit
    (1, 4096, 7168, True),          # 4 splits of two CTAs an SM
    (1, 24576, 1536, True),         # 192 CTAs: over a wave
])
def test_decode_early_trigger(m, n, k, early, monkeypatch):
    plan = h.sm90_plan(m, n, k, SMS)
    tiles = h.cdiv(n, plan[4]) * h.cdiv(m, h.SM90_DECODE_TILES[plan[1]])
    assert h.sm90_decode_early_trigger(plan, tiles, SMS) is early
    for v in ("0", "1"):
        monkeypatch.setenv("FP8LINEAR_SM90_DECODE_EARLY_TRIGGER", v)
        assert h.sm90_decode_early_trigger(plan, tiles, SMS) is (v == "1")
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_EARLY_TRIGGER", "yes")
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_DECODE_EARLY_TRIGGER='yes'"):
        h.sm90_decode_early_trigger(plan, tiles, SMS)


@pytest.mark.parametrize("m,k,plan,fused", [
    (1, 4096, ("decode", 0, 2, 2, 128), True),    # 16 K blocks a CTA, one token
    (4, 4096, ("decode", 0, 2, 2, 64), True),     # 4 x 16 = 64 groups
    (8, 4096, ("decode", 0, 2, 2, 64), True),     # 8 x 16 = 128 groups: the limit
    (8, 4352, ("decode", 0, 2, 2, 64), False),    # 8 x 17 groups
    (8, 4096, ("decode", 0, 4, 2, 128), True),    # 8 tokens x 8 blocks
    (16, 2048, ("decode", 1, 4, 2, 128), True),   # 16 x 4 groups
    (16, 2048, ("decode", 1, 2, 2, 64), True),    # 16 x 8 groups
    (16, 2304, ("decode", 1, 2, 2, 64), False),   # 16 x 9 groups
    (1, 4096, ("decode", 0, 1, 1, 128), True),    # 32 blocks: a 32 KB slice, one CTA an SM
    (1, 8192, ("decode", 0, 1, 1, 128), False),   # 64 blocks: the slice would crowd the ring
    (1, 7680, ("decode", 0, 1, 2, 128), False),   # 60 blocks, two CTAs an SM
    (17, 1024, ("decode", 2, 1, 2, 128), False),  # over 16 tokens: the quant kernel
    (1, 4096, ("gemm", 0), False),
])
def test_fuse_quant_only_small_slices(m, k, plan, fused, monkeypatch):
    assert h.sm90_fuse_quant(m, k, plan) is fused
    monkeypatch.setenv("FP8LINEAR_SM90_FUSE_QUANT", "0")
    assert h.sm90_fuse_quant(m, k, plan) is False
    monkeypatch.setenv("FP8LINEAR_SM90_FUSE_QUANT", "1")   # wherever the slice fits
    assert h.sm90_fuse_quant(m, k, plan) is (plan[0] == "decode" and m <= 16
                                             and h.cdiv(h.cdiv(k, 128), plan[2])
                                             * (8 << plan[1]) * 128
                                             <= h.SM90_DECODE_SMEM[plan[3]] // 4)
    monkeypatch.setenv("FP8LINEAR_SM90_FUSE_QUANT", "2")
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_FUSE_QUANT='2'"):
        h.sm90_fuse_quant(m, k, plan)


@pytest.mark.parametrize("m,n,k,split", [
    (1, 7168, 16384, 3),    # 112 tiles, 128 K blocks, one token: split (47.8 vs 58.5 us)
    (16, 8192, 28672, 3),
    (64, 7168, 16384, 1),   # 64 tokens: unsplit (51.7 vs 58.8 us)
    (16, 7168, 2048, 1),    # 16 K blocks: unsplit (8.6 vs 10.5 us)
    (1, 4096, 4096, 5),     # 64 tiles, under half the SMs: split (to ~2 waves)
])
def test_triton_split_k(m, n, k, split):
    assert h.triton_config(m, n, k, 1, False, H100).split == split


@pytest.mark.parametrize("m,n,k,bm,bn", [
    (1024, 2112, 7168, 128, 64),    # 136 tiles of 128x128 for 132 SMs: 64-column tiles
    (4096, 4096, 4096, 128, 128),
    (4096, 32768, 512, 64, 128),    # 4 K blocks: small tiles, several programs an SM
])
def test_triton_large_m_tiles(m, n, k, bm, bn):
    cfg = h.triton_config(m, n, k, 1, False, H100)
    assert (cfg.bm, cfg.bn) == (bm, bn)


@pytest.mark.parametrize("m,n,k,bn", [
    (1, 32768, 512, 256),     # very wide N, few K blocks: 256-column programs
    (1, 24576, 1536, 256),
    (16, 24576, 1536, 64),    # 16 tokens x 12 K blocks: narrow again (measured)
    (16, 32768, 512, 256),
    (1, 7168, 2048, 64),      # 28 programs of 256 would be a fifth of a wave
    (1, 24576, 7168, 64),     # 56 K blocks: enough steps to amortise a narrow program
    (64, 32768, 512, 128),    # 64 tokens, 4 K blocks: 128 columns
    (64, 32768, 1024, 64),
])
def test_triton_decode_tile_width(m, n, k, bn):
    cfg = h.triton_config(m, n, k, 1, False, H100)
    assert cfg.bn == bn and cfg.split == 1


def test_forced_sm90_on_another_gpu_fails_before_launch(monkeypatch):
    import torch

    from fp8linear.kernels import build
    monkeypatch.setenv("FP8LINEAR_BACKEND", "sm90")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 9))
    h._check_sm90_device.cache_clear()
    try:
        with pytest.raises(build.BuildError, match=r"need an sm_90 \(Hopper\) GPU, this one "
                                                   r"is sm_89"):
            h.backend_for(torch.device("cuda", 0), 1, 128, 128)
    finally:
        h._check_sm90_device.cache_clear()


def test_decode_max_m_knob(monkeypatch):
    # default: the decode kernel up to 32 tokens, large-M tiles above (few-row weights: 64)
    assert h.sm90_plan(33, 4096, 4096, SMS)[0] == "gemm"
    assert h.sm90_plan(32, 2112, 7168, SMS)[0] == "decode"
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_MAX_M", "256")
    plan = h.sm90_plan(256, 4096, 4096, SMS)
    assert plan[:2] == ("decode", len(h.SM90_DECODE_TILES) - 1)
    # two 128-token tiles x 32 row tiles: 2 splits fill one wave
    assert plan[2] == SMS // (2 * 32)
    assert h.sm90_plan(257, 4096, 4096, SMS)[0] == "gemm"
    assert h.sm90_plan(64, 6144, 4096, SMS)[:2] == ("decode", 3)   # 64-token tiles
    for bad in ("0", "300", "x"):
        monkeypatch.setenv("FP8LINEAR_SM90_DECODE_MAX_M", bad)
        with pytest.raises(ValueError, match="FP8LINEAR_SM90_DECODE_MAX_M"):
            h.sm90_plan(8, 4096, 4096, SMS)


@pytest.mark.parametrize("m,n,k,config", [
    (192, 4096, 14336, 1),   # 128-row tiles a quarter empty, 96 tiles of 64x128: one wave
    (160, 4096, 7168, 1),
    (256, 4096, 14336, 7),   # full 128-row tiles: one wave of 128x64
    (128, 4096, 14336, 6),   # 128 tiles of 64x64
    (192, 2112, 7168, 6),    # 99 tiles of 64x64
])
def test_narrow_n_mid_m_tiles(m, n, k, config):
    assert h.sm90_plan(m, n, k, SMS) == ("gemm", config)


@pytest.mark.parametrize("m,groups,cap,whole_row,split", [
    (1, 32, 32, True, (4, 4)), (31, 112, 16, False, (4, 4)),  # decode sizes: 4 groups a program
    (32, 32, 32, True, (32, 16)), (8192, 32, 32, True, (32, 16)),  # the norm: its whole row
    (32, 56, 56, True, (64, 16)),                           # (a power of 2, the rest masked)
    (64, 16, 16, True, (16, 8)), (64, 4, 4, True, (4, 4)),  # ~8 values of an operand a thread
    (64, 112, 16, False, (8, 8)), (131, 112, 16, False, (8, 8)),  # SiLU-and-mul below an SM a row
    (132, 112, 16, False, (16, 4)), (8192, 112, 16, False, (16, 4)),   # then its cap
    (4096, 5, 16, False, (8, 4))])                          # short rows
def test_fused_quant_split(m, groups, cap, whole_row, split):
    assert h.fused_quant_split(m, groups, 132, cap, whole_row) == split


def test_gemm_configs_mirror_the_kernel_table():
    # SM90_GEMM_CONFIGS mirrors kConfigs in csrc/sm90/gemm.cu (index = config id)
    import re
    from pathlib import Path
    src = (Path(__file__).resolve().parents[2] / "csrc" / "sm90" / "gemm.cu").read_text()
    table = src[src.index("kConfigs[] = {"):]
    table = table[:table.index("};")]
    rows = re.findall(r"\{(\d+), (\d+), (\d+), (\d+), (true|false), (true|false), (true|false)\}",
                      table)
    assert [(int(a), int(b), int(c), int(d), e == "true", f == "true", g == "true")
            for a, b, c, d, e, f, g in rows] == list(h.SM90_GEMM_CONFIGS)
    # the lean rule is the kernel's: 64-row tiles of <= 64 columns
    assert "return bm == 64 && bn <= 64;" in src
    assert [c for c in range(len(h.SM90_GEMM_CONFIGS)) if h.gemm_lean(c)] == [6, 8, 9, 12]


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
def test_gemm_early_weights_rule(m, k, config, after_quant, early, monkeypatch):
    assert h.sm90_gemm_early_weights(m, k, config, after_quant) == early
    ring = h.SM90_GEMM_CONFIGS[config][2]
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_EARLY_B", "1")
    forced = h.sm90_gemm_early_weights(m, k, config, after_quant)
    assert 0 < forced <= ring and (early == 0 or forced == early)
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_EARLY_STAGES", "2")
    assert h.sm90_gemm_early_weights(m, k, config, after_quant) == 2
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_EARLY_STAGES", "64")
    assert h.sm90_gemm_early_weights(m, k, config, after_quant) == ring
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_EARLY_B", "0")
    assert h.sm90_gemm_early_weights(m, k, config, after_quant) == 0
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_EARLY_B", "2")
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_GEMM_EARLY_B"):
        h.sm90_gemm_early_weights(m, k, config, after_quant)
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_EARLY_B", "1")
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_EARLY_STAGES", "0")
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_GEMM_EARLY_STAGES"):
        h.sm90_gemm_early_weights(m, k, config, after_quant)


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
def test_gemm_group_m_rule(m, k, group, monkeypatch):
    assert h.sm90_gemm_group_m(m, k) == group
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_GROUP_M", "3")
    assert h.sm90_gemm_group_m(m, k) == 3
    monkeypatch.setenv("FP8LINEAR_SM90_GEMM_GROUP_M", "0")
    with pytest.raises(ValueError, match="FP8LINEAR_SM90_GEMM_GROUP_M"):
        h.sm90_gemm_group_m(m, k)


def test_fused_quant_early_trigger_rule(monkeypatch):
    # the norm while its rows are split over programs (< 32 rows); never SiLU-and-mul
    assert h.fused_quant_early_trigger(1, True) and h.fused_quant_early_trigger(31, True)
    assert not h.fused_quant_early_trigger(32, True)
    assert not h.fused_quant_early_trigger(16, False)
    monkeypatch.setenv("FP8LINEAR_FUSED_QUANT_EARLY_TRIGGER", "0")
    assert not h.fused_quant_early_trigger(64, True)
    monkeypatch.setenv("FP8LINEAR_FUSED_QUANT_EARLY_TRIGGER", "1")
    assert h.fused_quant_early_trigger(4096, True) and h.fused_quant_early_trigger(64, False)
    monkeypatch.setenv("FP8LINEAR_FUSED_QUANT_EARLY_TRIGGER", "yes")
    with pytest.raises(ValueError,
                       match="FP8LINEAR_FUSED_QUANT_EARLY_TRIGGER='yes': expected 0 or 1"):
        h.fused_quant_early_trigger(16, True)


def test_waves_count_whole_pairs():
    """A pair's CTAs take adjacent tiles along M (sharing the weight tile) or N (sharing the
    activation tile): an odd tile count there still takes whole pairs of CTAs."""
    c11, c5 = h.SM90_GEMM_CONFIGS[11], h.SM90_GEMM_CONFIGS[5]      # 128x160 / 256x128 pairs
    # 5 x 45 tiles of 128x160 at M = 640, N = 7168: 3 x 45 pair units, 270 CTAs, 3 waves
    assert h._waves_x_area(640, 7168, 132, c11) == 3 * 128 * 160
    assert h._waves_x_area(512, 7168, 132, c11) == 2 * 128 * 160   # 4 x 45: 180 CTAs
    # 256x128 pairs share the activation tile along N: 17 N tiles (2112) take 9 pairs
    assert h._waves_x_area(2048, 2112, 132, c5) == h._waves_x_area(2048, 2304, 132, c5)


def test_split_tail_parts():
    """The split tail: a ragged last wave of 128x192 tiles of at most half the SMs, split into
    K ranges of >= 32 blocks, all in one wave."""
    assert h.split_tail_parts(640, 7168, 16384, 132) == 2      # 190 tiles: 58 in the tail
    assert h.split_tail_parts(1920, 7168, 16384, 132) == 3     # 570: 42 in the tail, 3 x 42 blocks
    assert h.split_tail_parts(2048, 2112, 7168, 132) == 0      # 3 parts of 18 blocks: too short
    assert h.split_tail_parts(512, 7168, 16384, 132) == 0      # tail 20: 6 parts of 21
    assert h.split_tail_parts(1024, 8448, 16384, 132) == 0     # 8 x 44 = 352: tail 88, over half
    assert h.split_tail_parts(4096, 6144, 4096, 132) == 0      # 32 x 32 = 1024: tail 100
    assert h.gemm_split_tail(15) and not any(h.gemm_split_tail(c) for c in range(15))
