#!/usr/bin/env python3
"""End-to-end vLLM serving benchmark (issue 6, part 1): decode time per output token of
`--quantization fp8_blockgemm` against vLLM's own block-FP8 kernels and BF16, on one GPU
(NAME@tp<N> / NAME@ep<N> engines: on N), vLLM 0.24.0 (installed per
../shared/vllm-device/README.md).

Models (built on the device, no downloads; stage `models`): a Llama-3.1-8B-shaped model
(hidden 4096, 32 query / 8 KV heads of 128, FFN 14336, vocab 128256, untied lm_head) with
--layers decoder layers (default 8: the 32-layer model's load and start-up do not fit in one
device call; per-token times of the layer part scale by ~4 for 32 layers, the
lm_head part does not) and seeded random weights, written as BF16 safetensors + config.json,
then converted with the product's CLI: `python -m fp8linear.cli quantize BF16 FP8`
(128x128 block FP8, lm_head and embeddings kept BF16).

Engine configurations (stage `engines`; one fresh process each, time-boxed, run in order):
  bf16                   the BF16 checkpoint
  fp8_blockgemm          the FP8 checkpoint, quantization="fp8_blockgemm" (fp8linear's kernels)
  fp8_cutlass            the FP8 checkpoint, vLLM's "fp8" with VLLM_USE_DEEP_GEMM=0 (CUTLASS
                         block-scaled GEMM, precompiled)
  fp8_blockgemm_online   the BF16 checkpoint, quantization="fp8_blockgemm" (quantized while
                         loading)                                      [--configs ...,online]
  fp8_deepgemm           the FP8 checkpoint, vLLM's "fp8" with DeepGEMM (its default; JIT-
                         compiles ~575 kernels at start, ~6 min: give it its own lease)
  fp8_blockgemm_nopdl    fp8_blockgemm with FP8LINEAR_VLLM_PDL=0: Inductor's kernels without
                         PDL (what the plugin turns on; matters with --compile vllm only)
  fp8_blockgemm_nofuse   fp8_blockgemm with FP8LINEAR_VLLM_FUSE_QUANT=0: without the plugin's
                         quantization fusion pass (--compile vllm only)
  fp8_cutlass_pdl,       vLLM's fp8 (CUTLASS / DeepGEMM) with TORCHINDUCTOR_ENABLE_PDL=1: the
  fp8_deepgemm_pdl       same Inductor setting for the anchors (--compile vllm)
Default: bf16,fp8_blockgemm,fp8_cutlass. The fp8linear kernels must be built beforehand
(`python -m fp8linear.cli build`; e2e_device.sh does it), so engine start does not include it.
Multi-GPU variants by suffix, beside the TP1 engines in one run: NAME@tp<N> runs NAME with
tensor_parallel_size=N, NAME@ep<N> (MoE shapes) also with enable_expert_parallel=True (experts
split over the N GPUs); weight and KV cache GiB are then per GPU, and each is compared with its
TP1 engine NAME on the same scored sequence (JSON key parallel_vs_tp1). E.g. --shape qwen3_30b_a3b
--configs fp8_cutlass,fp8_blockgemm,fp8_blockgemm@tp2,fp8_blockgemm@ep2 on two GPUs.

CUDA graphs are on. Default --compile none: compilation mode NONE (no torch.compile) with
cudagraph_mode FULL_DECODE_ONLY, capture sizes = the batch sizes: every decode step is one
full-model CUDA graph, prefill runs eagerly. This is what vLLM's default FULL_AND_PIECEWISE
mode replays for uniform decode batches, minus Inductor's fusions (norms, activation, quant run
as vLLM's custom CUDA ops instead, the same for every configuration), and it saves
torch.compile's start-up per engine. --compile vllm uses vLLM's default (torch.compile,
FULL_AND_PIECEWISE) with the same capture sizes: Inductor then generates the norm and
activation kernels, which the plugin makes PDL-aware (fp8_blockgemm_nopdl measures that apart);
the README's vLLM table (v11) is --compile vllm.

Workloads per engine: greedy decode, prompt --prompt-len (128) random token ids,
--out-len (128) output tokens, ignore_eos, prefix caching off; at each batch (1, 4, 16, 64;
--b256 adds 256): time per output token = (t(out_len tokens) - t(1 token)) / (out_len - 1),
each t the best of --reps (5) LLM.generate calls; then the prefill-heavy workload (--prefill,
16 requests x 2048 prompt tokens, 16 new tokens each: the whole call, best of 3). Engine start (LLM(...) constructor), import
time, weight memory ("Model loading took"), KV cache memory and capacity in tokens, graph
capture time and the GEMM kernel vLLM selected come from vLLM's log. Log-probabilities: every
engine scores the same token sequence (a 128-token prompt + the BF16 engine's 32 greedy
tokens) with prompt_logprobs=1; fp8 engines are compared with BF16 on it (|delta logprob| of
the greedy tokens and of the prompt tokens, top-1 agreement) and on their own greedy tokens.

Output: <date>_e2e_vllm_<gpu>.json (+ .png) in benchmarks/results/ (or --out), engine logs in
--work/logs/, a short table printed last (the document's comparisons, targets, table, plot and
--merge: e2e_report.py).

  python benchmarks/e2e_vllm.py                                # models + engines
  python benchmarks/e2e_vllm.py --stage models                 # build checkpoints only
  python benchmarks/e2e_vllm.py --stage engines --budget-s 300 --configs bf16,fp8_blockgemm
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # common, e2e_moe_model: beside this script
from common import git_commit, utc_now, write_shards  # noqa: E402
from e2e_moe_model import (QWEN3_30B_A3B, TINY_MOE, write_bf16_config,  # noqa: E402
                           write_fp8_checkpoint)
from e2e_report import (LP_GEN, LP_PROMPT_LEN, compare_logprobs, compare_variants,  # noqa: E402
                        decode_rows, is_moe, logprob_reference, merge, parallel, plot, table,
                        targets)

ROOT = os.path.dirname(HERE)
T_START = time.time()

CONFIGS = {
    # name: (checkpoint, quantization, extra env)
    "bf16": ("bf16", None, {}),
    "fp8_blockgemm": ("fp8", "fp8_blockgemm", {}),
    "fp8_cutlass": ("fp8", "fp8", {"VLLM_USE_DEEP_GEMM": "0"}),
    "fp8_blockgemm_online": ("bf16", "fp8_blockgemm", {}),
    "fp8_deepgemm": ("fp8", "fp8", {"VLLM_USE_DEEP_GEMM": "1"}),
    # --compile vllm: the plugin turns on Inductor's PDL (integrations/vllm/compile_config.py);
    # these measure it apart: ours with it off, and vLLM's fp8 with it on (torch's own switch)
    "fp8_blockgemm_nopdl": ("fp8", "fp8_blockgemm", {"FP8LINEAR_VLLM_PDL": "0"}),
    # ... and its quantization fusion pass (integrations/vllm/quant_fusion_pass.py) off
    "fp8_blockgemm_nofuse": ("fp8", "fp8_blockgemm", {"FP8LINEAR_VLLM_FUSE_QUANT": "0"}),
    "fp8_cutlass_pdl": ("fp8", "fp8", {"VLLM_USE_DEEP_GEMM": "0",
                                       "TORCHINDUCTOR_ENABLE_PDL": "1"}),
    "fp8_deepgemm_pdl": ("fp8", "fp8", {"VLLM_USE_DEEP_GEMM": "1",
                                        "TORCHINDUCTOR_ENABLE_PDL": "1"}),
}
DEFAULT_CONFIGS = "bf16,fp8_blockgemm,fp8_cutlass"
ALIASES = {"online": "fp8_blockgemm_online", "deepgemm": "fp8_deepgemm",
           "cutlass": "fp8_cutlass", "blockgemm": "fp8_blockgemm",
           "nopdl": "fp8_blockgemm_nopdl", "nofuse": "fp8_blockgemm_nofuse",
           "cutlass_pdl": "fp8_cutlass_pdl",
           "deepgemm_pdl": "fp8_deepgemm_pdl"}

# NVLink multicast stays off on shared hosts (it can take their GPUs down): vLLM's
# symmetric-memory all-reduce would use it, so its custom all-reduce or NCCL run instead
PARALLEL_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "NCCL_NVLS_ENABLE": "0",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256)
# --shape tiny: a small model of the same architecture (CPU plumbing checks only)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024)
SHAPES = {"llama8b": LLAMA8B, "tiny": TINY, "qwen3_30b_a3b": QWEN3_30B_A3B,
          "tiny_moe": TINY_MOE}
MODEL = LLAMA8B


def architecture() -> str:
    return MODEL.get("architectures", ["LlamaForCausalLM"])[0]


def log(*a):
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


def base_env(extra=None) -> dict:
    e = dict(os.environ)
    e.update({"VLLM_USE_FLASHINFER_SAMPLER": "0",      # required: flashinfer is not shipped
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_DEEP_GEMM": "0"})
    e.update(extra or {})
    return e


# =============================================================================== models
def build_models(work: str, layers: int, seed: int, shape: str) -> dict:
    """Stage `models`, in its own process (the parent never touches the GPU): BF16 checkpoint
    from seeded random weights (generated on the GPU when there is one), then the FP8 one
    through `python -m fp8linear.cli quantize`. Skipped when both exist with these sizes."""
    bf16, fp8 = os.path.join(work, "bf16"), os.path.join(work, "fp8")
    stamp = os.path.join(work, "models.json")
    want = {"layers": layers, "seed": seed, "shape": shape, **MODEL}
    if os.path.exists(stamp):
        with open(stamp) as f:
            old = json.load(f)
        if old.get("model") == want and os.path.exists(os.path.join(fp8, "config.json")):
            log(f"models: reusing {bf16} and {fp8}")
            return old
    os.makedirs(work, exist_ok=True)
    for d in (bf16, fp8):
        shutil.rmtree(d, ignore_errors=True)
    rec = {"model": want}
    # warm vLLM's model-registry cache and its bytecode while the weights are built: the
    # first engine start on a machine otherwise spends ~20 s in "Resolved architecture"
    warm = None
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    warm_log = open(os.path.join(work, "logs", "registry_warm.log"), "w")
    try:
        warm = subprocess.Popen(
            [sys.executable, "-c",
             "import vllm; from vllm import LLM, SamplingParams\n"
             "from vllm.model_executor.models.registry import ModelRegistry as R\n"
             f"print('registry warm:', R._try_inspect_model_cls({architecture()!r}) is not None)"],
            env=base_env(), stdout=warm_log, stderr=subprocess.STDOUT)
    except Exception as e:  # noqa: BLE001
        log(f"models: registry warm-up not started: {e}")
    t = time.time()
    if is_moe(MODEL):
        write_bf16_config(bf16, MODEL, layers)
        rec["fp8_bytes"] = write_fp8_checkpoint(fp8, MODEL, layers, seed)
        rec["build_s"] = round(time.time() - t, 1)
        rec["bf16"] = "config only: the bf16 engine loads dummy weights"
        log(f"models: FP8 checkpoint ({rec['fp8_bytes'] / 1e9:.2f} GB) in {rec['build_s']} s")
        warm_log.close()
        if warm is not None:
            warm.wait(timeout=90)
        with open(stamp, "w") as f:
            json.dump(rec, f, indent=1)
        return rec
    rec["bf16_bytes"] = write_bf16_checkpoint(bf16, layers, seed)
    rec["build_s"] = round(time.time() - t, 1)
    log(f"models: BF16 checkpoint ({rec['bf16_bytes'] / 1e9:.2f} GB) in {rec['build_s']} s")
    t = time.time()
    q = subprocess.run([sys.executable, "-m", "fp8linear.cli", "quantize", bf16, fp8,
                        "--force", "--quiet"], capture_output=True, text=True,
                       env=base_env({"PYTHONPATH": os.pathsep.join(
                           [p for p in (os.environ.get("PYTHONPATH"), ROOT) if p])}))
    rec["quantize_s"] = round(time.time() - t, 1)
    rec["quantize_cli"] = f"python -m fp8linear.cli quantize {bf16} {fp8} --force --quiet"
    rec["quantize_report"] = (q.stdout + q.stderr).strip()[-2000:]
    if q.returncode != 0:
        raise SystemExit(f"fp8linear quantize failed (rc {q.returncode}):\n{q.stdout}{q.stderr}")
    rec["fp8_bytes"] = sum(os.path.getsize(os.path.join(fp8, f)) for f in os.listdir(fp8)
                           if f.endswith(".safetensors"))
    log(f"models: FP8 checkpoint ({rec['fp8_bytes'] / 1e9:.2f} GB) by the CLI in "
        f"{rec['quantize_s']} s")
    warm_log.close()
    if warm is not None:
        try:
            warm.wait(timeout=max(5.0, 90 - (time.time() - t)))
            with open(warm_log.name, errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
            rec["registry_warm"] = lines[-1] if lines else f"rc {warm.returncode}"
        except subprocess.TimeoutExpired:
            warm.kill()
            rec["registry_warm"] = "timed out"
        log(f"models: vLLM registry warm-up: {rec.get('registry_warm')}")
    with open(stamp, "w") as f:
        json.dump(rec, f, indent=1)
    return rec


def write_bf16_checkpoint(path: str, layers: int, seed: int, shard_bytes: float = 2e9) -> int:
    import torch
    os.makedirs(path, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    h, f, v = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"]
    d = MODEL["head_dim"]
    nq, nkv = MODEL["num_attention_heads"] * d, MODEL["num_key_value_heads"] * d

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, device=dev, generator=g) * std).to(torch.bfloat16).cpu()

    def norm(n):
        return (1.0 + 0.05 * torch.randn(n, device=dev, generator=g)).to(torch.bfloat16).cpu()

    def tensors():
        yield "model.embed_tokens.weight", rnd(v, h)
        for i in range(layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", norm(h)
            yield p + "self_attn.q_proj.weight", rnd(nq, h)
            yield p + "self_attn.k_proj.weight", rnd(nkv, h)
            yield p + "self_attn.v_proj.weight", rnd(nkv, h)
            yield p + "self_attn.o_proj.weight", rnd(h, nq)
            yield p + "post_attention_layernorm.weight", norm(h)
            yield p + "mlp.gate_proj.weight", rnd(f, h)
            yield p + "mlp.up_proj.weight", rnd(f, h)
            yield p + "mlp.down_proj.weight", rnd(h, f)
        yield "model.norm.weight", norm(h)
        yield "lm_head.weight", rnd(v, h)

    total = write_shards(path, tensors(), shard_bytes)
    write_config(path, layers)
    return total


def write_config(path: str, layers: int) -> None:
    kw = dict(MODEL, num_hidden_layers=layers, max_position_embeddings=8192,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
              eos_token_id=128001)
    try:  # the device has transformers: its own serialisation, as make_tiny.py does
        from transformers import LlamaConfig
        cfg = LlamaConfig(**kw)
        cfg.architectures = ["LlamaForCausalLM"]
        try:
            cfg.dtype = "bfloat16"
        except Exception:  # noqa: BLE001 (older transformers: torch_dtype)
            cfg.torch_dtype = "bfloat16"
        cfg.save_pretrained(path)
        return
    except Exception as e:  # noqa: BLE001
        log(f"models: transformers' LlamaConfig unavailable ({type(e).__name__}: {e}); "
            f"writing config.json by hand")
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(dict(kw, architectures=["LlamaForCausalLM"], model_type="llama",
                       hidden_act="silu", rope_theta=500000.0, attention_bias=False,
                       mlp_bias=False, torch_dtype="bfloat16", initializer_range=0.02),
                  fh, indent=1)


# =============================================================================== worker
def prompts(n: int, length: int, seed: int, vocab: int = 128000) -> list[dict]:
    r = random.Random(seed)
    return [{"prompt_token_ids": [r.randrange(1, vocab) for _ in range(length)]}
            for _ in range(n)]


def llm_kwargs(spec: dict) -> dict:
    """vLLM's LLM(...) arguments for an engine spec (run_engine's engine_spec)."""
    sizes = sorted(set(spec["batches"]))
    cc = {"cudagraph_capture_sizes": sizes}
    if spec["compile"] == "none":
        cc.update(mode="NONE", cudagraph_mode="FULL_DECODE_ONLY")
    kw = dict(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              gpu_memory_utilization=spec["gpu_memory_utilization"],
              max_model_len=spec["max_model_len"],
              max_num_seqs=max(sizes + ([spec["prefill"][0]] if spec.get("prefill") else [])),
              max_num_batched_tokens=max(8192, max(sizes) * spec["prompt_len"]),
              enable_prefix_caching=False, enforce_eager=False, compilation_config=cc)
    if spec["quantization"]:
        kw["quantization"] = spec["quantization"]
    if spec.get("dummy_weights"):
        kw["load_format"] = "dummy"
    if spec.get("tensor_parallel_size", 1) > 1:
        # expert parallel size = TP x DP (1) when enable_expert_parallel is set
        kw.update(tensor_parallel_size=spec["tensor_parallel_size"],
                  enable_expert_parallel=bool(spec.get("expert_parallel")))
    return kw


def worker(spec_path: str) -> int:
    """One engine configuration in this process: start, decode timings, log-probabilities.
    Writes spec["result"] (JSON) after every phase; exits hard (the parent kills the engine
    core's process group), saving vLLM's shutdown time."""
    spec = json.load(open(spec_path))
    res = {"name": spec["name"], "errors": [], "decode": []}
    deadline = spec["soft_deadline"]

    def save():
        tmp = spec["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, spec["result"])

    t0 = time.time()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    res.update(import_s=round(time.time() - t0, 1), vllm=vllm.__version__, torch=torch.__version__)
    batches = spec["batches"]
    sizes = sorted(set(batches))
    kw = llm_kwargs(spec)
    res["llm_kwargs"] = {k: v for k, v in kw.items()}
    print("E2E_LLM_KWARGS " + json.dumps(res["llm_kwargs"]), flush=True)
    t1 = time.time()
    try:
        llm = LLM(**kw)
    except Exception as e:  # noqa: BLE001
        import traceback
        res["errors"].append(f"engine start: {type(e).__name__}: {e}")
        res["traceback"] = traceback.format_exc()[-4000:]
        save()
        sys.stdout.flush()
        os._exit(3)
    res["start_s"] = round(time.time() - t1, 1)
    print(f"E2E_ENGINE_STARTED {res['start_s']} s", flush=True)
    save()
    n_out, plen = spec["out_len"], spec["prompt_len"]

    def gen(b, max_tokens, seed, prompt_len=None):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
        ps = prompts(b, prompt_len or plen, seed, spec["vocab"])
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [max_tokens] * b:
            raise RuntimeError(f"batch {b}: expected {max_tokens} tokens each, got {set(got)}")
        return dt

    try:
        t = time.time()
        for b in sizes:                                   # warm-up, every batch size
            gen(b, 8, 999)
        res["warmup_s"] = round(time.time() - t, 1)
        for b in batches:
            row = {"batch": b, "t1_s": [], "tn_s": []}
            for rep in range(spec["reps"]):
                if time.time() > deadline and row["tn_s"]:
                    row["cut_short"] = True
                    break
                row["t1_s"].append(gen(b, 1, 1000 * b + rep))
                row["tn_s"].append(gen(b, n_out, 1000 * b + rep))
            if row["tn_s"]:
                t1b, tnb = min(row["t1_s"]), min(row["tn_s"])
                row["per_token_ms"] = (tnb - t1b) / (n_out - 1) * 1e3
                row["decode_tok_s"] = b / (row["per_token_ms"] * 1e-3)
                row["e2e_tok_s"] = b * n_out / tnb
                res["decode"].append(row)
                print(f"E2E_DECODE {spec['name']} batch {b}: {row['per_token_ms']:.3f} ms/token",
                      flush=True)
            save()
            if time.time() > deadline:
                res["errors"].append(f"soft deadline reached after batch {b}")
                break
    except Exception as e:  # noqa: BLE001
        import traceback
        res["errors"].append(f"decode: {type(e).__name__}: {e}")
        res["traceback"] = traceback.format_exc()[-4000:]
    save()

    if spec.get("prefill") and time.time() < deadline:
        # Prefill-heavy: BATCH requests of PROMPT tokens, OUT new tokens each; the time of the
        # whole generate call (prefill dominates), best of the repetitions.
        pb, pl, po = spec["prefill"]
        try:
            ts = []
            for rep in range(max(1, min(3, spec["reps"]))):
                ts.append(gen(pb, po, 77000 + rep, prompt_len=pl))
                if time.time() > deadline:
                    break
            res["prefill"] = {"batch": pb, "prompt_len": pl, "out_len": po, "t_s": ts,
                              "best_s": min(ts), "prompt_tok_s": pb * pl / min(ts)}
            print(f"E2E_PREFILL {spec['name']} {pb}x{pl}+{po}: {min(ts) * 1e3:.1f} ms "
                  f"({pb * pl / min(ts):.0f} prompt tok/s)", flush=True)
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"prefill: {type(e).__name__}: {e}")
        save()

    try:   # log-probabilities (runs even past the soft deadline: two short requests)
        lp_prompt = prompts(1, LP_PROMPT_LEN, 4242, spec["vocab"])[0]["prompt_token_ids"]
        sp = SamplingParams(temperature=0.0, max_tokens=LP_GEN, ignore_eos=True,
                            detokenize=False, logprobs=1)
        o = llm.generate([{"prompt_token_ids": lp_prompt}], sp, use_tqdm=False)[0].outputs[0]
        greedy = list(o.token_ids)
        res["greedy_tokens"] = greedy
        res["greedy_logprobs"] = [d[t].logprob for d, t in zip(o.logprobs, greedy)]
        seq = lp_prompt + (spec.get("tf_tokens") or greedy)
        sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=1)
        plp = llm.generate([{"prompt_token_ids": seq}], sp, use_tqdm=False)[0].prompt_logprobs
        res["tf_seq"] = seq
        res["tf_source"] = "bf16" if spec.get("tf_tokens") else "own"   # whose greedy tokens
        res["tf_logprobs"] = [plp[i][seq[i]].logprob for i in range(1, len(seq))]
        res["tf_top1"] = [next((t for t, lp in plp[i].items() if lp.rank == 1), None)
                          for i in range(1, len(seq))]
    except Exception as e:  # noqa: BLE001
        import traceback
        res["errors"].append(f"logprobs: {type(e).__name__}: {e}")
        res["traceback_lp"] = traceback.format_exc()[-3000:]
    res["wall_s"] = round(time.time() - t0, 1)
    save()
    print("E2E_WORKER_DONE", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ============================================================================== parent
LOG_PATTERNS = {
    "weight_gib": (r"Model loading took ([\d.]+) GiB", float),
    "load_s": (r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds", float),
    "kv_cache_gib": (r"Available KV cache memory: ([\d.]+) GiB", float),
    "kv_cache_tokens": (r"GPU KV cache size: ([\d,]+) tokens", lambda s: int(s.replace(",", ""))),
    "max_concurrency": (r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", float),
    "graph_capture_s": (r"Graph capturing finished in (\d+) secs", float),
    "graph_capture_gib": (r"Graph capturing finished in \d+ secs, took ([\d.]+) GiB", float),
    "init_engine_s": (r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
                      float),
    "compile_s": (r"init engine .* took [\d.]+ s \(compilation: ([\d.]+) s", float),
}


def parse_log(text: str) -> dict:
    out = {}
    for key, (pat, conv) in LOG_PATTERNS.items():
        m = re.findall(pat, text)
        if m:
            out[key] = conv(m[-1])
    kern = sorted(set(re.findall(r"Selected (\w+) for (\w+)", text)))
    if kern:
        out["kernels"] = [f"{a} for {b}" for a, b in kern]
    notes = [ln.split("] ", 1)[-1].strip() for ln in text.splitlines()
             if re.search(r"fp8_blockgemm:|[Cc]udagraph_mode|Resolved architecture|"
                          r"attention backend|Using .*[Aa]ttention", ln)]
    if notes:
        out["log_notes"] = list(dict.fromkeys(notes))[:12]
    errs = [ln.strip() for ln in text.splitlines()
            if re.search(r"Error|Traceback|CUDA out of memory", ln)]
    if errs:
        out["log_errors"] = errs[-8:]
    return out


def kill_group(proc, grace=5.0):
    """SIGTERM then SIGKILL the worker's whole process group (the engine core included);
    waits until the group is gone so the next engine finds the GPU memory free."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        t = time.time()
        while time.time() - t < wait:
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def engine_spec(name, args, work, timeout, tf_tokens) -> tuple[dict, dict]:
    """(the worker's spec, its extra environment) for engine `name` (X, X@tpN or X@epN)."""
    base, tp, ep = parallel(name)
    ckpt, quant, extra_env = CONFIGS[base]
    spec = {"name": name, "model": os.path.join(work, ckpt), "quantization": quant,
            "batches": args.batch_list, "prompt_len": args.prompt_len, "out_len": args.out_len,
            "prefill": args.prefill_spec,
            "reps": args.reps, "compile": args.compile, "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "soft_deadline": time.time() + timeout - args.reserve_s,
            "vocab": min(128000, MODEL["vocab_size"]),
            "dummy_weights": is_moe(MODEL) and ckpt == "bf16",
            "tensor_parallel_size": tp, "expert_parallel": ep,
            "tf_tokens": tf_tokens, "result": os.path.join(work, f"result_{name}.json")}
    return spec, dict(extra_env, **(PARALLEL_ENV if tp > 1 else {}))


def run_engine(name, args, work, timeout, tf_tokens) -> dict:
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    spec, extra_env = engine_spec(name, args, work, timeout, tf_tokens)
    spec_path = os.path.join(work, f"spec_{name}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if os.path.exists(spec["result"]):
        os.remove(spec["result"])
    log_path = os.path.join(logs, f"{name}.log")
    env = base_env(extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), ROOT) if p)
    t = time.time()
    with open(log_path, "w") as lf:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                 spec_path], stdout=lf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=work)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        kill_group(proc)
    wall = time.time() - t
    res = {}
    if os.path.exists(spec["result"]):
        with open(spec["result"]) as f:
            res = json.load(f)
    res.setdefault("errors", [])
    if rc == "timeout":
        res["errors"].append(f"killed at the {timeout:.0f} s time box")
    elif rc != 0:
        res["errors"].append(f"worker exited with rc {rc}")
    with open(log_path, errors="replace") as f:
        text = f.read()
    res.update(parse_log(text))
    res.update(name=name, checkpoint=os.path.basename(spec["model"]),
               quantization=spec["quantization"], env=extra_env,
               tensor_parallel_size=spec["tensor_parallel_size"],
               expert_parallel=spec["expert_parallel"], rc=rc,
               process_wall_s=round(wall, 1), log=os.path.relpath(log_path, work))
    if res.get("errors") and not res.get("decode"):
        res["log_tail"] = text[-3000:]
    return res


