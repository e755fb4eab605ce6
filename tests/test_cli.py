"""The `fp8linear` command end to end on tiny random checkpoints written by the tests."""
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fp64_reference as ref
import tiny_checkpoints as tiny
from fp8linear import load_fp8_checkpoint, quantize_model
from fp8linear.checkpoint import INDEX_NAME
from fp8linear.cli import main


REPO = Path(__file__).resolve().parents[1]


def checkout_command() -> tuple[list, dict]:
    """(argv, env) of this checkout's `fp8linear` command: its entry point run from the
    checkout's sources (PYTHONPATH first), not whatever `fp8linear` is first on PATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO),
                                                       os.environ.get("PYTHONPATH", "")]))
    return [sys.executable, "-m", "fp8linear.cli"], env


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def ckpt(tmp_path):
    tiny.write_checkpoint(tmp_path / "in")
    return tmp_path


def load_original(path):
    model = tiny.TinyMoeForCausalLM().to(torch.bfloat16).eval()
    load_fp8_checkpoint(model, path)
    return model


def out_tensors(path):
    wm = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    tensors = {}
    for f in set(wm.values()):
        tensors.update(load_file(str(path / f)))
    return tensors


def test_quantize_info_and_reload(ckpt, capsys):
    rc, out, err = run(capsys, "quantize", ckpt / "in", ckpt / "out")
    assert rc == 0, err
    assert "quantized 17 linear weights to block FP8 (128x128)" in out
    assert "1 MoE router" in out and "1 embedding" in out
    assert "100%" in err  # the progress bar
    tensors = out_tensors(ckpt / "out")
    assert sorted(n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn) == \
        tiny.LINEAR_WEIGHTS
    assert "lm_head.weight" not in tensors  # tied: stays tied to the bf16 embedding
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16

    rc, out, _ = run(capsys, "info", ckpt / "out")
    assert rc == 0
    assert "quantization fp8 e4m3, blocks 128x128, scales fp32, activations dynamic" in out
    assert "quantized    17 fp8 weights" in out and "17 scale tensors" in out
    assert "architecture TinyMoeForCausalLM" in out
    rc, out, _ = run(capsys, "info", ckpt / "in", "--json")
    info = json.loads(out)
    assert info["quantization_config"] is None and info["quantized_tensors"] == 0

    original = load_original(ckpt / "in")
    model = quantize_model(copy.deepcopy(original), skip=("lm_head", "*.mlp.gate"))
    load_fp8_checkpoint(model, ckpt / "out")
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = original(ids), model(ids)
    assert ref.rel_err(got, want) <= 0.08
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_quantize_refuses_to_overwrite_without_force(ckpt, capsys):
    assert run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet")[0] == 0
    marker = ckpt / "out" / "marker"
    marker.write_text("x")
    rc, out, err = run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet")
    assert rc == 2 and "already exists: pass --force" in err and marker.exists()
    # --force replaces only a folder holding just a checkpoint fp8linear wrote
    rc, out, err = run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet", "--force")
    assert rc == 2 and marker.exists()
    assert err == (f"fp8linear quantize: error: {ckpt / 'out'} holds 'marker', which "
                   f"fp8linear did not write: --force replaces only a folder holding just a "
                   f"checkpoint it wrote; move those files or pick another output directory\n")
    marker.unlink()
    rc, out, err = run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet", "--force")
    assert rc == 0
    assert err == ""  # --quiet: no progress bar


def test_quantize_skip(ckpt, capsys):
    rc, out, _ = run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet",
                     "--skip", "model.layers.0.self_attn.*", "--skip", "experts.1.")
    assert rc == 0
    assert "quantized 10 linear weights" in out  # 17 - 4 attention - 3 expert
    tensors = out_tensors(ckpt / "out")
    for name in tiny.LINEAR_WEIGHTS:
        skipped = "layers.0.self_attn" in name or "experts.1." in name
        assert (tensors[name].dtype == torch.bfloat16) == skipped, name
        assert (name + "_scale_inv" in tensors) == (not skipped)
    cfg = json.loads((ckpt / "out" / "config.json").read_text())
    ignored = cfg["quantization_config"]["ignored_layers"]
    assert "model.layers.0.self_attn.q_proj" in ignored
    assert "model.layers.1.mlp.experts.1.down_proj" in ignored
    assert "model.layers.1.mlp.gate" in ignored
    # the same skips in quantize_model give a model the checkpoint loads into
    model = quantize_model(load_original(ckpt / "in"),
                           skip=("lm_head", "*.mlp.gate", "model.layers.0.self_attn.*",
                                 "experts.1."))
    load_fp8_checkpoint(model, ckpt / "out")


def test_quantize_ue8m0(ckpt, capsys):
    assert run(capsys, "quantize", ckpt / "in", ckpt / "out", "--ue8m0", "--quiet")[0] == 0
    cfg = json.loads((ckpt / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    scales = [t for n, t in out_tensors(ckpt / "out").items() if n.endswith("_scale_inv")]
    assert len(scales) == 17
    for s in scales:
        assert (torch.frexp(s)[0] == 0.5).all()
    assert "scales ue8m0" in run(capsys, "info", ckpt / "out")[1]


def test_cli_errors_are_clean(ckpt, capsys):
    shard = ckpt / "in" / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    rc, out, err = run(capsys, "quantize", ckpt / "in", ckpt / "out")
    assert rc == 2
    assert err.startswith("fp8linear quantize: error: ")
    assert f"{shard}: corrupt or truncated" in err
    assert not (ckpt / "out").exists()
    rc, _, err = run(capsys, "info", ckpt / "nowhere")
    assert rc == 2 and "not a directory" in err
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_demo(capsys):
    rc, out, _ = run(capsys, "demo", "--json", "--device", "cpu")
    assert rc == 0
    r = json.loads(out)
    before, after = r["linear_weight_bytes"]
    assert after / before == pytest.approx(0.5, abs=0.01)  # bf16 -> fp8 (+ tiny scales)
    assert r["model_bytes"][1] < r["model_bytes"][0]
    assert 0 < r["logits_rel_err"] < 0.15 and 0 < r["hidden_rel_err"] < 0.15
    assert r["top1_agreement"] >= 0.75
    assert r["quantized_layers"] == 7 * r["config"]["num_layers"]
    assert r["time_ms"] is None  # CPU: no speed claims
    assert r["wall_s"] > 0       # reported (how long it takes is the machine's business)


def test_demo_text_through_the_command_line():
    # the installed console script is this entry point (pyproject.toml), run here as
    # `python -m fp8linear.cli` on this checkout's sources
    assert re.search(r'^fp8linear = "fp8linear\.cli:main"$',
                     (REPO / "pyproject.toml").read_text(), re.M)
    cmd, env = checkout_command()
    p = subprocess.run(cmd + ["demo", "--device", "cpu", "--layers", "1", "--seed", "3"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "1 layers" in p.stdout and "seed 3" in p.stdout
    assert "logits relative error" in p.stdout and "top-1 token agreement" in p.stdout


@pytest.fixture
def fake_precompile(monkeypatch):
    """build.precompile answering (path, compiled now) and recording its verbose argument."""
    from fp8linear.backends.sm90 import build
    calls = []

    def use(result):
        def precompile(verbose=True):
            calls.append(verbose)
            if isinstance(result, Exception):
                raise result
            return result
        monkeypatch.setattr(build, "precompile", precompile)
        return calls
    return use


def test_build_with_nothing_to_compile(fake_precompile, tmp_path, capsys):
    calls = fake_precompile((tmp_path / "libfp8linear_sm90.so", False))
    assert run(capsys, "build") == (0, "fp8linear build: nothing to compile, the kernels are "
                                       f"ready: {tmp_path / 'libfp8linear_sm90.so'}\n", "")
    assert calls == [False]


def test_build_compiles_verbosely_on_request(fake_precompile, tmp_path, capsys):
    calls = fake_precompile((tmp_path / "libfp8linear_sm90.so", True))
    assert run(capsys, "build", "--verbose") == (
        0, f"fp8linear build: kernels compiled into {tmp_path / 'libfp8linear_sm90.so'}\n", "")
    assert calls == [True]


def test_build_reports_a_build_error_without_a_traceback(fake_precompile, capsys):
    from fp8linear.backends.sm90 import build
    fake_precompile(build.ToolkitMissingError(
        "fp8linear: nvcc not found (set CUDA_HOME or install the CUDA toolkit)"))
    assert run(capsys, "build") == (1, "", "fp8linear build: error: fp8linear: nvcc not found "
                                           "(set CUDA_HOME or install the CUDA toolkit)\n")


def test_build_finds_a_prebuilt_library(tmp_path, monkeypatch, capsys):
    # the real precompile(): FP8LINEAR_PREBUILT holds a finished build of the current sources
    from fp8linear.backends.sm90 import build

    def no_compile(*args):
        raise AssertionError("compiled although a prebuilt library was there")

    monkeypatch.setattr(build, "_compile", no_compile)
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path / "no-wheel")
    monkeypatch.setenv("FP8LINEAR_CACHE", str(tmp_path / "cache"))
    key = build.current_key()
    d = tmp_path / "pre" / key
    d.mkdir(parents=True)
    (d / build.LIB_NAME).write_bytes(b"lib")
    (d / "build.json").write_text(json.dumps({"key": key, "lib": build.LIB_NAME}))
    monkeypatch.setenv("FP8LINEAR_PREBUILT", str(tmp_path / "pre"))
    assert run(capsys, "build") == (0, "fp8linear build: nothing to compile, the kernels are "
                                       f"ready: {d / build.LIB_NAME}\n", "")
    assert not (tmp_path / "cache").exists()


def test_transformers_llama_round_trip(tmp_path, capsys):
    import transformers   # (the dev extra's: missing, the test fails)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=192, intermediate_size=320,
                                   num_hidden_layers=2, num_attention_heads=3,
                                   num_key_value_heads=1, tie_word_embeddings=True,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():  # wider than the 0.02 init, so the comparison is not noise
        for p in original.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5 if p.shape[0] != 320 else 1.0)
    original.save_pretrained(tmp_path / "in", max_shard_size="200KB")
    assert len(list((tmp_path / "in").glob("*.safetensors"))) > 1
    rc, out, err = run(capsys, "quantize", tmp_path / "in", tmp_path / "out", "--quiet")
    assert rc == 0, err
    assert "quantized 14 linear weights" in out  # 7 per layer; lm_head is tied
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    quantize_model(model)
    load_fp8_checkpoint(model, tmp_path / "out")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    in_memory = quantize_model(copy.deepcopy(original))
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = original(ids).logits, model(ids).logits
        # the checkpoint route gives exactly the in-memory quantized model
        assert torch.equal(got, in_memory(ids).logits)
    # two layers of e4m3 weights and activations, logits of unit-variance embeddings
    assert ref.rel_err(got, want) <= 0.15


def test_demo_options_leave_the_cuda_config_unchanged(monkeypatch, capsys):
    from fp8linear import demo
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda cfg, device: seen.append(cfg) or {"ok": 1})
    before = demo.CUDA_CONFIG.seed, demo.CUDA_CONFIG.num_layers
    rc, out, _ = run(capsys, "demo", "--device", "cuda", "--seed", "5", "--layers", "2",
                     "--json")
    assert rc == 0 and json.loads(out) == {"ok": 1}
    assert (seen[0].seed, seen[0].num_layers) == (5, 2)
    assert seen[0].hidden_size == demo.CUDA_CONFIG.hidden_size
    assert (demo.CUDA_CONFIG.seed, demo.CUDA_CONFIG.num_layers) == before
