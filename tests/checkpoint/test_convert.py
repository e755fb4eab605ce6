"""fp8linear.checkpoint.convert: the converter and the validation of what it wrote."""
import copy
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp64_reference as ref
import tiny_checkpoints as tiny
import fp8linear
from checkpoint_helpers import QCFG, read_index, rewrite
from fp8linear import load_fp8_checkpoint, quantize_model
from fp8linear.checkpoint import (INDEX_NAME, CheckpointError, CheckpointWarning,
                                  quantize_checkpoint, validate_quantized_checkpoint)


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
    with pytest.warns(CheckpointWarning) as warned:
        quantize_checkpoint(src, tmp_path / "out", progress=False, ue8m0=True)
    assert [str(w.message) for w in warned] == [
        f"{src / 'config.json'} is missing: the output's config.json will hold only "
        f"quantization_config (vLLM and transformers also need the model's own config)"]
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
    (src / "config.json").write_text("{}")
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
    s[0, 1] = -1.0
    file = rewrite(converted, name, s)
    with pytest.raises(CheckpointError) as e:
        validate_quantized_checkpoint(converted)
    assert str(e.value) == f"{file}: tensor '{name}' has scales <= 0 (scales must be positive)"
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



# ---------------------------------------------------------------------- output folder safety
def test_force_replaces_only_what_fp8linear_wrote(tmp_path):
    tiny.write_checkpoint(tmp_path / "in")
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    meta = json.loads((tmp_path / "out" / INDEX_NAME).read_text())["metadata"]["fp8linear"]
    assert meta["files"] == sorted(["config.json", INDEX_NAME, "model-00001-of-00002.safetensors",
                                    "model-00002-of-00002.safetensors", *tiny.OTHER_FILES])
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", force=True, progress=False)
    # a folder fp8linear did not write is never deleted, in part or whole
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(tmp_path / "in", user, force=True, progress=False)
    assert str(e.value) == (f"{user} is not a checkpoint written by fp8linear (its {INDEX_NAME} "
                            f"lists no files fp8linear wrote): --force replaces only those; "
                            f"remove it yourself or pick another output directory")
    assert (user / "notes.txt").read_text() == "mine"
    (tmp_path / "out" / "a.txt").write_text("x")
    (tmp_path / "out" / "b.txt").write_text("x")
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", force=True, progress=False)
    assert str(e.value).startswith(f"{tmp_path / 'out'} holds 'a.txt' and 1 more, which ")
    assert (tmp_path / "out" / "a.txt").exists()
    # an empty folder is fine
    (tmp_path / "empty").mkdir()
    quantize_checkpoint(tmp_path / "in", tmp_path / "empty", force=True, progress=False)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_output_folder_follows_the_umask(tmp_path, umask):
    tiny.write_checkpoint(tmp_path / "in")
    old = os.umask(umask)
    try:
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((tmp_path / "out" / "config.json").stat().st_mode) == 0o666 & ~umask


def test_skip_as_a_string_and_unmatched_patterns(tmp_path):
    tiny.write_checkpoint(tmp_path / "in")
    with pytest.warns(CheckpointWarning) as warned:
        report = quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False,
                                     skip=["q_proj", "no_such_layer"])
    assert [str(w.message) for w in warned] == [
        f"skip pattern 'no_such_layer' matches no tensor in {tmp_path / 'in'}"]
    assert report.kept["model.layers.0.self_attn.q_proj.weight"] == "matches --skip 'q_proj'"
    report = quantize_checkpoint(tmp_path / "in", tmp_path / "out2", progress=False,
                                 skip="q_proj")  # one pattern, not the letters q, _, p, ...
    assert len(report.quantized) == len(tiny.LINEAR_WEIGHTS) - 2


def test_an_interrupt_removes_the_partial_output(tmp_path, monkeypatch):
    from fp8linear.checkpoint import convert
    tiny.write_checkpoint(tmp_path / "in")
    calls = []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return fp8linear.quantize_weight(*a, **kw)
    monkeypatch.setattr(convert, "quantize_weight", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_stale_temporary_folders_are_removed_or_reported(tmp_path):
    import socket
    import subprocess
    import sys
    tiny.write_checkpoint(tmp_path / "in")
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True)
    dead = int(p.stdout)  # that process has exited
    host = socket.gethostname()
    stale = tmp_path / f".out.tmp-{host}-{dead}-abc123"
    live = tmp_path / f".out.tmp-{host}-{os.getpid()}-def456"  # this process: still running
    old = tmp_path / ".out.tmp-x1y2z3"  # the name older versions used: cannot tell
    for d in (stale, live, old):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    with pytest.warns(CheckpointWarning) as warned:
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    out = tmp_path / "out"
    assert sorted(str(w.message) for w in warned) == sorted([
        f"{old} may belong to another fp8linear quantize of {out} (still running, or on "
        f"another machine): not removed; delete it if no such run is going on",
        f"{live} may belong to another fp8linear quantize of {out} (still running, or on "
        f"another machine): not removed; delete it if no such run is going on",
        f"removed {stale}, left by an interrupted fp8linear quantize"])
    assert not stale.exists() and live.exists() and old.exists()
