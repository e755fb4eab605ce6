"""Where a vLLM decode step's GPU time goes: kernels of one engine at one or more batch
sizes, per decode step, under torch.profiler (a diagnosis tool, not a timing benchmark).

    python benchmarks/vllm_profile.py --model /tmp/e2e_vllm/fp8 --quantization fp8_blockgemm \
        --batch 4,64 --out DIR

Runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the profiler sees its
kernels, CUDA-graph replays included), with e2e_vllm.py's engine settings (`llm_kwargs`; the
same `--compile`). For each batch size, two profiled generates of the same prompts, 1 and
1 + STEPS new tokens: the difference of their kernel times / STEPS is the GPU time per decode
step, per kernel name, and the difference of their wall times (unprofiled, best of two) /
STEPS the step's wall time. A kernel's duration includes its wait at griddepcontrol.wait when
it was launched under PDL (ours are), so durations overlap; each kernel's *exposed* time (its
end past the latest end of the kernels that started before it) does not: the exposed times
and the idle gaps between kernels add up to the step. Writes
<out>/profile_<name>_b<batch>.txt (groups and kernels by exposed time) and prints each.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

# (before vLLM is imported: the engine core in this process, so its kernels are profiled)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# kernel name -> group, first match wins (names as CUPTI reports them)
GROUPS = [
    ("attention", r"flash|fmha|attn|attention|reshape_and_cache"),
    # (the kernels' kGrouped template argument: the decode kernel's 8th, the GEMM's 11th)
    ("fp8linear MoE GEMM",
     r"fp8_decode_kernel<(?:[^,<>]+, ){7}true|fp8_gemm_kernel<(?:[^,<>]+, ){10}true"),
    ("fp8linear MoE stages", r"^_(route\w*|gather_quant|combine|fill_padding)_kernel"),
    ("fp8linear gemm", r"fp8l::fp8_gemm|fp8l::.*decode"),
    ("fp8linear fused quant", r"_norm_quant_kernel|_silu_mul_quant_kernel"),
    ("fp8linear quant", r"fp8l::.*quant|^_quant_kernel"),
    ("vLLM MoE", r"fused_moe|moe_align|moe_sum|topk_?gating|count_and_sort|expert"),
    ("deepgemm", r"deep_gemm"),
    ("vLLM fused quant", r"rms_norm.*quant|silu_and_mul.*quant"),
    ("vLLM quant", r"per_token_group|quant"),
    ("cutlass / cublas (lm_head)", r"cutlass|cublas|gemm|gemv|nvjet|xmma"),
    ("inductor (triton)", r"^triton_"),
    ("sampling / logits", r"sort|topk|softmax|argmax|sample|scatter|gather"),
]
IDLE = "(idle: no kernel running)"


def group_of(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name, re.I):
            return g
    return "other"


def kernel_times(kernels) -> dict:
    """name -> [duration us, exposed us, count] over ``kernels`` (name, start us, end us);
    the idle time between kernels under IDLE. Exposed: a kernel's end past the latest end
    of the kernels that started before it (0 when it ends under one)."""
    out = {IDLE: [0.0, 0.0, 0]}
    latest = None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        row = out.setdefault(name, [0.0, 0.0, 0])
        row[0] += end - start
        row[2] += 1
        if latest is None:
            row[1] += end - start
        else:
            row[1] += max(0.0, end - max(latest, start))
            out[IDLE][1] += max(0.0, start - latest)
        latest = end if latest is None else max(latest, end)
    return out


def per_step(short: dict, long: dict, steps: int) -> dict:
    """name -> (duration, exposed, launches) per decode step: the difference of a profile of
    1 + ``steps`` new tokens and one of 1, / ``steps`` (names whose time did not grow left out)."""
    per = {}
    for name in set(short) | set(long):
        a, b = short.get(name, (0.0, 0.0, 0)), long.get(name, (0.0, 0.0, 0))
        d = [(y - x) / steps for x, y in zip(a, b)]
        if max(d[0], d[1]) > 0.05:
            per[name] = tuple(d)
    return per


def report(per: dict, title: str, step_wall: float, top: int) -> str:
    """The profile's text: the step, its groups and its ``top`` kernels by exposed time."""
    busy = sum(e for n, (_, e, _) in per.items() if n != IDLE)
    idle = per.get(IDLE, (0.0, 0.0, 0))[1]
    lines = [title, f"step wall {step_wall:.0f} us: kernels exposed {busy:.0f} us, idle between "
             f"kernels {idle:.0f} us (the rest: between the profiled steps)", "",
             "## by group (exposed us / step, duration us / step, kernels / step)"]
    groups = {}
    for name, (t, e, c) in per.items():
        g = groups.setdefault(IDLE if name == IDLE else group_of(name), [0.0, 0.0, 0.0])
        g[0], g[1], g[2] = g[0] + e, g[1] + t, g[2] + c
    for g, (e, t, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{e:9.1f} {t:9.1f} {c:7.1f}  {g}")
    lines += ["", f"## top {top} kernels (exposed us / step, duration us / step, launches / "
              "step, exposed us each, group)"]
    kernels = sorted(((n, v) for n, v in per.items() if n != IDLE), key=lambda kv: -kv[1][1])
    for name, (t, e, c) in kernels[:top]:
        each = f"{e / c:8.2f}" if c >= 0.5 else f"{'-':>8}"    # (launched in both runs alike)
        lines.append(f"{e:9.1f} {t:9.1f} {c:7.1f} {each}  {group_of(name):26} {name[:100]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--name", default=None, help="label (default: the quantization)")
    ap.add_argument("--batch", default="64", help="batch sizes, comma-separated")
    ap.add_argument("--compile", default="none", choices=("none", "vllm"),
                    help="as e2e_vllm.py's --compile")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=".")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=128000, help="prompt token ids below this")
    a = ap.parse_args(argv)
    name = a.name or a.quantization or "bf16"
    batches = [int(b) for b in a.batch.split(",")]

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    from e2e_vllm import llm_kwargs, prompts

    llm = LLM(**llm_kwargs({
        "model": a.model, "quantization": a.quantization, "batches": sorted({1, *batches}),
        "compile": a.compile, "gpu_memory_utilization": 0.35, "prompt_len": a.prompt_len,
        "max_model_len": a.prompt_len + a.steps + 64}))
    cuda = torch.cuda.is_available()

    def gen(ps, n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    dev = torch.cuda.get_device_name() if cuda else "CPU (no kernels profiled)"
    os.makedirs(a.out, exist_ok=True)
    for batch in batches:
        ps = prompts(batch, a.prompt_len, seed=7, vocab=a.vocab)
        counts = (1, 1 + a.steps)
        for n in counts:                    # warm-up (graphs, allocator)
            gen(ps, n)
        walls = {n: min(gen(ps, n), gen(ps, n)) for n in counts}  # unprofiled, best of two
        times = {}
        for n in counts:
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) \
                    as prof:
                gen(ps, n)
            times[n] = kernel_times((e.name, e.time_range.start, e.time_range.end)
                                    for e in prof.events() if e.device_type.name == "CUDA")
        per = per_step(times[1], times[1 + a.steps], a.steps)
        title = (f"# {name} at batch {batch}: {dev}, torch {torch.__version__}, compile "
                 f"{a.compile}; per decode step (difference of {1 + a.steps} and 1 new "
                 f"tokens, / {a.steps})")
        text = report(per, title, (walls[1 + a.steps] - walls[1]) / a.steps * 1e6, a.top)
        with open(os.path.join(a.out, f"profile_{name}_b{batch}.txt"), "w") as f:
            f.write(text)
        print(text, flush=True)
    sys.stdout.flush()
    os._exit(0)          # (skip vLLM's shutdown)


if __name__ == "__main__":
    sys.exit(main())
