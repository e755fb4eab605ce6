"""fp8linear.checkpoint: save/load, the shard index, the converter, validation, info."""
import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import fp64_reference as ref
import tiny_checkpoints as tiny
import fp8linear
from fp8linear import load_fp8_checkpoint, quantize_model, save_fp8_checkpoint
from fp8linear.checkpoint import (INDEX_NAME, CheckpointError, checkpoint_info,
                                  quantization_config, quantize_checkpoint, tensor_role,
                                  validate_quantized_checkpoint)
from fp8linear.quant import expand_weight_scale

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}


def quantized_tiny(seed=0, ue8m0=False):
    torch.manual_seed(seed)
    model = tiny.TinyMoeForCausalLM().to(torch.bfloat16)
    model.load_state_dict(tiny.random_state(seed), strict=False)  # lm_head is tied
    return quantize_model(model, skip=("lm_head", "*.mlp.gate"), ue8m0=ue8m0)


def assert_same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for n in sa:
        assert sa[n].dtype == sb[n].dtype and sa[n].shape == sb[n].shape, n
        assert torch.equal(sa[n].view(torch.uint8) if sa[n].dtype == torch.float8_e4m3fn
                           else sa[n], sb[n].view(torch.uint8)
                           if sb[n].dtype == torch.float8_e4m3fn else sb[n]), n