def nvidia_smi() -> dict:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                            "clocks.max.sm", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        gpus = q.stdout.strip().splitlines()
        name, mem, drv, clk = [s.strip() for s in gpus[0].split(",")]
        return {"device": name, "device_memory": mem, "driver": drv, "max_sm_clock": clk,
                "device_count": len(gpus)}
    except Exception:  # noqa: BLE001
        return {"device": "unknown (nvidia-smi failed)"}


def device_slug(name: str) -> str:
    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name or "")
    return (m.group(1) if m else re.sub(r"\W+", "_", name or "gpu")).lower()


def engines(args, models_rec) -> int:
    work = args.work
    deadline = T_START + args.budget_s
    smi = nvidia_smi()
    h = {"benchmark": "e2e_vllm", "date": utc_now(), "command": " ".join(
        [os.path.basename(sys.executable)] + sys.argv), "git_commit": git_commit(), **smi,
        "model": dict(models_rec.get("model", {}), note=(
            f"--shape {args.shape}: a small model of the architecture, seeded random weights "
            f"(plumbing checks)" if args.shape.startswith("tiny") else
            f"Qwen3-30B-A3B's shape, {args.layers} of its 48 layers, seeded random weights "
            f"(bf16: vLLM's dummy weights); log-probabilities compared with "
            f"{logprob_reference(MODEL)} on the same FP8 checkpoint" if is_moe(MODEL) else
            f"{args.layers} of Llama-3.1-8B's 32 layers (seeded random weights): the 32-layer "
            f"model's load and start-up did not fit in one device call")),
        "models_build": {k: v for k, v in models_rec.items() if k != "model"},
        "batches": args.batch_list, "prompt_len": args.prompt_len, "out_len": args.out_len,
        "prefill": args.prefill_spec, "reps": args.reps, "compile": args.compile,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "compile_note": (
            "mode NONE + cudagraph_mode FULL_DECODE_ONLY (capture sizes = batch sizes): each "
            "decode step replays one full-model CUDA graph, prefill eager, no torch.compile "
            "(vLLM's custom CUDA ops instead of Inductor fusions, same for every config)"
            if args.compile == "none" else
            "vLLM default: torch.compile (VLLM_COMPILE) + FULL_AND_PIECEWISE graphs, capture "
            "sizes = batch sizes"),
        "timing": ("per_token_ms = (min t(out_len) - min t(1)) / (out_len - 1) over reps "
                   "LLM.generate calls of `batch` requests; engine start = LLM(...) "
                   "constructor in a fresh process, fp8linear kernels prebuilt"),
        "skipped": []}
    par = {n: parallel(n) for n in args.config_list if "@" in n}
    if par:
        h["parallel"] = {
            "engines": {n: {"tensor_parallel_size": tp, "expert_parallel": ep}
                        for n, (_, tp, ep) in par.items()},
            "note": ("X@tpN: tensor_parallel_size=N; X@epN: also enable_expert_parallel=True "
                     "(experts split over the N GPUs, attention tensor-parallel); weight and KV "
                     "cache GiB per GPU; log-probabilities against the TP1 engine X in "
                     "parallel_vs_tp1"),
            "env": PARALLEL_ENV}
    doc = {"header": h, "engines": {}, "logprobs": {}, "targets": {}}
    slug = device_slug(smi.get("device", ""))
    shape = f"_{args.shape}" if is_moe(MODEL) else ""
    if par:   # (a multi-GPU run beside the same day's one-GPU file: h100x2)
        slug += f"x{max(tp for _, tp, _ in par.values())}"
    name = f"{h['date'][:10]}_e2e_vllm{shape}_{slug}.json"
    out = args.out or os.path.join(HERE, "results", name)
    if os.path.isdir(out):
        out = os.path.join(out, name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def save():
        h["elapsed_s"] = round(time.time() - T_START, 1)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)

    for name in args.config_list:
        left = deadline - time.time()
        need = args.min_engine_s * (4 if name.startswith("fp8_deepgemm") else 1)
        if left < need:
            h["skipped"].append(f"{name}: {left:.0f} s left < {need} s")
            log(f"{name}: skipped, {left:.0f} s left")
            continue
        if parallel(name)[1] > smi.get("device_count", 1 << 30):
            h["skipped"].append(f"{name}: {smi['device_count']} GPU(s)")
            log(f"{name}: skipped, {smi['device_count']} GPU(s)")
            continue
        timeout = min(args.engine_timeout * (3 if name.startswith("fp8_deepgemm") else 1), left)
        tf = doc["engines"].get("bf16", {}).get("greedy_tokens")
        log(f"{name}: starting (time box {timeout:.0f} s)")
        r = run_engine(name, args, work, timeout, tf)
        why = " ".join([r.get("traceback", "")] + r.get("errors", []) + [
            ln for ln in r.get("log_tail", "").splitlines() if not ln.startswith("E2E_")])
        if (r.get("start_s") is None and args.compile == "none" and not h.get("compile_fallback")
                and re.search(r"cudagraph|cuda graph|compil", why, re.I)
                and deadline - time.time() > need):
            # mode NONE + FULL_DECODE_ONLY refused by this vLLM: fall back to its default
            # compilation (torch.compile + FULL_AND_PIECEWISE) for this and later engines
            h["compile_fallback"] = (f"{name} did not start with --compile none "
                                     f"({'; '.join(r.get('errors', []))[:300]}): "
                                     f"switched to --compile vllm")
            log(h["compile_fallback"])
            args.compile = h["compile"] = "vllm"
            h["compile_note"] += " [fell back to vLLM's default compilation: see compile_fallback]"
            timeout = min(timeout, deadline - time.time())
            r = run_engine(name, args, work, timeout, tf)
        doc["engines"][name] = r
        for k in ("vllm", "torch"):
            if r.get(k):
                h[k] = r[k]
        per = ", ".join(f"b{d['batch']} {d['per_token_ms']:.2f}" for d in r.get("decode", [])
                        if d.get("per_token_ms"))
        log(f"{name}: rc {r['rc']}, start {r.get('start_s')} s, weights {r.get('weight_gib')} "
            f"GiB, KV {r.get('kv_cache_tokens')} tokens, ms/token {per or '-'}, "
            f"{r['process_wall_s']} s" + (f"; errors: {r['errors']}" if r["errors"] else ""))
        doc["logprobs"] = compare_logprobs(doc["engines"], MODEL)
        doc.update(compare_variants(doc["engines"]))
        doc["targets"] = targets(doc["engines"], args.batch_list, MODEL)
        save()
    for name, r in doc["engines"].items():
        for k in ("tf_seq", "tf_top1"):          # bulky, and equal across engines
            if name != "bf16":
                r.pop(k, None)
    doc["rows"] = decode_rows(doc["engines"])
    save()
    log(f"wrote {out}")
    if not args.no_plot:
        try:
            png = os.path.splitext(out)[0] + ".png"
            plot(doc, png)
            log(f"wrote {png}")
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {type(e).__name__}: {e}")
    print(table(doc))
    ok = bool(doc["rows"]) and all(not r.get("errors") for r in doc["engines"].values())
    return 0 if ok else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="all", choices=("all", "models", "engines"))
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--build-models", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", default="/tmp/e2e_vllm", help="checkpoints, specs, engine logs")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shape", default="llama8b", choices=tuple(SHAPES),
                   help="llama8b (default), qwen3_30b_a3b (MoE: FP8 checkpoint written "
                        "directly, bf16 on dummy weights); tiny, tiny_moe: CPU plumbing checks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma list of {', '.join(CONFIGS)} (aliases: online, deepgemm, "
                        f"cutlass, blockgemm); a leading '+' adds to the default. "
                        f"Run in this order; bf16 first gives the log-probability reference. "
                        f"NAME@tp<N>: NAME with tensor_parallel_size=N; NAME@ep<N> (MoE "
                        f"--shape): also enable_expert_parallel=True (N >= 2 GPUs); compared "
                        f"with NAME's log-probabilities, and in the targets with anchors of "
                        f"the same suffix")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--b256", action="store_true", help="add batch 256 (max_num_seqs 256)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out-len", type=int, default=128)
    # 5: with 3 the same engine varied by ±0.3 ms per token between runs (H100, 8 layers)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--compile", default="none", choices=("none", "vllm"))
    p.add_argument("--prefill", default="16:2048:16",
                   help="prefill-heavy workload BATCH:PROMPT:OUT (issue 6: 16 requests of "
                        "2048 prompt tokens, 16 new tokens each), timed after the decode "
                        "batches; 'none' skips it")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: enough for the longest workload")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="total time box of this invocation (models + engines)")
    p.add_argument("--engine-timeout", type=float, default=200.0,
                   help="time box of one engine process (x3 for fp8_deepgemm)")
    p.add_argument("--min-engine-s", type=float, default=70.0,
                   help="an engine does not start with less time than this left")
    p.add_argument("--reserve-s", type=float, default=20.0,
                   help="an engine stops timing this long before its time box")
    p.add_argument("--out", help="JSON path or folder (PNG beside it)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--table", metavar="JSON", help="print the table of an earlier run and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge the engines of earlier runs (same model and workloads, e.g. "
                        "anchors run in later calls on the same machine) into --out, with "
                        "targets, plot and table, and exit; a later run's engine of the same "
                        "name replaces the earlier one; JSON@SUFFIX appends SUFFIX to that "
                        "run's engine names (e.g. @_seqs256 for a --b256 run kept beside)")
    a = p.parse_args(argv)
    if a.merge and not a.out:
        p.error("--merge needs --out (the merged JSON; its PNG goes beside it)")
    cl = a.configs.strip()
    if cl.startswith("+"):
        cl = DEFAULT_CONFIGS + "," + cl[1:]
    a.config_list = []
    for c in (x.strip() for x in cl.split(",")):
        base, at, sfx = c.partition("@")
        base = ALIASES.get(base, base)
        if (base or at) and base not in CONFIGS:
            p.error(f"unknown config {base!r}: one of {', '.join(CONFIGS)}")
        if at:
            m = re.fullmatch(r"(tp|ep)(\d+)", sfx)
            if not m:
                p.error(f"config {c!r}: unknown suffix @{sfx}: @tp<N> (tensor parallel) or "
                        f"@ep<N> (expert parallel)")
            if int(m[2]) < 2:
                p.error(f"config {c!r}: @{m[1]}{m[2]} needs N >= 2 (N = 1 is {base})")
            if m[1] == "ep" and not is_moe(SHAPES[a.shape]):
                p.error(f"config {c!r}: @ep needs a MoE --shape (qwen3_30b_a3b, tiny_moe), "
                        f"not {a.shape}")
            base = f"{base}@{m[1]}{int(m[2])}"
        if base and base not in a.config_list:
            a.config_list.append(base)
    a.batch_list = [int(b) for b in a.batches.split(",") if b.strip()]
    if a.b256 and 256 not in a.batch_list:
        a.batch_list.append(256)
    a.prefill_spec = None
    if a.prefill != "none":
        try:
            a.prefill_spec = [int(v) for v in a.prefill.split(":")]
            assert len(a.prefill_spec) == 3 and min(a.prefill_spec) > 0
        except (ValueError, AssertionError):
            p.error(f"--prefill {a.prefill!r}: expected BATCH:PROMPT:OUT or none")
    need = max(a.prompt_len + a.out_len, LP_PROMPT_LEN + LP_GEN + 1,
               a.prefill_spec[1] + a.prefill_spec[2] if a.prefill_spec else 0)
    if a.max_model_len is None:
        a.max_model_len = max(512, need)
    if need > a.max_model_len:
        p.error(f"--max-model-len {a.max_model_len} too small for the workloads ({need})")
    return a


