"""CPU test of benchmarks/e2e_report.py: the MoE model's targets, and the TP / EP engines
against their TP1 engine (log-probabilities, the table's lines)."""
import pytest

import e2e_report as R

DENSE = {"layers": 32}  # a dense model's header: bf16 is the log-probability reference


def test_moe_model_has_its_own_targets_and_prefill_target():
    """The MoE model (issue 42): 1.25x at batch 1 and 4, 1.10x at 16 and 64, prefill 1.10x."""
    def eng(per, prefill_s):
        return {"decode": [{"batch": b, "per_token_ms": ms} for b, ms in zip((1, 4, 16, 64),
                                                                           per)],
                "prefill": {"best_s": prefill_s}}
    results = {"fp8_blockgemm": eng([4.0, 6.0, 10.0, 15.0], 0.70),
               "fp8_cutlass": eng([4.8, 7.2, 11.5, 16.0], 0.75)}
    t = R.targets(results, [1, 4, 16, 64], {"num_experts": 128})
    assert t["fp8_blockgemm vs best vLLM fp8 (need >= 1.25x at b1/b4, 1.10x at b16/b64)"] == \
        "b1 1.20x FAIL, b4 1.20x FAIL, b16 1.15x PASS, b64 1.07x FAIL"
    assert t["fp8_blockgemm prefill vs best vLLM fp8 (need >= 1.10x)"] == "1.07x FAIL"
    dense = R.targets(results, [1, 4, 16, 64], {"layers": 8})
    assert dense["fp8_blockgemm vs best vLLM fp8 (need >= 1.15x)"] == \
        "b1 1.20x PASS, b4 1.20x PASS, b16 1.15x PASS, b64 1.07x FAIL"
    assert not any("prefill" in k for k in dense)
    # a prefill anchor kept by --merge under another setting counts, as its decode does
    results["fp8_deepgemm_seqs256"] = eng([5.0, 7.0, 12.0, 17.0], 0.63)
    t = R.targets(results, [1, 4, 16, 64], {"num_experts": 128})
    assert t["fp8_blockgemm prefill vs best vLLM fp8 (need >= 1.10x)"] == "0.90x FAIL"


def _scored(prompt_d, greedy_d, top1_miss=0, greedy=None, own=False):
    """An engine's log-probability fields: the reference's -1.0 everywhere plus the deltas."""
    n = 127                                                # LP_PROMPT_LEN - 1
    seq = list(range(128)) + (list(range(900, 932)) if not own else list(range(800, 832)))
    lp = [-1.0 - prompt_d] * n + [-1.0 - d for d in greedy_d]
    top = [1] * (n + 32)
    for i in range(top1_miss):
        top[i] = 2
    return {"tf_seq": seq, "tf_logprobs": lp, "tf_top1": top,
            "tf_source": "own" if own else "bf16",
            "greedy_tokens": greedy or list(range(32)), "llm_kwargs": {}}