def read_index(path):
    return json.loads((Path(path) / INDEX_NAME).read_text())["weight_map"]


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
    with pytest.raises(CheckpointError, match="the model has no FP8Linear layers: run "
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


# ---------------------------------------------------------------------- load errors
@pytest.fixture
def saved(tmp_path):
    save_fp8_checkpoint(quantized_tiny(), tmp_path, max_shard_bytes=200_000)
    return tmp_path


def rewrite(path, name, tensor=None):
    """Replace (or with tensor=None remove) one tensor in the shard that holds it."""
    wm = read_index(path)
    file = path / wm[name]
    tensors = load_file(str(file))
    if tensor is None:
        del tensors[name]
        del wm[name]
        (path / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    else:
        tensors[name] = tensor
    save_file(tensors, str(file))
    return file


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
    file = rewrite(saved, name + "_scale_inv", torch.ones(2, 2, dtype=torch.float16))
    rewrite(saved, name, torch.zeros(192, 160).to(torch.float8_e4m3fn))
    with pytest.raises(CheckpointError, match=rf"'{name}_scale_inv' is F16, the FP8Linear "
                                              rf"layer .* expects torch.float32"):
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


# ---------------------------------------------------------------------- tensor roles
LLAMA = {"vocab_size": 1000, "tie_word_embeddings": False}


@pytest.mark.parametrize("name,shape,quantize,reason", [
    ("model.layers.3.self_attn.q_proj.weight", (512, 512), True, "linear weight"),
    ("model.layers.3.mlp.down_proj.weight", (512, 1376), True, "linear weight"),
    ("model.layers.0.mlp.gate_proj.weight", (1000, 512), True, "linear weight"),  # = vocab
    ("model.layers.5.mlp.experts.17.gate_proj.weight", (256, 512), True, "linear weight"),
    ("model.layers.5.mlp.shared_experts.up_proj.weight", (256, 512), True, "linear weight"),
    ("model.layers.2.block_sparse_moe.experts.3.w1.weight", (700, 512), True, "linear"),
    ("transformer.h.0.attn.c_attn.weight", (512, 1536), True, "linear weight"),
    ("bert.encoder.layer.0.attention.output.dense.weight", (512, 512), True, "linear"),
    ("model.layers.5.self_attn.kv_a_proj_with_mqa.weight", (576, 512), True, "linear"),
    ("model.embed_tokens.weight", (1000, 512), False, "embedding"),
    ("transformer.wte.weight", (1000, 512), False, "embedding"),
    ("shared.weight", (1000, 512), False, "embedding"),
    ("lm_head.weight", (1000, 512), False, "output head"),
    ("output.weight", (1000, 512), False, "output head"),
    ("embed_out.weight", (1000, 512), False, "embedding"),
    ("cls.predictions.decoder.weight", (1000, 512), False, "vocabulary-sized"),
    ("model.layers.5.mlp.gate.weight", (64, 512), False, "MoE router"),
    ("model.layers.5.block_sparse_moe.gate.weight", (8, 512), False, "MoE router"),
    ("model.layers.5.mlp.router.weight", (32, 512), False, "MoE router"),
    ("model.norm.weight", (512,), False, "1-D"),
    ("model.layers.0.self_attn.q_proj.bias", (512,), False, "1-D"),
    ("model.layers.0.self_attn.q_norm.weight", (512, 4), False, "normalization"),
    ("model.layers.0.mlp.experts.gate_up_proj", (8, 1024, 512), False, "3-D"),
    ("visual.patch_embed.proj.weight", (512, 3, 2, 14, 14), False, "5-D"),
    ("model.layers.0.attn.rel_pos", (64, 64), False, "not a .weight tensor"),
])
def test_tensor_role(name, shape, quantize, reason):
    q, why = tensor_role(name, shape, "BF16", LLAMA)
    assert q == quantize and reason in why


def test_tensor_role_tied_head_skip_and_dtypes():
    tied = {"vocab_size": 1000, "tie_word_embeddings": True}
    assert tensor_role("lm_head.weight", (1000, 64), "F16", tied) == (
        False, "output head (tied to the input embeddings)")
    # multimodal configs keep the text model's keys in text_config
    assert tensor_role("language_model.out.weight", (1000, 64), "F32",
                       {"text_config": {"vocab_size": 1000}})[0] is False
    assert tensor_role("a.b.weight", (64, 64), "BF16", {}, skip=("a.*",)) == (
        False, "matches --skip 'a.*'")
    assert tensor_role("a.b.weight", (64, 64), "I64", {}) == (False, "I64 (not bf16/fp16/fp32)")
    with pytest.raises(CheckpointError, match="tensor 'a.b.weight' is already F8_E4M3: the "
                                              "input checkpoint is quantized"):
        tensor_role("a.b.weight", (64, 64), "F8_E4M3", {})


# ---------------------------------------------------------------------- the converter
def test_quantize_checkpoint_shard_by_shard(tmp_path):
    state = tiny.write_checkpoint(tmp_path / "in")
    report = quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    out = tmp_path / "out"
    assert sorted(report.quantized) == tiny.LINEAR_WEIGHTS
    assert report.kept["model.layers.1.mlp.gate.weight"] == "MoE router"
    # one output shard per input shard, holding that shard's tensors (+ scales): the
    # converter never needs more than one shard in memory
    win, wout = read_index(tmp_path / "in"), read_index(out)
    assert set(win.values()) == set(wout.values())
    for name, f in win.items():
        assert wout[name] == f
        if name in report.quantized:
            assert wout[name + "_scale_inv"] == f
    for f in set(wout.values()):
        tensors = load_file(str(out / f))
        for name, t in tensors.items():
            if name.endswith("_scale_inv"):
                continue
            if name in report.quantized:
                q, s = fp8linear.quantize_weight(state[name])
                assert t.dtype == torch.float8_e4m3fn
                assert torch.equal(t.view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(tensors[name + "_scale_inv"], s)
            else:
                assert torch.equal(t, state[name])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == dict(QCFG, ignored_layers=["model.layers.1.mlp.gate"])
    assert cfg["vocab_size"] == 320
    for name, text in tiny.OTHER_FILES.items():
        assert (out / name).read_text() == text
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_quantize_checkpoint_refusals(tmp_path):
    tiny.write_checkpoint(tmp_path / "in")
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    with pytest.raises(CheckpointError, match="already exists: pass --force"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    with pytest.raises(CheckpointError, match="would overwrite the input checkpoint"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "in", force=True, progress=False)
    with pytest.raises(CheckpointError, match="would overwrite the input checkpoint"):
        quantize_checkpoint(tmp_path / "in", tmp_path, force=True, progress=False)
    with pytest.raises(CheckpointError, match="the checkpoint is already quantized"):
        quantize_checkpoint(tmp_path / "out", tmp_path / "out2", progress=False)
    with pytest.raises(CheckpointError, match="found no linear-layer weights to quantize"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out3", skip=("proj",), progress=False)
    assert not (tmp_path / "out3").exists()


def test_quantize_checkpoint_without_index_or_config(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    w = torch.randn(130, 200)
    save_file({"layer.weight": w, "layer.bias": torch.randn(130)}, str(src / "model.safetensors"))
    quantize_checkpoint(src, tmp_path / "out", progress=False, ue8m0=True)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    q, s = fp8linear.quantize_weight(w, ue8m0=True)
    assert torch.equal(got["layer.weight_scale_inv"], s)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg == {"quantization_config": dict(QCFG, scale_fmt="ue8m0")}


def test_quantize_checkpoint_rejects_non_finite_weights(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    w = torch.randn(64, 64)
    w[3, 3] = float("nan")
    save_file({"layer.weight": w}, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'layer.weight': "
                                              r"weight has non-finite values"):
        quantize_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def converted(tmp_path):
    tiny.write_checkpoint(tmp_path / "in")
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    validate_quantized_checkpoint(tmp_path / "out")
    return tmp_path / "out"


def test_validate_catches_bad_scales(converted):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    s = load_file(str(converted / read_index(converted)[name]))[name]
    s[0, 1] = float("nan")
    rewrite(converted, name, s)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has non-finite scales"):
        validate_quantized_checkpoint(converted)
    rewrite(converted, name, torch.ones(5, 5))
    with pytest.raises(CheckpointError, match=r"fp8 tensor 'model.layers.0.mlp.down_proj."
                                              r"weight' needs an F32 .* of shape \[2, 3\], "
                                              r"found F32 \[5, 5\]"):
        validate_quantized_checkpoint(converted)
    rewrite(converted, name, None)
    with pytest.raises(CheckpointError, match="found none"):
        validate_quantized_checkpoint(converted)


def test_validate_checks_stacked_and_rejects_1d_fp8_tensors(converted):
    # stacked experts [E, N, K] need scales [E, ceil(N/128), ceil(K/128)]
    name = "model.layers.0.mlp.down_proj.weight"
    rewrite(converted, name, torch.zeros(4, 200, 300).to(torch.float8_e4m3fn))
    rewrite(converted, name + "_scale_inv", torch.ones(4, 2, 3))
    validate_quantized_checkpoint(converted)
    rewrite(converted, name + "_scale_inv", torch.ones(2, 3))
    with pytest.raises(CheckpointError, match=r"of shape \[4, 2, 3\], found F32 \[2, 3\]"):
        validate_quantized_checkpoint(converted)
    rewrite(converted, name, torch.zeros(300).to(torch.float8_e4m3fn))
    with pytest.raises(CheckpointError, match=rf"fp8 tensor '{name}' has shape \[300\]; "
                                              r"block-FP8 weights are at least 2-D"):
        validate_quantized_checkpoint(converted)


def test_validate_catches_an_incomplete_index(converted):
    wm = read_index(converted)
    del wm["model.norm.weight"]
    (converted / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=r"does not list tensor 'model.norm.weight'"):
        validate_quantized_checkpoint(converted)


def test_converted_checkpoint_loads_and_matches_the_original(converted, tmp_path):
    original = tiny.TinyMoeForCausalLM().to(torch.bfloat16)
    load_fp8_checkpoint(original, tmp_path / "in")  # bf16 checkpoint into a bf16 model
    model = quantize_model(copy.deepcopy(original), skip=("lm_head", "*.mlp.gate"))
    load_fp8_checkpoint(model, converted)
    ids = torch.randint(0, 320, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert ref.rel_err(model(ids), original(ids)) <= 0.08


def test_checkpoint_info(converted):
    info = checkpoint_info(converted)
    assert info["quantization_config"]["weight_block_size"] == [128, 128]
    assert info["scale_fmt"] == "fp32"
    assert info["quantized_tensors"] == info["scale_tensors"] == len(tiny.LINEAR_WEIGHTS)
    assert info["unquantized_2d_weights"] == ["model.embed_tokens.weight",
                                              "model.layers.1.mlp.gate.weight"]
    assert info["fp8_without_scale"] == []
    assert info["bytes_by_dtype"]["F8_E4M3"] == info["quantized_params"]
    assert info["total_bytes"] == sum(info["bytes_by_dtype"].values())
    assert info["quantization_config"] == quantization_config(
        ignored_layers=["model.layers.1.mlp.gate"])
