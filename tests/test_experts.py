"""FP8Experts: transformers' fused MoE experts in block FP8 (fp8linear/experts.py), and
quantize_model on tiny transformers MoE models (Qwen3-MoE, Mixtral), on the CPU and on a GPU."""
import copy
import warnings

import pytest
import torch

import fp64_reference as ref
import fp8linear
from fp8linear import quantize_model, quantize_activation, quantize_weight
from fp8linear.experts import FP8Experts, fused_experts_problem
from expect import raises_exactly
from tiny_hf_moe import experts_of, mixtral, model_of, qwen3_moe


# The layer against an fp64 formulation of its numerics on the dequantized operands: an
# element of the intermediate that lies near an fp8 rounding boundary may round the other way
# (one step, ~6% of it) after a last-bit difference upstream; on these transformers-like
# weights that reached 1.2-1.3% on the CPU path and on the GPU's (32 draws each, I = 128-384).
# A wrong layout, scale or routing is off by the output's own size.
LAYER_TOL = 3e-2


def test_fused_experts_problem_takes_transformers_silu_experts_only():
    qwen, _ = model_of(qwen3_moe)
    mix, _ = model_of(mixtral)
    assert fused_experts_problem(experts_of(qwen)) is None
    assert fused_experts_problem(experts_of(mix)) is None
    assert fused_experts_problem(qwen.model.layers[0].self_attn.q_proj) == ""
    assert fused_experts_problem(qwen.model.layers[0].mlp.gate) == ""
    off_grid, _ = model_of(qwen3_moe(inter=96))
    assert fused_experts_problem(experts_of(off_grid)) == (
        "expert intermediate size 96 is not a multiple of 128 (gate and up must split on the "
        "block grid)")
    gelu = copy.deepcopy(experts_of(qwen))
    gelu.act_fn = torch.nn.GELU()
    assert fused_experts_problem(gelu) == "activation GELU (ours: SiLU(gate) * up)"
    biased = copy.deepcopy(experts_of(qwen))
    biased.has_bias = True
    assert fused_experts_problem(biased) == "biases, transposed or interleaved stacks, or no gate"
    odd = copy.deepcopy(experts_of(qwen))
    odd.down_proj = torch.nn.Parameter(odd.down_proj[:, :, :64], requires_grad=False)
    assert fused_experts_problem(odd) == ("gate_up_proj (8, 256, 256) and down_proj (8, 256, 64) "
                                          "are not [E, 2I, H] and [E, H, I]")
    with raises_exactly(ValueError, "FP8Experts.from_experts takes a transformers fused-experts "
                                    "layer, got a GELU: no 3-D gate_up_proj and down_proj"):
        FP8Experts.from_experts(gelu.act_fn)
    with raises_exactly(ValueError, "FP8Experts.from_experts takes a transformers fused-experts "
                                    "layer, got a Qwen3MoeExperts: activation GELU (ours: "
                                    "SiLU(gate) * up)"):
        FP8Experts.from_experts(gelu)
    with raises_exactly(ValueError, "FP8Experts: the expert intermediate size must be a "
                                    "multiple of 128, got 96"):
        FP8Experts(8, 256, 96)


def test_from_experts_quantizes_each_projection_of_each_expert_on_its_own():
    model, _ = model_of(qwen3_moe)
    src = experts_of(model)
    q = FP8Experts.from_experts(src)
    i = q.intermediate
    for j in range(q.num_experts):
        for (w, s), orig in zip(q.views(j), (src.gate_up_proj[j, :i], src.gate_up_proj[j, i:],
                                             src.down_proj[j])):
            want_w, want_s = quantize_weight(orig.detach())
            assert torch.equal(w.view(torch.uint8), want_w.view(torch.uint8))
            assert torch.equal(s, want_s)


