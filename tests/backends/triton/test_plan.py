"""The Triton backend's plans (fp8linear/backends/triton/plan.py), on the CPU: the GEMM's tiles
and split-K on an H100 profile, and the split of the kernels that quantize their own output
(norm, SiLU-and-mul). The measurements behind each rule: docs/tuning.md."""
from __future__ import annotations

import pytest

from expect import raises_exactly, undocumented
from fp8linear.backends.triton import plan

SMS = 132
H100 = plan.TritonDevice(SMS, 227 * 1024, False, (9, 0))


@pytest.mark.parametrize("m,n,k,split", [
    (1, 7168, 16384, 3),    # 112 tiles, 128 K blocks, one token: split (47.8 vs 58.5 us)
    (16, 8192, 28672, 3),
    (64, 7168, 16384, 1),   # 64 tokens: unsplit (51.7 vs 58.8 us)
    (16, 7168, 2048, 1),    # 16 K blocks: unsplit (8.6 vs 10.5 us)
    (1, 4096, 4096, 5),     # 64 tiles, under half the SMs: split (to ~2 waves)
])
def test_split_k(m, n, k, split):
    assert plan.choose(m, n, k, 1, False, H100).split == split


@pytest.mark.parametrize("m,n,k,bm,bn", [
    (1024, 2112, 7168, 128, 64),    # 136 tiles of 128x128 for 132 SMs: 64-column tiles
    (4096, 4096, 4096, 128, 128),
    (4096, 32768, 512, 64, 128),    # 4 K blocks: small tiles, several programs an SM
])
def test_large_m_tiles(m, n, k, bm, bn):
    cfg = plan.choose(m, n, k, 1, False, H100)
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
def test_decode_tile_width(m, n, k, bn):
    cfg = plan.choose(m, n, k, 1, False, H100)
    assert cfg.bn == bn and cfg.split == 1


def test_cpu_tensors_plan_as_for_an_h100():
    # TRITON_INTERPRET=1 runs on CPU tensors: those plan as on an H100
    assert plan.device_info("cpu", 0) == H100


@pytest.mark.parametrize("m,groups,cap,whole_row,split", [
    (1, 32, 32, True, (4, 4)), (31, 112, 16, False, (4, 4)),  # decode sizes: 4 groups a program
    (32, 32, 32, True, (32, 16)), (8192, 32, 32, True, (32, 16)),  # the norm: its whole row
    (32, 56, 56, True, (64, 16)),                           # (a power of 2, the rest masked)
    (64, 16, 16, True, (16, 8)), (64, 4, 4, True, (4, 4)),  # ~8 values of an operand a thread
    (64, 112, 16, False, (8, 8)), (131, 112, 16, False, (8, 8)),  # SiLU-and-mul below an SM a row
    (132, 112, 16, False, (16, 4)), (8192, 112, 16, False, (16, 4)),   # then its cap
    (4096, 5, 16, False, (8, 4))])                          # short rows
def test_fused_quant_split(m, groups, cap, whole_row, split):
    assert plan.fused_quant_split(m, groups, SMS, cap, whole_row) == split


def test_fused_quant_early_trigger_rule():
    # the norm while its rows are split over programs (< 32 rows); never SiLU-and-mul
    assert plan.fused_quant_early_trigger(1, True) and plan.fused_quant_early_trigger(31, True)
    assert not plan.fused_quant_early_trigger(32, True)
    assert not plan.fused_quant_early_trigger(16, False)
    with plan.forced(fused_quant_early_trigger=False):
        assert not plan.fused_quant_early_trigger(64, True)
        assert not plan.fused_quant_early_trigger(1, True)
    with plan.forced(fused_quant_early_trigger=True):
        assert plan.fused_quant_early_trigger(4096, True)
        assert plan.fused_quant_early_trigger(64, False)
    assert plan.fused_quant_early_trigger(1, True) and not plan.fused_quant_early_trigger(64, True)
    msg = "forced fused_quant_early_trigger='yes': expected True, False or None"
    with raises_exactly(ValueError, msg):
        with plan.forced(fused_quant_early_trigger="yes"):
            pass


def test_every_rule_has_its_measurements_in_tuning_md():
    rules = plan.TILE_RULES + plan.ADJUSTMENTS
    assert all(r.reason and "\n" not in r.reason for r in rules)
    assert undocumented(r.id for r in rules) == []
