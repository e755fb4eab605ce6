"""fp8linear.checkpoint.convert: the converter and the validation of what it wrote."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp64_reference as ref
import tiny_checkpoints as tiny
import fp8linear
from checkpoint_helpers import QCFG, read_index, rewrite
from fp8linear import load_fp8_checkpoint, quantize_model
from fp8linear.checkpoint import (INDEX_NAME, CheckpointError, quantize_checkpoint,
                                  validate_quantized_checkpoint)


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

