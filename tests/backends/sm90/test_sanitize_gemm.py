"""tests/backends/sm90/sanitize_gemm.py, the script the device's compute-sanitizer steps run,
as a dry run on the CPU (the torch reference in place of the kernels): its checks pass right
results and fail wrong ones, and under --configs all each forced plan is in force while its
cases run, the decode plans for the decode cases only. A broken script would otherwise first
show on the GPU machine, as a sanitizer step that checks nothing."""
from __future__ import annotations

import os

import pytest
import torch

import fp64_reference as ref
import fp8linear
from fp8linear import knobs
from fp8linear.backends.sm90 import plan
from fp8linear.backends.sm90.tiles import GEMM_TILES

from . import sanitize_gemm as S


@pytest.fixture
def script_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()   # (the script sets FP8LINEAR_BACKEND in os.environ)
    os.environ.update(saved)
    knobs.reload()


def test_sanitize_script_passes_right_results(script_env, capsys):
    assert S.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok\n") == len(S.CASES) + len(S.MOE_CASES)
    assert out.count("\nmoe case ") == len(S.MOE_CASES) and "ALL OK" in out and "FAIL" not in out


def test_sanitize_script_fails_wrong_moe_results(script_env, capsys, monkeypatch):
    real = fp8linear.fused_moe
    monkeypatch.setattr(fp8linear, "fused_moe", lambda *a: real(*a) * 1.05)
    assert S.main(["--device", "cpu", "--quick"]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if "moe case" in line]
    # (--quick: every MoE case, fewer dense ones)
    assert len(fails) == len(S.MOE_CASES) and all(" FAIL fused_moe: rel err " in line and
                                   line.endswith(" against moe_reference") for line in fails)


@pytest.mark.parametrize("broken", ["block_fp8_gemm", "fp8_linear"])
def test_sanitize_script_fails_wrong_results(script_env, capsys, monkeypatch, broken):
    # a result off by more than the tolerance, and one holding a NaN: each case fails, the
    # script exits 1
    real = getattr(fp8linear, broken)
    calls = []

    def wrong(*args, **kwargs):
        y = real(*args, **kwargs)
        calls.append(1)
        if len(calls) % 2:
            y.mul_(1.01)
        else:
            y.view(-1)[0] = float("nan")
        return y

    monkeypatch.setattr(fp8linear, broken, wrong)
    assert S.main(["--device", "cpu", "--quick"]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("case ")]
    assert len(fails) == len(S.QUICK)
    for i, line in enumerate(fails):
        why = "rel err" if i % 2 == 0 else "1 NaN/inf outputs"
        assert line.endswith(f" FAIL {broken}: {why}") or f" FAIL {broken}: {why} " in line, \
            line
    assert f"sanitize_gemm: {len(S.QUICK)} FAILED" in out


def test_sanitize_script_dry_run_forces_every_plan(script_env, capsys, monkeypatch):
    """--configs all: the rules' plans for every case, then each large-M configuration forced
    for every case, then each decode plan forced for the decode cases; what is forced is in
    force while the case runs (the results themselves: the tests above)."""
    seen = []

    def run_case(i, m, n, k, per_row, dtype, with_bias, dev="cuda"):
        seen.append((i, plan.current()))
        return []

    monkeypatch.setattr(S, "run_case", run_case)
    assert S.main(["--device", "cpu", "--configs", "all"]) == 0
    assert plan.current() == plan.NONE     # nothing stays forced after the script
    cases = list(range(len(S.CASES)))
    decode = [i for i, c in enumerate(S.CASES) if c[0] <= plan.DECODE_MAX_M]
    assert 0 < len(decode) < len(cases)
    want = [(i, plan.NONE) for i in cases]
    want += [(i, plan.Overrides(gemm_config=c)) for c in range(len(GEMM_TILES)) for i in cases]
    want += [(i, plan.Overrides(**pieces)) for pieces in S.DECODE_PLANS for i in decode]
    assert seen == want
    out = capsys.readouterr().out
    blocks = out.split("forced: ")
    assert len(blocks) == 1 + len(GEMM_TILES) + len(S.DECODE_PLANS)
    for c, block in enumerate(blocks[1:1 + len(GEMM_TILES)]):
        assert block.startswith(f"gemm_config={c}\n")
    for pieces, block in zip(S.DECODE_PLANS, blocks[1 + len(GEMM_TILES):]):
        assert block.startswith(",".join(f"{k}={v}" for k, v in pieces.items()) + "\n")
    assert "ALL OK" in out


def test_sanitize_script_reference_is_the_fp64_product():
    # run_case's reference: the dequantized operands in fp64 (as tests/fp64_reference.py
    # writes them), block and per-row scales
    g = torch.Generator().manual_seed(0)
    q, s = fp8linear.quantize_weight(torch.randn(200, 300, generator=g))
    assert torch.equal(S.deq64(q, s), ref.dequant(q, s))
    qa, sa = fp8linear.quantize_activation(torch.randn(200, 300, generator=g))
    assert torch.equal(S.deq64(qa, sa), ref.dequant(qa, sa))
