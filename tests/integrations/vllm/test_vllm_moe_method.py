"""The plugin's MoE experts class and its per-layer choice, without an engine: routing for
expert parallelism, ``apply`` against fp8linear.moe_reference, and the fallback reasons."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moe_cases
from fp8linear import moe_reference

moe_method = pytest.importorskip("fp8linear_vllm.moe_method")
compat = pytest.importorskip("fp8linear_vllm.compat")

E, H, I, K = 6, 256, 128, 2


@pytest.fixture(scope="module")
def layer_data():
    g = torch.Generator().manual_seed(7)
    w13, s13 = moe_cases.experts(E, 2 * I, H, g)
    w2, s2 = moe_cases.experts(E, H, I, g)
    x = torch.randn(5, H, generator=g).to(torch.bfloat16)
    ids = moe_cases.topk_ids(5, K, E, g, "random")
    weights = torch.rand(5, K, generator=g)
    return x, w13, s13, w2, s2, weights, ids


def _experts(s13, s2):
    """The experts class as vLLM's kernel holds it (only its quant config's scales are read)."""
    ex = object.__new__(moe_method.Fp8BlockGemmExperts)
    ex.quant_config = SimpleNamespace(w1_scale=s13, w2_scale=s2)
    return ex


def _apply(ex, x, w13, w2, weights, ids, expert_map=None, on_input=False, strided=False):
    # vLLM's output buffer: contiguous (written in place), or any other view (copied into)
    out = (torch.full(x.shape[::-1], float("nan"), dtype=x.dtype).t() if strided
           else torch.full_like(x, float("nan")))
    ex.apply(out, x, w13, w2, weights, ids, compat.MoEActivation.SILU, E, expert_map, None,
             None, None, None, None, on_input)
    return out


@pytest.mark.parametrize("strided", [False, True])
def test_apply_is_fused_moe_on_the_layers_tokens(layer_data, strided):
    x, w13, s13, w2, s2, weights, ids = layer_data
    got = _apply(_experts(s13, s2), x, w13, w2, weights, ids, strided=strided)
    assert got.is_contiguous() != strided
    torch.testing.assert_close(got, moe_reference(x, w13, s13, w2, s2, weights, ids),
                               rtol=0, atol=0)


def test_expert_parallel_ranks_sum_to_the_whole_layer(layer_data):
    """Two ranks holding experts 0-2 and 3-5: each computes its slots (the others weigh
    zero), and the two partial outputs add up to the layer (up to each rank's rounding)."""
    x, w13, s13, w2, s2, weights, ids = layer_data
    total = torch.zeros(x.shape, dtype=torch.float32)
    for first in (0, 3):
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[first:first + 3] = torch.arange(3, dtype=torch.int32)
        sl = slice(first, first + 3)
        total += _apply(_experts(s13[sl].contiguous(), s2[sl].contiguous()), x,
                        w13[sl].contiguous(), w2[sl].contiguous(), weights, ids,
                        expert_map).float()
    want = moe_reference(x, w13, s13, w2, s2, weights, ids).float()
    assert ((total - want).norm() / want.norm()) < 4e-3


def test_other_ranks_slots_get_id_minus_one():
    ids = torch.tensor([[0, 5], [4, 1]], dtype=torch.int32)
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1], dtype=torch.int32)
    local = moe_method.local_ids(ids, expert_map)
    assert local.tolist() == [[-1, 1], [0, -1]] and local.dtype == ids.dtype
    assert moe_method.local_ids(ids, None) is ids


def test_router_weight_applied_on_input_is_not_applied_again(layer_data):
    x, w13, s13, w2, s2, weights, ids = layer_data
    got = _apply(_experts(s13, s2), x, w13, w2, weights[:, :1], ids[:, :1].contiguous(),
                 on_input=True)
    want = moe_reference(x, w13, s13, w2, s2, torch.ones(5, 1), ids[:, :1].contiguous())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _layer(**overrides):
    par = SimpleNamespace(use_all2all_kernels=False)
    cfg = dict(activation=compat.MoEActivation.SILU, is_act_and_mul=True, has_bias=False,
               swiglu_limit=None, is_lora_enabled=False, moe_parallel_config=par,
               hidden_dim=H, intermediate_size_per_partition=I)
    cfg.update(overrides)
    return SimpleNamespace(moe_config=SimpleNamespace(**cfg))


def test_our_experts_take_block_fp8_silu_layers_on_the_cpu():
    assert moe_method.why_not(_layer()) is None


@pytest.mark.parametrize("overrides, reason", [
    ({"activation": "gelu"}, "activation"),
    ({"has_bias": True}, "expert biases"),
    ({"moe_parallel_config": SimpleNamespace(use_all2all_kernels=True)}, "all-to-all"),
])
def test_other_layers_stay_on_vllms_kernels(overrides, reason):
    if "activation" in overrides:
        overrides["activation"] = compat.MoEActivation.GELU
    assert reason in moe_method.why_not(_layer(**overrides))


def test_a_gpu_our_kernels_do_not_take_falls_back(monkeypatch):
    """Not Hopper, or an expert intermediate size per rank off the 128 grid (Qwen3-30B-A3B's
    768 at TP 8: 96): vLLM's kernels, with the reason."""
    monkeypatch.setattr(compat, "current_device", lambda: torch.device("cuda", 0))
    seen = []

    def backend(device, hidden, inter, block_scales):
        seen.append((hidden, inter))
        return "reference"
    monkeypatch.setattr(moe_method.dispatch, "moe_backend", backend)
    assert "Hopper" in moe_method.why_not(_layer(intermediate_size_per_partition=96))
    assert seen == [(H, 96)]
    monkeypatch.setattr(moe_method.dispatch, "moe_backend", lambda *a, **k: "sm90")
    assert moe_method.why_not(_layer()) is None


def test_moe_method_swaps_only_the_experts_class():
    vllm_method = SimpleNamespace(fp8_backend="DEEPGEMM", experts_cls=object)
    assert moe_method.moe_method(vllm_method, _layer(), "model.layers.0.mlp.experts") \
        is vllm_method
    assert vllm_method.experts_cls is moe_method.Fp8BlockGemmExperts
    assert vllm_method.fp8_backend == compat.Fp8MoeBackend.TRITON
    with pytest.raises(TypeError, match="fp8_backend/experts_cls"):
        moe_method.moe_method(SimpleNamespace(), _layer(), "x")
