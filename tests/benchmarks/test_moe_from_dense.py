"""benchmarks/moe_from_dense.py on a tiny random Llama: the Mixtral it writes computes the
dense model (fp32 and block FP8), routes to both expert sets with weights of exactly 1/G,
and bad input is refused before anything is written."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import fp8linear
import moe_from_dense
import quality

GROUPS = 4


def _dense(path, seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=192, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # wide weights: the MLP's share of the output is measured
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if p.shape[0] == cfg.vocab_size else p.shape[-1] ** -0.5)
    model.to(torch.bfloat16).save_pretrained(path)
    (path / "SOURCE.txt").write_text("a tiny random Llama\n")
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_from_dense")
    dense = _dense(root / "dense")
    moe = moe_from_dense.split_checkpoint(dense, root / "moe", groups=GROUPS, seed=3)
    return dense, moe


def _load(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_mixtral_computes_the_dense_model(pair):
    dense, moe = pair
    cfg = json.loads((moe / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_local_experts"], cfg["num_experts_per_tok"],
            cfg["intermediate_size"]) == (["MixtralForCausalLM"], 2 * GROUPS, GROUPS, 128)
    ids = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    d, m = _load(dense), _load(moe)
    assert type(m).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert _rel(m(ids).logits, d(ids).logits) < 1e-5
    # as the original, but one expert's down slice off by a factor: a wiring error shows
    with torch.no_grad():
        m.model.layers[0].mlp.experts.down_proj[1] *= 2
        assert _rel(m(ids).logits, d(ids).logits) > 1e-2


def test_routing_takes_one_expert_of_each_pair_with_equal_weights(pair):
    _, moe = pair
    m = _load(moe)
    seen = []
    for layer in m.model.layers:
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out: seen.append(out))
    ids = torch.randint(0, 320, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        m(ids)
    assert len(seen) == 2
    for _, weights, experts in seen:
        assert torch.equal(weights, torch.full_like(weights, 1 / GROUPS))
        pairs = (experts // 2).sort(dim=-1).values
        assert torch.equal(pairs, torch.arange(GROUPS).expand_as(pairs))
        first = (experts % 2 == 0).all(dim=-1) | (experts % 2 == 1).all(dim=-1)
        assert not first.all()  # some token mixes even and odd experts (signs alternate)
        counts = torch.bincount(experts.flatten(), minlength=2 * GROUPS)
        assert (counts > 0).all() and counts.unique().numel() > 1  # both sets, uneven


def test_block_fp8_of_the_mixtral_is_the_dense_models(pair):
    """Each expert slice lies on the 128 grid, so FP8Experts quantizes the dense weights'
    own blocks (down's scales times G) and the intermediate's own 128-channel groups: in
    fp32, fp8 MoE and fp8 dense agree to rounding, where FP8 itself moves the logits 5%."""
    dense, moe = pair
    d, m = _load(dense), _load(moe)
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = d(ids).logits
        fp8linear.quantize_model(d)
        fp8linear.quantize_model(m)
        fd, fm = d(ids).logits, m(ids).logits
    assert isinstance(m.model.layers[0].mlp.experts, fp8linear.FP8Experts)
    assert _rel(fd, ref) > 1e-2 and _rel(fm, fd) < 1e-5
    w = m.model.layers[1].mlp.experts
    assert torch.equal(w.gate_up_proj[2].view(torch.uint8), w.gate_up_proj[3].view(torch.uint8))


def test_quality_names_the_derived_model(pair):
    dense, moe = pair
    for path in (dense, moe):
        cfg = json.loads((path / "config.json").read_text())
        name = quality.model_name(path, cfg)
        if path == dense:
            assert name == quality.MODEL_NAME
        else:
            assert name.startswith("dense, its MLPs split into 8 experts, top-4")
            assert "a tiny random Llama" in (moe / "SOURCE.txt").read_text()


@pytest.mark.parametrize("change, groups, message", [
    ({"model_type": "qwen2"}, 4, "expected a Llama model"),
    ({"hidden_act": "gelu"}, 4, "hidden_act 'gelu'"),
    ({"intermediate_size": None}, 4, "no integer intermediate_size"),
    ({}, 3, "--groups 3: expected a power of two"),
    ({"intermediate_size": 384}, 4, "intermediate_size 384 does not split into 4 groups"),
])
def test_bad_input_is_refused_before_writing(tmp_path, change, groups, message):
    dense = _dense(tmp_path / "dense")
    cfg = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        moe_from_dense.split_checkpoint(dense, tmp_path / "out", groups=groups)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["dense"]  # no temporary folder left


def test_an_existing_folder_is_kept_without_force(tmp_path):
    dense = _dense(tmp_path / "dense")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="pass --force"):
        moe_from_dense.split_checkpoint(dense, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert moe_from_dense.main(["--dense", str(dense), "--out", str(out)]) == 2
    assert moe_from_dense.main(["--dense", str(tmp_path / "none"), "--out", str(out)]) == 2
    moe_from_dense.split_checkpoint(dense, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
