"""benchmarks/bench_moe.py on the CPU: its table (each method's time and fp8linear's speedup over
the faster vLLM method of the point; the DeepGEMM anchor has rows only where vLLM runs it) and
the plan pieces its exploration methods force."""
from __future__ import annotations

import pytest

import bench_moe


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


def test_summary_adds_the_ratio_of_methods_run_alone_where_sustained_timed_them():
    rows = [_row("fp8linear_moe", 4096, 600.0), _row("vllm_deepgemm_moe", 4096, 690.0),
            _row("fp8linear_moe", 1024, 300.0), _row("vllm_deepgemm_moe", 1024, 330.0)]
    rows[0]["us_sustained"], rows[1]["us_sustained"] = 660.0, 693.0
    lines = bench_moe.summary(rows, ["fp8linear_moe", "vllm_deepgemm_moe"]).splitlines()
    assert lines[1].split()[-1] == "1.10x"                      # 1024: not timed alone
    assert lines[2].split()[-3:] == ["1.15x", "(alone", "1.05x)"]


def test_exploration_methods_force_the_plan_pieces_they_name():
    from fp8linear.backends.sm90 import moe_plan
    assert bench_moe.forced_pieces("t64") == {"token_tile": 64}
    assert bench_moe.forced_pieces("nopdl") == {"pdl": False}
    assert bench_moe.forced_pieces("decode") == {"prefill": False}
    assert bench_moe.forced_pieces("slots") == {"slot_tiles": True}
    assert bench_moe.forced_pieces("sorted") == {"slot_tiles": False}
    assert bench_moe.forced_pieces("unfused") == {"fused_act": False}
    assert bench_moe.forced_pieces("g8") == {"group_m": 8}
    assert bench_moe.forced_pieces("nodownroute+downroute") == {"down_route": True}
    assert bench_moe.forced_pieces("c14+unfused") == {"prefill_config": 14, "fused_act": False}
    assert bench_moe.forced_pieces("s2+t16") == {"splits": 2, "token_tile": 16}
    assert bench_moe.forced_pieces("w0+s2") == {"window": 0, "splits": 2}
    assert bench_moe.forced_pieces("slots+k3") == {"slot_tiles": True, "ctas": 3}
    with pytest.raises(ValueError, match=r"^unknown forced piece 'fast'$"):
        bench_moe.forced_pieces("fast")
    with pytest.raises(ValueError, match=r"^unknown forced piece 'c'$"):
        bench_moe.forced_pieces("c14+c")
    # each one forced() takes
    for piece in ("t64", "nopdl", "prefill", "slots", "sorted", "g8", "c14+unfused", "s2",
                  "slots+k3"):
        with moe_plan.forced(**bench_moe.forced_pieces(piece)):
            assert moe_plan._forced
