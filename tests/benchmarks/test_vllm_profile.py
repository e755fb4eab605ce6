"""CPU test of benchmarks/vllm_profile.py's accounting (no vLLM, no GPU): kernels grouped by
name, exposed time under overlapping (PDL) kernels, idle gaps, the per-step difference."""
import pytest

import vllm_profile as P

DECODE = ("void fp8l::fp8_decode_kernel<8, 128, false, __nv_bfloat16, "
          "2, false, false, {}, {}>(CUtensorMap_st, CUtensorMap_st, fp8l::DecodeParams)")
GEMM = ("void fp8l::fp8_gemm_kernel<128, 128, 6, 1, false, false, "
        "false, true, false, __nv_bfloat16, {}, true>(CUtensorMap_st, CUtensorMap_st)")


@pytest.mark.parametrize("name, group", [
    (DECODE.format("true", "true"), "fp8linear MoE GEMM"),     # slot tiles
    (DECODE.format("true", "false"), "fp8linear MoE GEMM"),    # sorted tiles
    (DECODE.format("false", "false"), "fp8linear gemm"),       # a dense layer
    (GEMM.format("true"), "fp8linear MoE GEMM"),               # the prefill kernel
    (GEMM.format("false"), "fp8linear gemm"),
    ("_combine_kernel", "fp8linear MoE stages"),
    ("_route_place_kernel", "fp8linear MoE stages"),
    ("_silu_mul_quant_kernel", "fp8linear fused quant"),
    ("fused_moe_kernel", "vLLM MoE"),
    ("void vllm::moe::topkGatingSoftmax<float, 4, 8>(float const*)", "vLLM MoE"),
    ("FlashAttnFwdSm90", "attention"),
    ("nvjet_tst_128x64", "cutlass / cublas (lm_head)"),
    ("some_unknown_kernel", "other"),
])
def test_group_of(name, group):
    assert P.group_of(name) == group


def test_exposed_time_counts_overlap_once_and_idle_gaps():
    # a: 0-10; b (PDL: starts under a) 5-18 exposes 8; c inside b exposes 0; idle 18-20;
    # d 20-25
    t = P.kernel_times([("b", 5.0, 18.0), ("a", 0.0, 10.0), ("c", 6.0, 12.0),
                        ("d", 20.0, 25.0)])
    assert t["a"] == [10.0, 10.0, 1]
    assert t["b"] == [13.0, 8.0, 1]
    assert t["c"] == [6.0, 0.0, 1]
    assert t["d"] == [5.0, 5.0, 1]
    assert t[P.IDLE][1] == 2.0
    assert sum(v[1] for v in t.values()) == 25.0   # exposed + idle = the span


def test_per_step_is_the_difference_over_steps():
    short = {"a": [10.0, 8.0, 1], "gone": [3.0, 3.0, 1]}
    long = {"a": [50.0, 40.0, 5], "new": [8.0, 4.0, 4], "gone": [3.0, 3.0, 1]}
    per = P.per_step(short, long, steps=4)
    assert per == {"a": (10.0, 8.0, 1.0), "new": (2.0, 1.0, 1.0)}


def test_report_sorts_by_exposed_time():
    per = {"_combine_kernel": (3.0, 1.0, 1.0), "fused_moe_kernel": (9.0, 6.0, 2.0),
           P.IDLE: (0.0, 2.5, 0.0)}
    text = P.report(per, "# t", 12.0, top=5)
    lines = text.splitlines()
    assert lines[1] == "step wall 12 us: kernels exposed 7 us, idle between kernels 2 us " \
                       "(the rest: between the profiled steps)"
    groups = lines[lines.index("## by group (exposed us / step, duration us / step, kernels "
                               "/ step)") + 1:]
    assert groups[0].split()[:3] == ["6.0", "9.0", "2.0"] and groups[0].endswith("vLLM MoE")
    kernels = [ln for ln in lines if ln.endswith("_kernel")]
    assert [k.split()[-1] for k in kernels] == ["fused_moe_kernel", "_combine_kernel"]
    assert kernels[0].split()[3] == "3.00"     # exposed us each: 6.0 / 2 launches
