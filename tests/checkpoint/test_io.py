"""fp8linear.checkpoint.io: save/load, the shard index, and load-time errors."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import fp64_reference as ref
import tiny_checkpoints as tiny
import fp8linear
from checkpoint_helpers import QCFG, assert_same_state, quantized_tiny, read_index, rewrite
from fp8linear import load_fp8_checkpoint, quantize_model, save_fp8_checkpoint
from fp8linear.checkpoint import INDEX_NAME, CheckpointError
from fp8linear.quant import expand_weight_scale


# ---------------------------------------------------------------------- save / load
def test_save_load_round_trip_sharded(tmp_path):
    src = quantized_tiny(seed=1)
    save_fp8_checkpoint(src, tmp_path, max_shard_bytes=100_000)
    wm = read_index(tmp_path)
    files = sorted(set(wm.values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:  # each shard holds exactly what the index says
        with safe_open(str(tmp_path / f), "pt") as h:
            assert sorted(h.keys()) == sorted(n for n, v in wm.items() if v == f)
    # tied lm_head is written once, under the embedding's name
    assert "model.embed_tokens.weight" in wm and "lm_head.weight" not in wm
    for name, _ in fp8linear.fp8_modules(src):
        assert name + ".weight" in wm and name + ".weight_scale_inv" in wm
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"] == QCFG

    dst = quantized_tiny(seed=2)  # other random weights until loaded
    assert load_fp8_checkpoint(dst, tmp_path) is dst
    assert_same_state(src, dst)
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    ids = torch.randint(0, 320, (2, 9))
    assert torch.equal(src(ids), dst(ids))


def test_single_shard_and_ue8m0_config(tmp_path):
    src = quantized_tiny(ue8m0=True)
    save_fp8_checkpoint(src, tmp_path, config={"model_type": "tiny_moe"})
    assert set(read_index(tmp_path).values()) == {"model.safetensors"}
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg == {"model_type": "tiny_moe",
                   "quantization_config": dict(QCFG, scale_fmt="ue8m0")}
    load_fp8_checkpoint(quantized_tiny(seed=3, ue8m0=True), tmp_path)


def test_save_takes_a_transformers_style_config(tmp_path):
    class Cfg:
        def to_dict(self):
            return {"architectures": ["X"], "vocab_size": 320}

    model = quantized_tiny()
    model.config = Cfg()
    save_fp8_checkpoint(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["X"] and cfg["quantization_config"] == QCFG


def test_save_refuses_a_model_without_fp8_layers(tmp_path):
    with pytest.raises(CheckpointError, match="the model has no FP8Linear or FP8Experts layers: run "
                                              "fp8linear.quantize_model"):
        save_fp8_checkpoint(nn.Linear(4, 4), tmp_path)


def test_load_per_row_scales(tmp_path):
    model = quantize_model(nn.Sequential(nn.Linear(300, 200)))
    q, s = model[0].weight, model[0].weight_scale_inv
    rows = (expand_weight_scale(s, 200) * torch.linspace(1, 2, 200)[:, None]).contiguous()
    save_file({"0.weight": q, "0.weight_scale_inv": rows, "0.bias": model[0].bias.detach()},
              str(tmp_path / "model.safetensors"))
    load_fp8_checkpoint(model, tmp_path)
    assert model[0].weight_scale_inv.shape == (200, 3)
    assert torch.equal(model[0].weight_scale_inv, rows)
    x = torch.randn(3, 300)
    xq, xs = fp8linear.quantize_activation(x)
    assert ref.rel_err(model(x), ref.gemm(xq, xs, q, rows, model[0].bias)) <= 2e-3


def test_load_missing_tensor(saved):
    rewrite(saved, "model.layers.0.self_attn.q_proj.weight_scale_inv")
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.q_proj."
                                              r"weight_scale_inv' is missing from the "
                                              r"checkpoint \(.*model.safetensors.index.json\)"):
        load_fp8_checkpoint(quantized_tiny(), saved)


def test_load_wrong_shape(saved):
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    good = load_file(str(saved / read_index(saved)[name]))[name]
    file = rewrite(saved, name, torch.ones(3, 3))
    with pytest.raises(CheckpointError, match=rf"{file}: tensor 'model.layers.0.mlp.up_proj."
                                              rf"weight_scale_inv' has shape \[3, 3\], the "
                                              rf"FP8Linear layer 'model.layers.0.mlp.up_proj' "
                                              rf"expects \[3, 2\] or \[320, 2\]"):
        load_fp8_checkpoint(quantized_tiny(), saved)
    rewrite(saved, name, good)
    file = rewrite(saved, "model.norm.weight", torch.ones(7, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=rf"{file}: tensor 'model.norm.weight' has shape "
                                              rf"\[7\], the model expects \[192\]"):
        load_fp8_checkpoint(quantized_tiny(), saved)


def test_load_wrong_dtype(saved):
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    file = rewrite(saved, name, torch.randn(192, 160, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=rf"{file}: tensor '{name}' is BF16, the "
                                              rf"FP8Linear layer '{name[:-7]}' expects "
                                              rf"torch.float8_e4m3fn"):
        load_fp8_checkpoint(quantized_tiny(), saved)
    file = rewrite(saved, name + "_scale_inv", torch.ones(2, 2, dtype=torch.float64))
    rewrite(saved, name, torch.zeros(192, 160).to(torch.float8_e4m3fn))
    with pytest.raises(CheckpointError, match=rf"'{name}_scale_inv' is F64, the FP8Linear "
                                              rf"layer .* expects torch.float32 \(or "
                                              rf"bfloat16/float16\)$"):
        load_fp8_checkpoint(quantized_tiny(), saved)


def test_load_quantized_checkpoint_into_unquantized_model(saved):
    model = tiny.TinyMoeForCausalLM().to(torch.bfloat16)
    with pytest.raises(CheckpointError, match="is F8_E4M3 \\(quantized\\) but the model's "
                                              ".* is torch.bfloat16: run fp8linear."
                                              "quantize_model on the model first"):
        load_fp8_checkpoint(model, saved, strict=False)


def test_load_unexpected_tensor(saved):
    extra = torch.ones(4)
    wm = read_index(saved)
    file = saved / wm["model.norm.weight"]
    tensors = load_file(str(file))
    tensors["model.extra.weight"] = extra
    save_file(tensors, str(file))
    wm["model.extra.weight"] = file.name
    (saved / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=rf"{file}: tensor 'model.extra.weight' is not "
                                              rf"in the model"):
        load_fp8_checkpoint(quantized_tiny(), saved)
    with pytest.raises(CheckpointError) as e:
        load_fp8_checkpoint(quantized_tiny(), saved)
    assert str(e.value) == (f"{file}: tensor 'model.extra.weight' is not in the model; "
                            f"load_fp8_checkpoint(..., strict=False) ignores extra tensors")
    load_fp8_checkpoint(quantized_tiny(), saved, strict=False)


def test_load_non_finite_scale_names_file_and_tensor(saved):
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    s = load_file(str(saved / read_index(saved)[name]))[name]
    s[1, 0] = float("inf")
    file = rewrite(saved, name, s)
    with pytest.raises(CheckpointError, match=rf"{file}: {name} has non-finite values \(first "
                                              rf"at index \(1, 0\), value inf\)"):
        load_fp8_checkpoint(quantized_tiny(), saved)


def test_load_corrupt_files(saved):
    name = "model.layers.0.self_attn.k_proj.weight"
    file = saved / read_index(saved)[name]
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=rf"{file}: corrupt or truncated: tensor"):
        load_fp8_checkpoint(quantized_tiny(), saved)
    file.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(CheckpointError, match=rf"{file}: corrupt safetensors file \(header "
                                              rf"length"):
        load_fp8_checkpoint(quantized_tiny(), saved)
    file.write_bytes(data[:8] + b"{" * 8 + data[16:])
    with pytest.raises(CheckpointError, match=rf"{file}: corrupt safetensors file \(header "
                                              rf"is not JSON"):
        load_fp8_checkpoint(quantized_tiny(), saved)
    file.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match=rf"{file}: not a safetensors file"):
        load_fp8_checkpoint(quantized_tiny(), saved)
    file.unlink()
    with pytest.raises(CheckpointError, match=rf"index.json: lists shard '{file.name}', "
                                              rf"which is missing"):
        load_fp8_checkpoint(quantized_tiny(), saved)


def test_load_index_that_does_not_match_its_shards(saved):
    wm = read_index(saved)
    name = "model.norm.weight"
    other = next(f for f in set(wm.values()) if f != wm[name])
    wm[name] = other
    (saved / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' should be in '{other}' but "
                                              rf"that shard does not hold it"):
        load_fp8_checkpoint(quantized_tiny(), saved)


def test_load_into_a_meta_model_is_refused(saved):
    model = quantized_tiny().to("meta")
    with pytest.raises(CheckpointError, match="is on the meta device: materialize the model "
                                              "first"):
        load_fp8_checkpoint(model, saved)


def test_load_from_a_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_fp8_checkpoint(quantized_tiny(), tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no safetensors files"):
        load_fp8_checkpoint(quantized_tiny(), tmp_path)



def _snapshot(model):
    return {n: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone()
            for n, t in model.state_dict().items()}


@pytest.mark.parametrize("value,what,tail", [
    (float("nan"), "non-finite values",
     "the checkpoint is corrupt or was quantized from weights holding inf/nan"),
    (-0.5, "a non-positive value", "weight scales must be positive and finite"),
    (0.0, "a non-positive value", "weight scales must be positive and finite")])
def test_a_bad_scale_fails_the_load_before_anything_is_copied(saved, value, what, tail):
    src = quantized_tiny()  # what `saved` holds
    name = "model.layers.1.mlp.experts.1.up_proj.weight_scale_inv"  # in the last shard
    s = load_file(str(saved / read_index(saved)[name]))[name]
    s[1, 0] = value
    file = rewrite(saved, name, s)
    model = quantized_tiny(seed=7)
    before = _snapshot(model)
    with pytest.raises(CheckpointError) as e:
        load_fp8_checkpoint(model, saved)
    assert str(e.value) == (f"{file}: {name} has {what} (first at index (1, 0), value "
                            f"{value}): {tail}")
    after = _snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not all(torch.equal(before[n], _snapshot(src)[n]) for n in before)


def test_bf16_and_fp16_scales_load_exactly(saved):
    # Qwen3-FP8 checkpoints ship their weight_scale_inv in bf16 or fp16
    a, b = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts.0.down_proj"
    want = {}
    for layer, dtype in ((a, torch.bfloat16), (b, torch.float16)):
        name = layer + ".weight_scale_inv"
        want[layer] = load_file(str(saved / read_index(saved)[name]))[name].to(dtype)
        rewrite(saved, name, want[layer])
    model = load_fp8_checkpoint(quantized_tiny(seed=4), saved)
    for layer, s in want.items():
        got = model.get_submodule(layer).weight_scale_inv
        assert got.dtype == torch.float32 and torch.equal(got, s.float())


def test_buffers_the_checkpoint_lacks_or_the_model_does_not_persist(saved):
    # persistent buffers the model computes (missing from the file) keep their values; a
    # non-persistent buffer that an older save wrote (BERT's position_ids) is not "extra"
    model = quantized_tiny()
    model.register_buffer("causal_mask", torch.ones(4, 4))
    model.model.register_buffer("position_ids", torch.arange(8), persistent=False)
    rewrite(saved, "model.norm.weight")  # (removes it: put it back with an extra tensor)
    extra = {"model.norm.weight": model.model.norm.weight.detach().clone(),
             "model.position_ids": torch.arange(8) * 100}
    save_file(extra, str(saved / "extra.safetensors"))
    wm = read_index(saved)
    wm.update({n: "extra.safetensors" for n in extra})
    (saved / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    load_fp8_checkpoint(model, saved)
    assert torch.equal(model.causal_mask, torch.ones(4, 4))
    assert torch.equal(model.model.position_ids, torch.arange(8))


def test_load_hints_name_the_actual_mismatch(saved, tmp_path):
    # the model quantizes a layer the checkpoint keeps in bf16
    with pytest.raises(CheckpointError) as e:
        load_fp8_checkpoint(quantize_model(tiny.TinyMoeForCausalLM().to(torch.bfloat16),
                                           skip="lm_head"), saved)
    assert str(e.value) == (
        f"tensor 'model.layers.1.mlp.gate.weight_scale_inv' is missing from the checkpoint "
        f"({saved / INDEX_NAME}) (the checkpoint keeps 'model.layers.1.mlp.gate' unquantized, "
        f"as BF16: pass quantize_model a skip list that leaves it out)")
    # the model leaves layers in high precision that the checkpoint quantizes
    model = quantize_model(tiny.TinyMoeForCausalLM().to(torch.bfloat16),
                           skip=("lm_head", "*.mlp.gate", "self_attn"))
    with pytest.raises(CheckpointError) as e:
        load_fp8_checkpoint(model, saved, strict=False)
    assert "is F8_E4M3 (quantized) but the model's 'model.layers.0.self_attn." in str(e.value)
    for n, m in model.named_modules():  # so that only the extra scales remain
        if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            m.weight.data = m.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError) as e:
        load_fp8_checkpoint(model, saved)
    name = "model.layers.0.self_attn.k_proj"
    file = saved / read_index(saved)[name + ".weight_scale_inv"]
    assert str(e.value) == (
        f"{file}: tensor '{name}.weight_scale_inv' is not in the model (and 7 more); the "
        f"checkpoint quantizes '{name}' but the model's layer is a Linear: run "
        f"fp8linear.quantize_model without skipping it")
    # a checkpoint that is not quantized at all
    tiny.write_checkpoint(tmp_path / "bf16")
    with pytest.raises(CheckpointError) as e:
        load_fp8_checkpoint(quantized_tiny(), tmp_path / "bf16")
    assert str(e.value) == (
        f"tensor 'model.layers.0.self_attn.q_proj.weight_scale_inv' is missing from the "
        f"checkpoint ({tmp_path / 'bf16' / INDEX_NAME}) (the checkpoint is not quantized: "
        f"convert it with `fp8linear quantize`)")


def test_the_index_lists_the_files_fp8linear_wrote(tmp_path):
    save_fp8_checkpoint(quantized_tiny(), tmp_path, max_shard_bytes=200_000)
    first = json.loads((tmp_path / INDEX_NAME).read_text())["metadata"]["fp8linear"]["files"]
    assert first == sorted(["config.json", INDEX_NAME, *set(read_index(tmp_path).values())])
    save_fp8_checkpoint(quantized_tiny(), tmp_path)  # one shard now; the old ones stay listed
    files = json.loads((tmp_path / INDEX_NAME).read_text())["metadata"]["fp8linear"]["files"]
    assert files == sorted({*first, "model.safetensors"})


# ------------------------------------------------------------- FP8Experts (transformers MoE)
def test_fp8_experts_tensors_are_checked_before_anything_is_copied(tmp_path):
    """A transformers MoE model's FP8Experts load per expert: a bad scale or an unquantized
    expert weight in the file is named, and the model is left as it was."""
    from tiny_hf_moe import model_of, qwen3_moe
    src = quantize_model(model_of(qwen3_moe)[0])
    save_fp8_checkpoint(src, tmp_path)
    name = "model.layers.1.mlp.experts.6.down_proj.weight_scale_inv"
    s = load_file(str(tmp_path / read_index(tmp_path)[name]))[name]
    s[1, 0] = -0.5
    file = rewrite(tmp_path, name, s)
    model = quantize_model(model_of(qwen3_moe, seed=5)[0])
    before = _snapshot(model)
    with pytest.raises(CheckpointError) as e:
        load_fp8_checkpoint(model, tmp_path)
    assert str(e.value) == (f"{file}: {name} has a non-positive value (first at index (1, 0), "
                            f"value -0.5): weight scales must be positive and finite")
    s[1, 0] = 1.0
    rewrite(tmp_path, name, s)
    weight = "model.layers.0.mlp.experts.2.gate_proj.weight"
    rewrite(tmp_path, weight, torch.zeros(128, 256, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError) as e:
        load_fp8_checkpoint(model, tmp_path)
    assert str(e.value) == (f"{file}: tensor '{weight}' is BF16 [128, 256], the FP8Experts "
                            f"layer expects torch.float8_e4m3fn [128, 256] (quantize the "
                            f"checkpoint with `fp8linear quantize`)")
    after = _snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_save_refuses_fp8_experts_with_a_bad_scale(tmp_path):
    from tiny_hf_moe import model_of, qwen3_moe
    model = quantize_model(model_of(qwen3_moe)[0])
    model.model.layers[1].mlp.experts.down_proj_scale_inv.data[6, 1, 0] = 0.0
    with pytest.raises(ValueError) as e:
        save_fp8_checkpoint(model, tmp_path / "out")
    assert str(e.value) == ("model.layers.1.mlp.experts.down_proj_scale_inv has a non-positive "
                            "value (first at index (6, 1, 0), value 0.0): weight scales must be "
                            "positive and finite")
    assert not (tmp_path / "out").exists()