@pytest.mark.parametrize("arch", [qwen3_moe, mixtral])
def test_forward_is_the_block_fp8_moe_of_the_original_experts(arch):
    model, cfg = model_of(arch)
    src = experts_of(model)
    q = FP8Experts.from_experts(src)
    gen = torch.Generator().manual_seed(1)
    x = ref.random_matrix(13, cfg.hidden_size, gen, spread=1.0).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(q.num_experts, generator=gen)[:2] for _ in range(13)])
    weights = torch.softmax(torch.randn(13, 2, generator=gen), -1).to(torch.bfloat16)
    got = q(x, ids, weights)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, fp8linear.fused_moe(x, q.gate_up_proj, q.gate_up_proj_scale_inv,
                                                q.down_proj, q.down_proj_scale_inv,
                                                weights.float(), ids))
    xq, xs = quantize_activation(x)
    want = ref.moe(xq, xs, torch.bfloat16, q.gate_up_proj, q.gate_up_proj_scale_inv,
                   q.down_proj, q.down_proj_scale_inv, weights.float(), ids)
    assert ref.rel_err(got, want) <= LAYER_TOL
    # and the original bf16 experts: FP8's error, gate and up in the right rows (swapped,
    # the error would be of the output's own size)
    with torch.no_grad():
        original = src(x, ids, weights)
    assert 0.01 <= ref.rel_err(got, original) <= 0.08


@pytest.mark.parametrize("arch,max_err,min_top1", [(qwen3_moe, 0.15, 0.85),
                                                   (mixtral, 0.15, 0.85)])
