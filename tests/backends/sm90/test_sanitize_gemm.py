"""tests/backends/sm90/sanitize_gemm.py, the script the device's compute-sanitizer steps run,
as a dry run on the CPU (the torch reference in place of the kernels): every case right, and
under --configs all every forced plan visited, the decode plans for the decode cases only. A
broken script would otherwise first show on the GPU machine, as a sanitizer step that checks
nothing."""
from __future__ import annotations

import os

from fp8linear import knobs
from fp8linear.backends.sm90 import plan
from fp8linear.backends.sm90.tiles import GEMM_TILES

from . import sanitize_gemm as S


def test_sanitize_script_dry_run_visits_every_forced_plan(capsys):
    saved = dict(os.environ)
    try:
        assert S.main(["--device", "cpu", "--configs", "all"]) == 0
    finally:  # (the script sets FP8LINEAR_BACKEND in os.environ)
        os.environ.clear()
        os.environ.update(saved)
        knobs.reload()
    assert plan.current() == plan.NONE     # nothing stays forced after the script
    out = capsys.readouterr().out
    blocks = out.split("forced: ")
    n_cfg = len(GEMM_TILES)
    assert len(blocks) == 1 + n_cfg + len(S.DECODE_PLANS)
    n_cases = len(S.CASES)
    n_decode = sum(c[0] <= plan.DECODE_MAX_M for c in S.CASES)
    # the rules' plans and each large-M configuration: every case; the decode plans:
    # the decode cases only
    counts = [b.count(" ok") for b in blocks]
    assert counts == [n_cases] * (1 + n_cfg) + [n_decode] * len(S.DECODE_PLANS), counts
    for c, block in enumerate(blocks[1:1 + n_cfg]):
        assert block.startswith(f"gemm_config={c}\n")
    for pieces, block in zip(S.DECODE_PLANS, blocks[1 + n_cfg:]):
        assert block.startswith(",".join(f"{k}={v}" for k, v in pieces.items()))
    assert "ALL OK" in out and "FAIL" not in out
