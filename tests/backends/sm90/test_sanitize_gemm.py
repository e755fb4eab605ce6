"""tests/kernels/sanitize_gemm.py, the script the device's compute-sanitizer steps run, as a
dry run on the CPU (the torch reference in place of the kernels): every case right, and under
--configs all every knob set visited, the decode plans for the decode cases only. A broken
script would otherwise first show on the GPU machine, as a sanitizer step that checks nothing."""
from __future__ import annotations

import os

from fp8linear.kernels import heuristics
from tests.kernels import sanitize_gemm as S


def test_sanitize_script_dry_run_visits_every_knob_set(capsys):
    saved = dict(os.environ)
    try:
        assert S.main(["--device", "cpu", "--configs", "all"]) == 0
    finally:  # (the script sets the backend and the knobs in os.environ)
        os.environ.clear()
        os.environ.update(saved)
        heuristics.reload_env()
    out = capsys.readouterr().out
    blocks = out.split("knobs: ")
    n_cfg = len(heuristics.SM90_GEMM_CONFIGS)
    assert len(blocks) == 1 + n_cfg + len(S.DECODE_PLANS)
    n_cases = len(S.CASES)
    n_decode = sum(c[0] <= heuristics.SM90_DECODE_MAX_M for c in S.CASES)
    # the heuristic's plans and each large-M configuration: every case; the decode plans:
    # the decode cases only
    counts = [b.count(" ok") for b in blocks]
    assert counts == [n_cases] * (1 + n_cfg) + [n_decode] * len(S.DECODE_PLANS), counts
    for plan, block in zip(S.DECODE_PLANS, blocks[1 + n_cfg:]):
        assert block.startswith(",".join(f"{k}={v}" for k, v in plan.items()))
    assert "ALL OK" in out and "FAIL" not in out