def test_parallel_engines_compared_with_their_tp1_engine():
    """X@tpN / X@epN against X on the same scored sequence: |delta logprob| of the prompt and
    greedy tokens, top-1 agreement, greedy tokens; prompt only where each scored its own."""
    div = list(range(30)) + [77, 78]
    results = {
        "bf16": _scored(0, [0] * 32),
        "bf16@tp2": _scored(0.001, [0] * 32),
        "fp8_blockgemm": _scored(0, [0] * 32),
        "fp8_blockgemm@tp2": _scored(0.01, [0] * 31 + [0.5], top1_miss=4, greedy=div),
        "fp8_blockgemm@ep2": _scored(0.02, [3.0] * 32, own=True),
        "fp8_cutlass@tp2": _scored(0, [0] * 32)}
    par = R.compare_variants(results)["parallel_vs_tp1"]
    tp2 = par["fp8_blockgemm@tp2"]
    assert tp2["prompt_abs_dlogprob_mean"] == pytest.approx(0.01)
    assert tp2["prompt_abs_dlogprob_max"] == pytest.approx(0.01)
    assert tp2["greedy_abs_dlogprob_mean"] == pytest.approx(0.5 / 32)
    assert tp2["greedy_abs_dlogprob_max"] == pytest.approx(0.5)
    assert tp2["top1_agreement"] == pytest.approx(155 / 159)
    assert (tp2["scored"], tp2["greedy_tokens_equal"], tp2["greedy_first_divergence"]) == (
        "prompt + bf16's greedy tokens", False, 30)
    ep2 = par["fp8_blockgemm@ep2"]                      # its own continuation: not compared
    assert (ep2["scored"], ep2["greedy_abs_dlogprob_mean"], ep2["greedy_tokens_equal"]) == (
        "prompt only", None, True)
    assert ep2["prompt_abs_dlogprob_max"] == pytest.approx(0.02)
    assert ep2["top1_agreement"] == 1.0
    assert par["fp8_cutlass@tp2"] == {"error": "no TP1 engine fp8_cutlass in this run"}
    assert par["bf16@tp2"]["prompt_abs_dlogprob_max"] == pytest.approx(0.001)
    dummy = dict(results, **{n: dict(results[n], llm_kwargs={"load_format": "dummy"})
                             for n in ("bf16", "bf16@tp2")})     # (the MoE model's bf16)
    assert R.compare_variants(dummy)["parallel_vs_tp1"]["bf16@tp2"] == {
        "error": "dummy weights differ between TP sizes: not compared"}
    assert list(par) == ["bf16@tp2", "fp8_blockgemm@tp2", "fp8_blockgemm@ep2",
                         "fp8_cutlass@tp2"]
    # the reference comparison (dense: bf16) leaves bf16@tp2 out, keeps the TP engines
    lp = R.compare_logprobs(results, DENSE)
    assert sorted(lp) == ["fp8_blockgemm", "fp8_blockgemm@ep2", "fp8_blockgemm@tp2",
                          "fp8_cutlass@tp2"]
    assert lp["fp8_blockgemm@tp2"]["greedy_abs_dlogprob_max"] == pytest.approx(0.5)
    doc = {"header": {"model": {"layers": 32}, "batches": [1], "compile": "none"},
           "engines": results, **R.compare_variants(results)}
    lines = R.table(doc).splitlines()
    assert ("fp8_blockgemm@tp2 vs TP1 fp8_blockgemm: greedy |dlogprob| mean/max 0.016/0.500, "
            "prompt |dlogprob| mean/max 0.010/0.010, top-1 agreement 0.975, greedy tokens "
            "differ from #30") in lines
    assert ("fp8_blockgemm@ep2 vs TP1 fp8_blockgemm: prompt |dlogprob| mean/max 0.020/0.020, "
            "top-1 agreement 1.000, greedy tokens equal") in lines
    assert "fp8_cutlass@tp2 vs TP1 fp8_cutlass: no TP1 engine fp8_cutlass in this run" in lines


def test_a_run_names_its_model_tiny_shapes_apart():
    # the table's and plot's title: the full shapes by their layers, the CPU plumbing shapes
    # by name (not as the model whose architecture they share)
    from e2e_moe_model import QWEN3_30B_A3B, TINY_MOE
    assert (R.model_name({"layers": 48, "shape": "qwen3_30b_a3b", **QWEN3_30B_A3B})
            == "48-layer Qwen3-30B-A3B-shaped model")
    assert (R.model_name({"layers": 8, **QWEN3_30B_A3B})  # (a header from before "shape")
            == "8-layer Qwen3-30B-A3B-shaped model (NOT the 48-layer model)")
    assert (R.model_name({"layers": 2, "shape": "tiny_moe", **TINY_MOE})
            == "2-layer tiny_moe model (a small Qwen3-30B-A3B-architecture one)")
