"""benchmarks/bench_moe.py's table on the CPU: each method's time and fp8linear's speedup over the
faster vLLM method of the point (the DeepGEMM anchor has rows only where vLLM runs it)."""
from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import bench_moe  # noqa: E402


def _row(method, m, us, floor=50.0):
    return {"method": method, "model": "qwen3_30b_a3b", "M": m, "us": us,
            "pct_floor": 100 * floor / us}


def test_summary_takes_the_faster_vllm_method_of_each_point():
    rows = [_row("fp8linear_moe", 1, 25.0), _row("vllm_triton_moe", 1, 37.5),
            _row("fp8linear_moe", 4096, 600.0), _row("vllm_triton_moe", 4096, 900.0),
            _row("vllm_deepgemm_moe", 4096, 690.0)]
    lines = bench_moe.summary(rows, ["fp8linear_moe", "vllm_triton_moe",
                                     "vllm_deepgemm_moe"]).splitlines()
    assert lines[0].split()[-4:] == ["fp8linear", "vs", "best", "vLLM"]
    m1, m4096 = lines[1].split(), lines[2].split()
    assert m1[:2] == ["qwen3_30b_a3b", "1"] and m1[-1] == "1.50x"   # Triton: no DeepGEMM row
    assert "(200%)" in lines[1] and len(m1) == 2 + 2 * 2 + 1      # two methods' columns
    assert m4096[:2] == ["qwen3_30b_a3b", "4096"] and m4096[-1] == "1.15x"  # DeepGEMM's 690
