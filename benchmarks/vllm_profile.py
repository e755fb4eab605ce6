"""Where a vLLM decode step's GPU time goes: kernels of one engine at one batch size, per
decode step, under torch.profiler (issue 6's diagnosis tool; not a timing benchmark).

    python benchmarks/vllm_profile.py --model /tmp/e2e_vllm/fp8 --quantization fp8_blockgemm \
        --batch 64 --out DIR

Runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the profiler sees its
kernels, CUDA-graph replays included), with e2e_vllm.py's engine settings. Two profiled
generates of the same prompts, 1 and 1 + STEPS new tokens: the difference of their kernel
times / STEPS is the GPU time per decode step, per kernel name, and the difference of their
wall times (unprofiled, best of two) / STEPS the step's wall time; wall - GPU busy ~ what
the host adds. Writes
<out>/profile_<name>_b<batch>.txt (kernels by time per step, grouped) and prints its head.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time

# (before vLLM is imported: the engine core in this process, so its kernels are profiled)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# kernel name -> group, first match wins (names as CUPTI reports them)
GROUPS = [
    ("attention", r"flash|fmha|attn|attention|reshape_and_cache"),
    ("fp8linear gemm", r"fp8l::fp8_gemm|fp8l::.*decode"),
    ("fp8linear fused quant", r"_norm_quant_kernel|_silu_mul_quant_kernel"),
    ("fp8linear quant", r"fp8l::.*quant|^_quant_kernel"),
    ("deepgemm", r"deep_gemm"),
    ("vLLM fused quant", r"rms_norm.*quant|silu_and_mul.*quant"),
    ("vLLM quant", r"per_token_group|quant"),
    ("cutlass / cublas (lm_head)", r"cutlass|cublas|gemm|gemv|nvjet|xmma"),
    ("inductor (triton)", r"^triton_"),
    ("sampling / logits", r"sort|topk|softmax|argmax|sample|scatter|gather"),
]


def group_of(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name, re.I):
            return g
    return "other"


def kernel_times(prof) -> dict:
    """name -> (total us, count) over the profiled region's CUDA kernels."""
    out = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        t, c = out.get(e.name, (0.0, 0))
        out[e.name] = (t + e.time_range.elapsed_us(), c + 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--name", default=None, help="label (default: the quantization)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=".")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=128000, help="prompt token ids below this")
    a = ap.parse_args(argv)
    name = a.name or a.quantization or "bf16"

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    sizes = sorted({1, 4, 16, 64, a.batch})
    kw = dict(model=a.model, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              gpu_memory_utilization=0.35, max_model_len=a.prompt_len + a.steps + 64,
              max_num_seqs=max(sizes), max_num_batched_tokens=max(8192, a.batch * a.prompt_len),
              enable_prefix_caching=False, enforce_eager=False,
              compilation_config={"cudagraph_capture_sizes": sizes})
    if a.quantization:
        kw["quantization"] = a.quantization
    llm = LLM(**kw)
    r = random.Random(7)
    ps = [{"prompt_token_ids": [r.randrange(1, a.vocab) for _ in range(a.prompt_len)]}
          for _ in range(a.batch)]

    cuda = torch.cuda.is_available()

    def gen(n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    counts = (1, 1 + a.steps)
    for n in counts:                    # warm-up (compiled sizes, allocator)
        gen(n)
    # wall times unprofiled, best of two
    walls = {n: min(gen(n), gen(n)) for n in counts}
    res = {}
    for n in counts:
        acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            gen(n)
        res[n] = kernel_times(prof)
    (w1, k1), (w2, k2) = (walls[1], res[1]), (walls[1 + a.steps], res[1 + a.steps])
    per = {}
    for kname in set(k1) | set(k2):
        t = (k2.get(kname, (0, 0))[0] - k1.get(kname, (0, 0))[0]) / a.steps
        c = (k2.get(kname, (0, 0))[1] - k1.get(kname, (0, 0))[1]) / a.steps
        if t > 0.05:
            per[kname] = (t, c)
    busy = sum(t for t, _ in per.values())
    step_wall = (w2 - w1) / a.steps * 1e6
    groups = {}
    for kname, (t, c) in per.items():
        g = groups.setdefault(group_of(kname), [0.0, 0.0])
        g[0] += t
        g[1] += c
    dev = torch.cuda.get_device_name() if cuda else "CPU (no kernels profiled)"
    lines = [f"# {name} at batch {a.batch}: {dev}, torch "
             f"{torch.__version__}; per decode step (difference of {1 + a.steps} and 1 new "
             f"tokens, / {a.steps})",
             f"step wall {step_wall:.0f} us, GPU kernels {busy:.0f} us "
             f"(wall - kernels {step_wall - busy:.0f} us)", "", "## by group (us / step, "
             "kernels / step)"]
    for g, (t, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{t:9.1f} {c:7.1f}  {g}")
    lines += ["", f"## top {a.top} kernels (us / step, launches / step, us each, group)"]
    for kname, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:a.top]:
        each = f"{t / c:8.2f}" if c >= 0.5 else f"{'-':>8}"    # (launched in both runs alike)
        lines.append(f"{t:9.1f} {c:7.1f} {each}  {group_of(kname):22} {kname[:110]}")
    text = "\n".join(lines) + "\n"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"profile_{name}_b{a.batch}.txt"), "w") as f:
        f.write(text)
    print(text, flush=True)
    sys.stdout.flush()
    os._exit(0)          # (skip vLLM's shutdown)


if __name__ == "__main__":
    sys.exit(main())