def main(argv=None) -> int:
    global MODEL, T_START  # (the budget and the log's clock count from here, not from import)
    T_START = time.time()
    args = parse_args(argv)
    MODEL = SHAPES[args.shape]  # (--merge: which engine the log-probabilities compare with)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    if args.merge:
        return merge(args.merge, args.out)
    if args.worker:
        return worker(args.worker)
    if args.build_models:
        build_models(args.work, args.layers, args.seed, args.shape)
        return 0
    rec = {}
    if args.stage in ("all", "models"):
        t = time.time()
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--build-models",
                            "--work", args.work, "--layers", str(args.layers), "--seed",
                            str(args.seed), "--shape", args.shape], env=base_env({"PYTHONPATH": os.pathsep.join(
                                p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)}),
                           timeout=max(30.0, args.budget_s - 60))
        log(f"models stage rc {r.returncode} in {time.time() - t:.0f} s")
        if r.returncode != 0:
            return 2
        if args.stage == "models":
            return 0
    stamp = os.path.join(args.work, "models.json")
    if not os.path.exists(stamp):
        print(f"e2e_vllm: no models in {args.work}: run --stage models first", file=sys.stderr)
        return 2
    with open(stamp) as f:
        rec = json.load(f)
    if rec.get("model") != {"layers": args.layers, "seed": args.seed, **MODEL}:
        print(f"e2e_vllm: {args.work} holds another model ({rec.get('model')}): run "
              f"--stage models with the same --layers/--seed", file=sys.stderr)
        return 2
    return engines(args, rec)


if __name__ == "__main__":
    sys.exit(main())
