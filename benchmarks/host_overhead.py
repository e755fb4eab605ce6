#!/usr/bin/env python3
"""Where an eager FP8Linear call spends its host time, layer by layer (GPU machine).

Eager models (no CUDA graph) are host-bound at decode: every layer's Python, argument
checks, allocations, pybind conversion, tensor-map encoding and kernel launch run on the CPU
while the GPU waits. This times, per call, the host enqueue time of each layer of the call
path on its own (loops of `--calls` calls between two synchronizes, best of 5), from the
module down to the extension call, next to torch references (bf16 F.linear, torch.empty,
an elementwise op), then prints cProfile's top entries for the module call. The loops are
short (`--calls`, default 200: a few hundred launches) so that the host never waits for a
full launch queue, which would time the GPU instead.

    python benchmarks/host_overhead.py [--m 1,16] [--nk 4096x4096] [--json out.json]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import torch

import fp8linear
from fp8linear.backends.sm90 import backend as sm90, launch, library


def host_us(fn, calls: int, loops: int = 20) -> float:
    """Host time per call of fn, best of `loops` loops of `calls` calls, each loop started
    on an idle GPU."""
    best = float("inf")
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return best * 1e6


def layers(m: int, n: int, k: int):
    """(name, fn) from the outermost layer (the module) to the extension call alone."""
    dev = torch.device("cuda")
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    mod = fp8linear.FP8Linear.from_linear(lin)
    w, ws = mod.weight, mod.weight_scale_inv
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    lp = launch.decide(m, n, k, x.dtype, 0, True)  # the dispatcher's own decision, once
    plan, fused = lp.plan, lp.fused
    rows = [
        ("FP8Linear.forward", lambda: mod(x)),
        ("fp8linear.fp8_linear", lambda: fp8linear.fp8_linear(x, w, ws)),
        ("sm90.linear (no checks, out given)", lambda: sm90.linear(x, w, ws, None, out)),
        ("sm90.linear (no checks, fresh out)", lambda: sm90.linear(
            x, w, ws, None, torch.empty(m, n, device=dev, dtype=torch.bfloat16))),
    ]
    if plan.kind == "decode" and fused:
        ext = library.load()
        rows.append(("library decode() alone", lambda: ext.decode(
            x, None, w, ws, False, None, out, lp.ws_floats, lp.tiles, plan.config, plan.rows,
            plan.splits, plan.ctas_per_sm, lp.pdl, lp.early, False)))
    rows += [
        ("ref: bf16 nn.Linear", lambda: lin(x)),
        ("ref: torch.empty", lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16)),
        ("ref: x.add_(0)", lambda: x.add_(0)),
    ]
    return rows, mod, x, f"{plan}{' fused quant' if fused else ''}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="1,16")
    p.add_argument("--nk", default="4096x4096")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead: needs a CUDA device", file=sys.stderr)
        return 2
    n, k = (int(v) for v in a.nk.split("x"))
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join(sys.argv), "rows": []}
    with torch.no_grad():
        for m in (int(v) for v in a.m.split(",")):
            rows, mod, x, plan = layers(m, n, k)
            print(f"M={m} {n}x{k}: {plan}")
            for name, fn in rows:
                for _ in range(50):
                    fn()
                us = host_us(fn, a.calls)
                result["rows"].append({"M": m, "N": n, "K": k, "layer": name, "host_us": us})
                print(f"  {name:40s} {us:7.2f} us")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                mod(x)
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
            print("\n".join(s.getvalue().splitlines()[-16:]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
