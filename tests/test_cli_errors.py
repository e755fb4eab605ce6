"""Every bad input or interruption of the `fp8linear` command ends in one clear line on
stderr and a meaningful exit status, never a traceback or lost data."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_checkpoints as tiny
from fp8linear.checkpoint import INDEX_NAME
from fp8linear.cli import main


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


REPO = Path(__file__).resolve().parents[1]


def command():
    """This checkout's `fp8linear` command (its entry point, fp8linear.cli:main, from the
    checkout's sources: see checkout_env), not whatever `fp8linear` is first on PATH."""
    return [sys.executable, "-m", "fp8linear.cli"]


def checkout_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO),
                                                        os.environ.get("PYTHONPATH", "")]))


@pytest.fixture
def ckpt(tmp_path):
    tiny.write_checkpoint(tmp_path / "in")
    return tmp_path


def test_quantize_warns_about_a_missing_config_and_unmatched_skips(ckpt, capsys):
    (ckpt / "in" / "config.json").unlink()
    rc, out, err = run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet",
                       "--skip", "nothing_like_this", "--skip", "q_proj")
    assert rc == 0
    assert err.splitlines() == [
        f"fp8linear quantize: warning: {ckpt / 'in' / 'config.json'} is missing: the "
        f"output's config.json will hold only quantization_config (vLLM and transformers "
        f"also need the model's own config)",
        f"fp8linear quantize: warning: skip pattern 'nothing_like_this' matches no tensor in "
        f"{ckpt / 'in'}"]


def test_ctrl_c_cleans_up_and_exits_130(ckpt, capsys, monkeypatch):
    from fp8linear.checkpoint import convert

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(convert, "quantize_weight", interrupted)
    rc, out, err = run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet")
    assert (rc, out, err) == (130, "", "fp8linear quantize: interrupted\n")
    assert sorted(p.name for p in ckpt.iterdir()) == ["in"]


def test_a_real_sigint_exits_130_without_a_traceback(ckpt):
    # the signal itself (not a raised KeyboardInterrupt), in the middle of the conversion
    # (a shell's background job inherits SIGINT ignored, and Python then keeps it ignored: set
    # the handler an interactive shell's child starts with)
    code = ("import os, signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from fp8linear.checkpoint import convert\n"
            "real = convert.quantize_weight\n"
            "def interrupted(*a, **kw):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(*a, **kw)\n"
            "convert.quantize_weight = interrupted\n"
            "from fp8linear.cli import main\n"
            f"sys.exit(main(['quantize', {str(ckpt / 'in')!r}, {str(ckpt / 'out')!r}]))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 130
    assert p.stderr.splitlines()[-1] == "fp8linear quantize: interrupted"
    assert "Traceback" not in p.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["in"]


def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run(ckpt, capsys):
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True)
    stale = ckpt / f".out.tmp-{socket.gethostname()}-{int(p.stdout)}-q1w2e3"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    rc, out, err = run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet")
    assert rc == 0
    assert err == (f"fp8linear quantize: warning: removed {stale}, left by an interrupted "
                   f"fp8linear quantize\n")
    assert sorted(p.name for p in ckpt.iterdir()) == ["in", "out"]


def test_info_exits_1_on_a_scale_of_the_wrong_shape(ckpt, capsys):
    assert run(capsys, "quantize", ckpt / "in", ckpt / "out", "--quiet")[0] == 0
    wm = json.loads((ckpt / "out" / INDEX_NAME).read_text())["weight_map"]
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    file = ckpt / "out" / wm[name]
    tensors = load_file(str(file))
    tensors[name] = torch.ones(5, 5)
    save_file(tensors, str(file))
    rc, out, err = run(capsys, "info", ckpt / "out")
    assert rc == 1
    problem = (f"{file}: fp8 tensor 'model.layers.0.mlp.down_proj.weight' [192, 320] needs an "
               f"F32 scale '{name}' of shape [2, 3] (128x128 blocks) or [192, 3] (per row), "
               f"found F32 [5, 5]")
    assert err == f"fp8linear info: error: {problem}\n"
    assert f"PROBLEM      {problem}" in out
    rc, out, err = run(capsys, "info", ckpt / "out", "--json")
    assert rc == 1 and json.loads(out)["problems"] == [problem]


@pytest.mark.parametrize("args,message", [
    (["--layers", "0"], "argument --layers: expected at least 1, got 0"),
    (["--layers", "-3"], "argument --layers: expected at least 1, got -3"),
    (["--layers", "two"], "argument --layers: expected a whole number, got 'two'"),
    (["--device", "gpu"], "argument --device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (["--device", "cpu:1"], "argument --device: expected cpu, cuda or cuda:N, got 'cpu:1'"),
    (["--seed", "x"], "argument --seed: expected a whole number, got 'x'"),
    (["--seed", str(2**70)], f"argument --seed: expected 0 to {2**63 - 2}, got {2**70}"),
])
def test_demo_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.splitlines()[-1] == f"fp8linear demo: error: {message}"
    assert err.startswith("usage: fp8linear demo ") and "Traceback" not in err


def test_demo_cuda_without_a_cuda_device(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, err = run(capsys, "demo", "--device", "cuda")
    build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
    assert (rc, out) == (2, "")
    assert err == (f"fp8linear demo: error: --device cuda: no CUDA device is available "
                   f"(torch {torch.__version__}, {build}); use --device cpu\n")


def test_a_closed_stdout_ends_quietly():
    # `fp8linear demo --json | head`: the reader is gone before the report is written
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(command() + ["demo", "--json", "--device", "cpu", "--layers", "1"],
                           stdout=w, stderr=subprocess.PIPE, text=True, env=checkout_env(),
                           timeout=300)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (141, "")


def test_no_numpy_warning_without_numpy(tmp_path):
    # a fresh `pip install torch` has no NumPy, and torch warns about it on import
    code = ("import sys; sys.modules['numpy'] = None; from fp8linear.cli import main; "
            "sys.exit(main(['demo', '--device', 'cpu', '--layers', '1', '--json']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    probe = subprocess.run([sys.executable, "-c", "import sys; sys.modules['numpy'] = None; "
                            "import torch"], capture_output=True, text=True)
    assert "Failed to initialize NumPy" in probe.stderr  # what the test guards against