def test_quantize_model_runs_moe_models_on_fp8_experts(arch, max_err, min_top1):
    model, cfg = model_of(arch)
    q = quantize_model(copy.deepcopy(model))
    for layer in q.model.layers:
        assert isinstance(layer.mlp.experts, FP8Experts)
        assert type(layer.mlp.gate) is type(model.model.layers[0].mlp.gate)  # the router stays
    names = {n for n, _ in fp8linear.fp8_modules(q)}
    assert {"model.layers.0.mlp.experts", "model.layers.1.self_attn.o_proj"} <= names
    ids = torch.randint(0, cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(ids).logits, q(ids).logits
    assert 0.02 <= ref.rel_err(got, want) <= max_err
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= min_top1


def test_quantize_model_twice_changes_nothing():
    model, _ = model_of(qwen3_moe)
    q = quantize_model(model)
    experts = experts_of(q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (FP8Experts is no transformers layer to report)
        assert quantize_model(q) is q
    assert experts_of(q) is experts


def test_a_non_finite_expert_weight_stops_quantize_model_before_any_change():
    model, _ = model_of(qwen3_moe)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[5, 2, 7] = float("inf")
    with pytest.raises(ValueError) as e:
        quantize_model(model)
    assert str(e.value) == ("model.layers.1.mlp.experts.down_proj has non-finite values (first "
                            "at index (5, 2, 7), value inf): cannot quantize it")
    assert not any(isinstance(m, (FP8Experts, fp8linear.FP8Linear)) for m in model.modules())


def test_experts_off_the_grid_stay_with_a_warning():
    model, _ = model_of(qwen3_moe(inter=96))
    with pytest.warns(UserWarning, match=r"quantize_model: 2 MoE experts layer\(s\) stay in high "
                      r"precision, e.g. 'model.layers.0.mlp.experts' \(expert intermediate "
                      r"size 96"):
        q = quantize_model(model)
    assert type(experts_of(q)).__name__ == "Qwen3MoeExperts"
    assert isinstance(q.model.layers[0].self_attn.q_proj, fp8linear.FP8Linear)


def test_skip_and_min_features_leave_experts():
    model, _ = model_of(qwen3_moe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (skipped experts are not reported as unsupported)
        q = quantize_model(copy.deepcopy(model), skip=("lm_head", "*.experts"))
    assert not any(isinstance(m, FP8Experts) for m in q.modules())
    q = quantize_model(copy.deepcopy(model), min_features=192)  # intermediate 128
    assert not any(isinstance(m, FP8Experts) for m in q.modules())


def test_state_dict_is_per_expert_and_loads_back():
    model, _ = model_of(qwen3_moe)
    q = FP8Experts.from_experts(experts_of(model))
    sd = q.state_dict()
    assert len(sd) == 6 * q.num_experts
    assert sd["3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(sd["3.up_proj.weight"].shape) == (128, 256)
    assert tuple(sd["3.up_proj.weight_scale_inv"].shape) == (1, 2)
    assert tuple(sd["3.down_proj.weight"].shape) == (256, 128)
    other = FP8Experts(q.num_experts, q.hidden, q.intermediate)
    torch.nn.init.zeros_(other.gate_up_proj_scale_inv)
    other.load_state_dict({k: v.to(torch.bfloat16) if k.endswith("_scale_inv") else v
                           for k, v in sd.items()})  # (bf16 scales, as Qwen3-FP8 ships)
    assert torch.equal(other.gate_up_proj.view(torch.uint8), q.gate_up_proj.view(torch.uint8))
    assert torch.equal(other.down_proj_scale_inv,
                       q.down_proj_scale_inv.to(torch.bfloat16).float())


def test_load_state_dict_checks_everything_before_copying():
    model, _ = model_of(qwen3_moe)
    q = FP8Experts.from_experts(experts_of(model))
    before = {k: v.clone() for k, v in q.state_dict().items()}
    bad = {k: v.clone() for k, v in q.state_dict().items()}
    bad["0.gate_proj.weight"] = torch.zeros(3, 3, dtype=torch.float8_e4m3fn)
    bad["7.down_proj.weight_scale_inv"][1, 0] = -1.0
    bad["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as e:
        q.load_state_dict(bad)
    msg = str(e.value)
    assert "0.gate_proj.weight: expected torch.float8_e4m3fn of shape (128, 256), got " \
           "torch.float8_e4m3fn (3, 3)" in msg
    assert "7.down_proj.weight_scale_inv" in msg and "Unexpected key(s) in state_dict: " \
           "\"extra\"" in msg
    assert all(torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           before[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn
                           else before[k]) for k, v in q.state_dict().items())
    missing = q.load_state_dict({k: v for k, v in before.items() if not k.startswith("5.")},
                                strict=False)
    assert sorted(missing.missing_keys) == sorted(k for k in before if k.startswith("5."))


def test_dtype_moves_keep_fp8_and_fp32_scales():
    model, _ = model_of(qwen3_moe)
    q = quantize_model(model).to(torch.float16)
    e = experts_of(q)
    assert e.gate_up_proj.dtype == torch.float8_e4m3fn
    assert e.down_proj_scale_inv.dtype == torch.float32
    assert q.model.norm.weight.dtype == torch.float16


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 13, 64])
def test_gpu_forward_is_the_block_fp8_moe(tokens):
    """On the GPU the experts run fused_moe's kernels (the sm90 grouped GEMMs on Hopper)."""
    model, cfg = model_of(qwen3_moe)
    q = FP8Experts.from_experts(experts_of(model))
    gen = torch.Generator().manual_seed(5)
    x = ref.random_matrix(tokens, cfg.hidden_size, gen, spread=1.0).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(q.num_experts, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), -1).to(torch.bfloat16)
    got = copy.deepcopy(q).cuda()(x.cuda(), ids.cuda(), weights.cuda()).cpu()
    xq, xs = quantize_activation(x)
    want = ref.moe(xq, xs, torch.bfloat16, q.gate_up_proj, q.gate_up_proj_scale_inv,
                   q.down_proj, q.down_proj_scale_inv, weights.float(), ids)
    assert torch.isfinite(got).all() and ref.rel_err(got, want) <= LAYER_TOL


@pytest.mark.gpu
def test_gpu_moe_model_runs_on_fp8_experts():
    model, cfg = model_of(qwen3_moe)
    q = quantize_model(copy.deepcopy(model))
    gpu = copy.deepcopy(q).cuda()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = q(ids).logits
        got = gpu(ids.cuda()).logits.cpu()
    # (attention's kernels and bf16 rounding differ between the devices, and a token whose
    # router scores nearly tie may take another expert: the whole model agrees loosely)
    assert torch.isfinite(got).all() and ref.rel_err(got, want) <= 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
