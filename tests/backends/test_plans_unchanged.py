"""The restructured dispatch returns exactly the plans the code before it chose.

tests/backends/data/dispatch_snapshot.json.gz was written by the pre-restructuring code
(commit 2d07e25): for the 14 benchmark shapes at every M = 1..8192, the sm90 launch of
fp8_linear (bf16 and fp32 activations) and block_fp8_gemm; the same for the GPU tests' shapes
and 3000 random aligned shapes; the Triton tiles on four device profiles; the fused quant
kernels' split. Runs of equal decisions over M are stored as [first M, last M, decision].
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from fp8linear.backends.sm90 import launch as sm90_launch
from fp8linear.backends.triton import plan as triton_plan

SNAP = json.loads(gzip.decompress((Path(__file__).parent / "data" /
                                   "dispatch_snapshot.json.gz").read_bytes()))
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(autouse=True)
def _h100(monkeypatch):
    monkeypatch.setattr(sm90_launch, "num_sms", lambda index: SNAP["sms"])


def _old_form(lp) -> list:
    p = lp.plan
    plan = (["decode", p.config, p.splits, p.ctas_per_sm, p.rows] if p.kind == "decode"
            else ["gemm", p.config])
    return [plan, lp.fused, lp.tiles, lp.ws_floats, lp.early, lp.gemm_pdl, lp.gemm_early_b,
            lp.gemm_group_m]


def _expand(runs):
    for first, last, value in runs:
        for m in range(first, last + 1):
            yield m, value


@pytest.mark.parametrize("key", sorted(SNAP["sm90"]))
def test_sm90_benchmark_shapes_every_m(key):
    shape, dtype, op = key.split(":")
    n, k = map(int, shape.split("x"))
    bad = [(m, want, got) for m, want in _expand(SNAP["sm90"][key])
           if (got := _old_form(sm90_launch.decide(m, n, k, DTYPES[dtype], 0,
                                                   op == "linear"))) != want]
    assert not bad, f"{len(bad)} M differ, first: {bad[:3]}"


def test_sm90_test_and_random_shapes():
    bad = [(m, n, k, dt, lin, want, got) for m, n, k, dt, lin, want in SNAP["points"]
           if (got := _old_form(sm90_launch.decide(m, n, k, DTYPES[dt], 0, lin))) != want]
    assert not bad, f"{len(bad)} of {len(SNAP['points'])} differ, first: {bad[:3]}"


DEVICES = {"h100": triton_plan.TritonDevice(132, 227 * 1024, False, (9, 0)),
           "ada": triton_plan.TritonDevice(128, 99 * 1024, False, (8, 9)),
           "a100": triton_plan.TritonDevice(108, 163 * 1024, False, (8, 0)),
           "mi300": triton_plan.TritonDevice(304, 64 * 1024, True, (9, 4))}


@pytest.mark.parametrize("dev", sorted(DEVICES))
def test_triton_tiles(dev):
    bad = []
    for key, runs in SNAP["triton"].items():
        d, shape, a_bytes, wo = key.split(":")
        if d != dev:
            continue
        n, k = map(int, shape.split("x"))
        for m, want in _expand(runs):
            got = list(triton_plan.choose(m, n, k, int(a_bytes), wo == "1", DEVICES[dev]))
            if got != want:
                bad.append((key, m, want, got))
    assert not bad, f"{len(bad)} differ, first: {bad[:3]}"


def test_fused_quant_plans():
    split = SNAP["fused_quant"]["split"]
    assert [list(triton_plan.fused_quant_split(*row[:5])) for row in split] == \
        [row[5] for row in split]
    early = SNAP["fused_quant"]["early"]
    assert [triton_plan.fused_quant_early_trigger(m, norm) for m, norm, _ in early] == \
        [want for _, _, want in early]
