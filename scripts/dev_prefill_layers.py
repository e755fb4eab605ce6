"""Device dev check: the four projections of Llama-3.1-8B-shaped layers (qkv [6144, 4096],
o [4096, 4096], gate_up [28672, 4096], down [4096, 14336]; fp8_linear from bf16, 128x128
weight blocks) at prefill sizes, --layers layers with their own weights (past the L2), as one
CUDA graph replayed *alone* for --seconds per variant while nvidia-smi samples the SM clock and
power. A variant is a set of FP8LINEAR_* overrides, a DEV_NAMESPACE build included (as in
dev_variants.py); the variants take turns in --rounds rounds, the order rotating each round.
Unlike the interleaved A/Bs (one replay of each variant in turn, one shared clock), each variant
here pays its own power draw in clock, as a model's prefill does.

    python scripts/dev_prefill_layers.py --m 4096,8192 \
        --variants "heur:;pairs:FP8LINEAR_SM90_GEMM_CONFIG=5"
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import common as C  # noqa: E402
import fp8linear  # noqa: E402
import dev_variants as V  # noqa: E402
from fp8linear.kernels import heuristics as H  # noqa: E402

PROJ = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="4096,8192")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="heur:")
    args = ap.parse_args()
    variants = V.parse_variants(argparse.Namespace(configs=None, variants=args.variants))

    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(args.layers):
        w = {}
        for name, (n, k) in PROJ.items():
            wb = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
            w[name] = fp8linear.quantize_weight(wb)
            del wb
        layers.append(w)
    flops_layer = {m: sum(2 * m * n * k for n, k in PROJ.values()) for m in map(int, args.m.split(","))}

    sampler = C.ClockSampler()

    for m in map(int, args.m.split(",")):
        x = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
        h = torch.randn(m, 14336, device="cuda", generator=g, dtype=torch.bfloat16)

        def step():
            for w in layers:
                for name in ("qkv", "o", "gate_up"):
                    fp8linear.fp8_linear(x, *w[name])
                fp8linear.fp8_linear(h, *w["down"])

        graphs = {}
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for vname, env in variants.items():
            old = V.with_env(env)
            V.use_build(env)  # (FP8LINEAR_DEV_SO: a DEV_NAMESPACE build, captured into its graph)
            plans = {p: H.sm90_plan(m, n, k, sms) for p, (n, k) in PROJ.items()}
            step()  # warm-up outside the capture
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                step()
            graphs[vname] = gr
            V.restore(old)
            V.use_build({})
            print(f"M={m} {vname}: plans {plans}", flush=True)
        names = list(graphs)
        for rnd in range(args.rounds):
            # the order rotates each round: right after a change of load the power limiter
            # has not settled, and no variant should always run first
            rot = rnd % len(names)
            for vname in names[rot:] + names[:rot]:
                gr = graphs[vname]
                r = C.replay_alone(gr, args.seconds, sampler)
                us = r["us"] / args.layers
                tf = flops_layer[m] / us / 1e6
                print(f"M={m:<5d} round {rnd} {vname:>8}: {us:9.1f} us a layer  {tf:6.0f} TFLOPS  "
                      f"SM {r['clock_mhz']:5.0f} MHz  {r['power_w']:4.0f} W  ({r['samples']} samples)",
                      flush=True)
        del graphs
    sampler.stop()


if __name__ == "__main__":
    main()
