"""The vLLM plugin on the GPU device (vLLM 0.24.0): one step per call, results under OUT.

usage: python3 benchmarks/vllm_device/device_check.py STEP WORK_DIR OUT_DIR
  engines  tiny Llama (block FP8, compressed-tensors, BF16 quantized online) with CUDA
           graphs + torch.compile against eager, log-probabilities against the BF16 model,
           the FP8 weights each layer holds, a layer-level check that fp8linear's CUDA
           kernels ran (the torch reference is made to raise); tiny Mixtral and Qwen3-MoE
           models whose experts run on fp8linear's MoE (Fp8BlockGemmExperts) against the
           transformers + moe_reference model, and against vLLM's own fp8
  memory   peak GPU memory right after loading (vLLM's own measurement) of a Llama-shaped
           model (4 layers, hidden 4096): BF16, block-FP8 checkpoint, BF16 quantized online;
           asserts online <= FP8 model + one BF16 layer + transients
  tp2      (2 GPUs) TP=2 against TP=1 on the same block-FP8 checkpoints: the tiny model
           (64-row k/v heads, 192 rows/columns of gate/up/down per rank) and an aligned one

Each step writes OUT/<step>.json and OUT/<step>.md (the table it prints) and exits 1 when a
check fails. Models are (re)built under WORK_DIR when missing. The checks reuse the CPU
suite's helpers (tests/integrations/vllm/{tiny_llama,engine_runner}.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests" / "integrations" / "vllm"
sys.path.insert(0, str(TESTS))

import tiny_llama  # noqa: E402
import tiny_moe  # noqa: E402
from tiny_llama import MAX_TOKENS, PROMPT  # noqa: E402

# same tolerances as the CPU suite (tests/integrations/vllm/test_vllm_engine.py)
MEAN_TOL, MAX_TOL = 0.35, 1.2
GRAPH_MEAN_TOL, GRAPH_MAX_TOL = 0.2, 0.6
MOE_MEAN_TOL, MOE_MAX_TOL = 0.15, 0.6   # tests/integrations/vllm/test_vllm_moe_engine.py
# the MoE engine runs of step_engines, and the tiny model (tiny_moe) each serves
MOE_RUNS = {"mixtral_fp8_graphs": "mixtral", "mixtral_online_graphs": "mixtral",
            "qwen3_moe_fp8_eager": "qwen3_moe", "qwen3_moe_fp8_graphs": "qwen3_moe",
            "qwen3_moe_fp8_vllm_graphs": "qwen3_moe"}
KERNEL_REL_TOL = 1e-2          # device GEMM vs CPU reference, relative Frobenius
MEMORY_SLACK = 128 * 2**20     # allocator rounding, quantization slabs, warm-up buffers


# --------------------------------------------------------------------------- helpers
def env(**extra) -> dict:
    e = dict(os.environ)
    e.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
              "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "PYTHONUNBUFFERED": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
              # vLLM's own fp8 and its MoE would JIT-compile DeepGEMM for minutes;
              # CUTLASS / Triton are precompiled
              "VLLM_USE_DEEP_GEMM": "0",
              # the multi-GPU hosts are shared: NVLink multicast can take their GPUs out of
              # service (device KINDS.md), so it stays off in every process we start
              "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"})
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run_engines(runs, out_dir: Path, tag: str, forbid_reference=False, extra_env=None):
    spec, res = out_dir / f"{tag}.spec.json", out_dir / f"{tag}.results.json"
    spec.write_text(json.dumps({"runs": runs, "forbid_reference": forbid_reference}))
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(TESTS / "engine_runner.py"), str(spec),
                           str(res)], env=env(**(extra_env or {})), capture_output=True,
                          text=True)
    (out_dir / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    print(f"[{tag}] engine_runner rc={proc.returncode} in {time.time() - t0:.0f}s "
          f"(log: {tag}.log)", flush=True)
    return json.loads(res.read_text()) if res.exists() else {}, proc.stdout + proc.stderr


def prompt_diff(a, b):
    import torch
    d = (torch.tensor(a) - torch.tensor(b)).abs()
    return float(d.mean()), float(d.max())


def ref_prompt_logprobs(model_dir):
    return prompt_token_logprobs(tiny_llama.reference_logprobs(model_dir, PROMPT))


def prompt_token_logprobs(ref):
    """[len(PROMPT) - 1]: the log-probability of each prompt token after those before it."""
    import torch
    tok = torch.tensor(PROMPT[1:])
    return ref[:-1].gather(1, tok[:, None])[:, 0].tolist()


def quantize_cli(src, dst, *extra):
    if not (Path(dst) / "config.json").exists():
        subprocess.run([sys.executable, "-m", "fp8linear.cli", "quantize", str(src), str(dst),
                        "--quiet", "--force", *extra], check=True)
    return Path(dst)


class Checks:
    def __init__(self):
        self.rows, self.failed = [], 0

    def add(self, what, value, ok, note=""):
        cell = lambda x: str(x).replace("|", "/").replace("\n", " ")  # noqa: E731
        self.rows.append((cell(what), cell(value), "ok" if ok else "FAIL", cell(note)))
        self.failed += not ok

    def table(self, title):
        lines = [f"## {title}", "", "| check | value | result | note |", "|---|---|---|---|"]
        lines += [f"| {w} | {v} | {r} | {n} |" for w, v, r, n in self.rows]
        return "\n".join(lines)


def finish(step, out_dir: Path, checks: Checks, data: dict):
    md = checks.table(f"vLLM plugin on the device: {step}")
    print(md, flush=True)
    (out_dir / f"{step}.md").write_text(md + "\n")
    (out_dir / f"{step}.json").write_text(json.dumps(data, indent=1))
    print(f"{step}: {len(checks.rows) - checks.failed} passed, {checks.failed} failed")
    return 1 if checks.failed else 0


# --------------------------------------------------------------------------- models
def tiny_models(work: Path) -> dict:
    bf16 = work / "tiny" / "bf16"
    if not (bf16 / "config.json").exists():
        tiny_llama.write_bf16(bf16)
    ct = work / "tiny" / "ct"
    if not (ct / "config.json").exists():
        tiny_llama.write_compressed_tensors(bf16, ct)
    models = {"bf16": bf16, "fp8": quantize_cli(bf16, work / "tiny" / "fp8"), "ct": ct}
    for name, arch in (("mixtral", tiny_moe.MIXTRAL), ("qwen3_moe", tiny_moe.QWEN3_MOE)):
        moe = work / "tiny" / f"{name}_bf16"
        if not (moe / "config.json").exists():
            tiny_moe.write_bf16(moe, arch)
        models[f"{name}_bf16"] = moe
        models[f"{name}_fp8"] = quantize_cli(moe, work / "tiny" / f"{name}_fp8")
    return models


# --------------------------------------------------------------------------- engines
def step_engines(work: Path, out: Path) -> int:
    import torch
    m = tiny_models(work)
    base = {"prompt": PROMPT, "max_tokens": MAX_TOKENS}
    runs = [
        dict(base, name="fp8_eager", model=str(m["fp8"]), quantization="fp8_blockgemm",
             enforce_eager=True, layer_check=True),
        dict(base, name="fp8_graphs", model=str(m["fp8"]), quantization="fp8_blockgemm",
             enforce_eager=False),
        dict(base, name="bf16_online_graphs", model=str(m["bf16"]),
             quantization="fp8_blockgemm", enforce_eager=False),
        dict(base, name="ct_graphs", model=str(m["ct"]), quantization="fp8_blockgemm",
             enforce_eager=False),
        dict(base, name="mixtral_fp8_graphs", model=str(m["mixtral_fp8"]),
             quantization="fp8_blockgemm", enforce_eager=False),
        dict(base, name="mixtral_online_graphs", model=str(m["mixtral_bf16"]),
             quantization="fp8_blockgemm", enforce_eager=False),
        dict(base, name="qwen3_moe_fp8_eager", model=str(m["qwen3_moe_fp8"]),
             quantization="fp8_blockgemm", enforce_eager=True),
        dict(base, name="qwen3_moe_fp8_graphs", model=str(m["qwen3_moe_fp8"]),
             quantization="fp8_blockgemm", enforce_eager=False),
        dict(base, name="qwen3_moe_fp8_vllm_graphs", model=str(m["qwen3_moe_fp8"]),
             quantization="fp8", enforce_eager=False),
        dict(base, name="bf16_graphs", model=str(m["bf16"]), quantization=None,
             enforce_eager=False),
    ]
    if os.environ.get("FP8LV_ENGINES"):  # a subset when device time is short, e.g. "fp8_eager,..."
        keep = set(os.environ["FP8LV_ENGINES"].split(","))
        runs = [r for r in runs if r["name"] in keep]
    res, _ = run_engines(runs, out, "engines", forbid_reference=True)
    c = Checks()
    for r in runs:
        got = res.get(r["name"], {"error": "no result"})
        c.add(f"{r['name']}: runs", got.get("start_s", "-"),
              "error" not in got, got.get("error", "")[-300:].replace("\n", " ")
              if "error" in got else f"engine start {got.get('start_s')} s")
    ok = lambda n: n in res and "error" not in res[n]  # noqa: E731
    ref = ref_prompt_logprobs(m["bf16"])
    if ok("bf16_graphs"):
        mean, mx = prompt_diff(res["bf16_graphs"]["prompt_logprobs"], ref)
        c.add("bf16 (vLLM, no quantization) vs BF16 reference", f"{mean:.3f} / {mx:.3f}",
              mean < 0.1, "mean / max abs logprob difference: the baseline")
    for n, kind, sd in [("fp8_eager", "checkpoint", None), ("fp8_graphs", "checkpoint", None),
                        ("bf16_online_graphs", "online", None),
                        ("ct_graphs", "checkpoint", torch.bfloat16)]:
        if not ok(n):
            continue
        layers = res[n]["layers"]
        methods = {row["method"] for row in layers}
        c.add(f"{n}: every linear layer ours", ", ".join(sorted(methods)),
              methods == {"Fp8BlockGemmOnlineLinearMethod" if kind == "online"
                          else "Fp8BlockGemmLinearMethod"} and len(layers) == 8)
        want = tiny_llama.expected_digests(m["bf16"], kind, sd)
        bad = [row["name"] for row in layers if any(
            abs(a - b) > 1e-9 * abs(b) + 1e-9 for a, b in zip(row["digest"], want[row["name"]]))]
        c.add(f"{n}: FP8 weights = quantized checkpoint", f"{len(layers) - len(bad)}/8",
              not bad, ", ".join(bad))
        mean, mx = prompt_diff(res[n]["prompt_logprobs"], ref)
        c.add(f"{n} vs BF16 reference", f"{mean:.3f} / {mx:.3f}",
              mean < MEAN_TOL and mx < MAX_TOL, f"tol {MEAN_TOL} / {MAX_TOL}")
    if ok("fp8_eager") and ok("fp8_graphs"):
        mean, mx = prompt_diff(res["fp8_eager"]["prompt_logprobs"],
                               res["fp8_graphs"]["prompt_logprobs"])
        c.add("fp8: CUDA graphs + torch.compile vs eager", f"{mean:.3f} / {mx:.3f}",
              mean < GRAPH_MEAN_TOL and mx < GRAPH_MAX_TOL,
              f"tol {GRAPH_MEAN_TOL} / {GRAPH_MAX_TOL}; tokens {res['fp8_eager']['tokens'][:6]}"
              f" vs {res['fp8_graphs']['tokens'][:6]}")
    if ok("fp8_eager"):
        dev = res["fp8_eager"]["device_layers"] or []
        backends = sorted({b for row in dev for b in row["backends"].values()})
        c.add("layer backends (M = 1, 64, 512)", ", ".join(backends),
              backends == ["sm90"] and len(dev) == 8, "sm90 = our Hopper CUDA kernels")
        worst = max((e for row in dev for e in row["rel_err"].values()), default=float("inf"))
        c.add("layer output vs CPU reference GEMM", f"{worst:.2e}", worst < KERNEL_REL_TOL,
              "max relative error over layers, M = 3 and 200")
        c.add("torch reference never ran on the GPU", "raises if called", True,
              "all runs above completed with it patched to raise")
    moe_refs = {}
    for n, arch in MOE_RUNS.items():
        if not ok(n):
            continue
        if arch not in moe_refs:
            moe_refs[arch] = prompt_token_logprobs(tiny_moe.reference_logprobs(
                m[f"{arch}_bf16"], m[f"{arch}_fp8"], PROMPT))
        experts = [row.get("experts") for row in res[n]["layers"] if "experts" in row]
        if "vllm" not in n:
            c.add(f"{n}: experts class", ", ".join(map(str, experts)),
                  experts == ["Fp8BlockGemmExperts"], "fp8linear's MoE behind vLLM's method")
        mean, mx = prompt_diff(res[n]["prompt_logprobs"], moe_refs[arch])
        c.add(f"{n} vs transformers + moe_reference", f"{mean:.3f} / {mx:.3f}",
              mean < MOE_MEAN_TOL and mx < MOE_MAX_TOL, f"tol {MOE_MEAN_TOL} / {MOE_MAX_TOL}")
    return finish("engines", out, c, res)


# --------------------------------------------------------------------------- memory
MEMORY_MODEL = dict(hidden=4096, layers=4, heads=32, kv_heads=8, intermediate=14336,
                    vocab=32000)
if os.environ.get("FP8LV_MEMORY_MODEL"):  # e.g. a smaller shape for a dry run
    MEMORY_MODEL = dict(MEMORY_MODEL, **json.loads(os.environ["FP8LV_MEMORY_MODEL"]))


def _checkpoint_bytes(d: Path) -> int:
    from safetensors import safe_open
    total = 0
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                n = 1
                for s in t.get_shape():
                    n *= s
                total += n * {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
    return total


def step_memory(work: Path, out: Path) -> int:
    cfg = MEMORY_MODEL
    bf16 = work / "mem" / "bf16"
    if not (bf16 / "config.json").exists():
        t0 = time.time()
        tiny_llama.write_bf16(bf16, **cfg)
        print(f"[memory] wrote {bf16} in {time.time() - t0:.0f}s", flush=True)
    fp8 = quantize_cli(bf16, work / "mem" / "fp8")
    h, inter = cfg["hidden"], cfg["intermediate"]
    hd = h // cfg["heads"]
    # vLLM's linear layers, fused: the largest one in BF16 is what online loading adds
    largest_bf16 = max((cfg["heads"] + 2 * cfg["kv_heads"]) * hd * h, h * h, 2 * inter * h,
                       h * inter) * 2
    fp8_bytes, bf16_bytes = _checkpoint_bytes(fp8), _checkpoint_bytes(bf16)
    runs = {"bf16": (bf16, None), "fp8_checkpoint": (fp8, "fp8_blockgemm"),
            "bf16_online": (bf16, "fp8_blockgemm")}
    peaks, data = {}, {"fp8_checkpoint_bytes": fp8_bytes, "bf16_checkpoint_bytes": bf16_bytes,
                       "largest_linear_bf16_bytes": largest_bf16}
    for name, (model, quant) in runs.items():
        r = [{"name": name, "model": str(model), "quantization": quant, "enforce_eager": True,
              "prompt": PROMPT[:8], "max_tokens": 2}]
        res, log = run_engines(r, out, f"memory_{name}", extra_env={"VLLM_LOGGING_LEVEL": "DEBUG"})
        m = re.search(r"Peak GPU memory after loading weights: ([0-9.]+) GiB", log)
        peaks[name] = float(m.group(1)) * 2**30 if m else None
        data[name] = {"peak_bytes": peaks[name], "error": res.get(name, {}).get("error"),
                      "peak_after_engine_start_bytes":
                          res.get(name, {}).get("cuda_peak_after_start_bytes")}
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b is not None else "not found"  # noqa: E731
    c = Checks()
    c.add("checkpoint sizes: BF16 / block FP8", f"{gib(bf16_bytes)} / {gib(fp8_bytes)}", True,
          f"largest fused linear layer in BF16: {gib(largest_bf16)}")
    for name in runs:
        c.add(f"{name}: loads and generates", gib(peaks[name]),
              peaks[name] is not None and not data[name]["error"],
              (data[name]["error"] or "")[-200:].replace("\n", " ") or
              "peak after loading weights")
    bound = fp8_bytes + largest_bf16 + MEMORY_SLACK
    on = peaks["bf16_online"]
    c.add("online peak <= FP8 model + one BF16 layer + 128 MiB", f"{gib(on)} <= {gib(bound)}",
          on is not None and on <= bound,
          f"BF16 + FP8 would be {gib(bf16_bytes + fp8_bytes)}")
    return finish("memory", out, c, data)


# --------------------------------------------------------------------------- tp2
def step_tp2(work: Path, out: Path) -> int:
    m = tiny_models(work)
    aligned = work / "tiny" / "aligned_bf16"
    if not (aligned / "config.json").exists():
        # 2 heads of 128, 2 kv heads, intermediate 768: every TP=2 shard on the 128 grid
        tiny_llama.write_bf16(aligned, heads=2, kv_heads=2, intermediate=768)
    aligned_fp8 = quantize_cli(aligned, work / "tiny" / "aligned_fp8")
    base = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "quantization": "fp8_blockgemm",
            "enforce_eager": False}
    runs = []
    for tag, model in (("misaligned", m["fp8"]), ("aligned", aligned_fp8)):
        for tp in (1, 2):
            runs.append(dict(base, name=f"{tag}_tp{tp}", model=str(model),
                             llm_kwargs={"tensor_parallel_size": tp,
                                         # NCCL all-reduce: no IPC/symmetric-memory paths
                                         "disable_custom_all_reduce": True}))
    # TP=2 runs its workers in processes; apply_model ships the inspection function there
    res, _ = run_engines(runs, out, "tp2", extra_env={
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    c = Checks()
    for r in runs:
        got = res.get(r["name"], {"error": "no result"})
        c.add(f"{r['name']}: runs", got.get("start_s", "-"), "error" not in got,
              got.get("error", "")[-300:].replace("\n", " "))
    ok = lambda n: n in res and "error" not in res[n]  # noqa: E731
    for tag, (mean_tol, max_tol) in (("aligned", (GRAPH_MEAN_TOL, GRAPH_MAX_TOL)),
                                     ("misaligned", (MEAN_TOL, MAX_TOL))):
        a, b = f"{tag}_tp1", f"{tag}_tp2"
        if ok(a) and ok(b):
            mean, mx = prompt_diff(res[a]["prompt_logprobs"], res[b]["prompt_logprobs"])
            c.add(f"{tag}: TP=2 vs TP=1", f"{mean:.3f} / {mx:.3f}",
                  mean < mean_tol and mx < max_tol,
                  f"tol {mean_tol} / {max_tol}" + ("; down_proj re-blocked along K"
                                                   if tag == "misaligned" else ""))
            scales = {row["name"].split(".", 3)[-1]: row["scale"] for row in res[b]["layers"]}
            c.add(f"{tag}: TP=2 scale shapes (rank 0)", json.dumps(scales).replace("|", "/"),
                  True)
    return finish("tp2", out, c, res)


def main() -> int:
    step, work, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    steps = {"engines": step_engines, "memory": step_memory, "tp2": step_tp2}
    if step not in steps:
        print(f"unknown step {step!r}: one of {', '.join(steps)}", file=sys.stderr)
        return 2
    return steps[step](work, out)


if __name__ == "__main__":
    sys.exit(main())
