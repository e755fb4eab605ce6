"""Quick timing of the Triton backend against torch bf16 F.linear, to catch gross performance
problems in the same device call as the tests (the full comparison with vLLM's kernel,
DeepGEMM and cuBLASLt lives in bench_gemm.py).

Each method is captured in a CUDA graph of many launches that cycle through copies of the
weight totalling > 2x the 50 MB L2, so every launch reads its weight from HBM; the time per
launch is the replay time / launches, median over replays.

    python benchmarks/bench_triton_quick.py                 # the table
    python benchmarks/bench_triton_quick.py --sweep --shapes 4096x4096 --m 1,16
                                                            # also time other tile configs
                                                            # (~1 min per shape and M)
    python benchmarks/bench_triton_quick.py --json out.json

Methods: triton_gemm (pre-quantized fp8 activations), triton_linear (bf16 in, quantization
fused for M <= 32, separate kernel above), weight_only (the Ampere mode, forced), bf16
(torch.matmul into a preallocated bf16 output: cuBLAS, what F.linear runs). Speedups are against bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import fp8linear
from fp8linear import knobs
from fp8linear.backends.triton import gemm as tg

SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336), (2112, 7168)]
MS = [1, 16, 128, 4096]
ROTATE_BYTES = 128 << 20     # > 2x the H100's 50 MB L2


def _graph_time_us(launch, copies: int, replays: int) -> float:
    """Median µs per launch of a graph that calls launch(i) for i over the weight copies."""
    per_graph = copies * max(1, 24 // copies)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(2, per_graph)):
            launch(i % copies)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(per_graph):
            launch(i % copies)
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / per_graph)
    del g
    return statistics.median(times)


def _weights(n, k, copies, dev):
    ws = []
    for c in range(copies):
        w = torch.randn(n, k, device=dev) * 0.02
        ws.append(fp8linear.quantize_weight(w))
    return ws


def _rel_err(got, want):
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def bench_shape(m, n, k, replays, dev, sweep=False):
    row = {"m": m, "n": n, "k": k}
    fp8_copies = max(1, -(-ROTATE_BYTES // (n * k)))
    bf16_copies = max(1, -(-ROTATE_BYTES // (2 * n * k)))
    weights = _weights(n, k, fp8_copies, dev)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    a, a_s = fp8linear.quantize_activation(x)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)

    # correctness spot check first: timing a wrong kernel is worthless
    w0, s0 = weights[0]
    tg.gemm(a, a_s, w0, s0, None, out)
    err = _rel_err(out, fp8linear.reference_gemm(a, a_s, w0, s0, out_dtype=torch.float32))
    row["rel_err"] = err
    if err > 2e-3:
        print(f"  WARNING m={m} n={n} k={k}: triton gemm relative error {err:.2e}")

    row["triton_gemm"] = _graph_time_us(
        lambda i: tg.gemm(a, a_s, weights[i][0], weights[i][1], None, out), fp8_copies, replays)
    row["triton_linear"] = _graph_time_us(
        lambda i: tg.linear(x, weights[i][0], weights[i][1], None, out), fp8_copies, replays)
    os.environ["FP8LINEAR_TRITON_MODE"] = "weight_only"
    knobs.reload()  # fp8linear reads its knobs once per process otherwise
    try:
        row["weight_only"] = _graph_time_us(
            lambda i: tg.linear(x, weights[i][0], weights[i][1], None, out), fp8_copies,
            replays)
    finally:
        os.environ.pop("FP8LINEAR_TRITON_MODE", None)
        knobs.reload()
    wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(bf16_copies)]
    row["bf16"] = _graph_time_us(lambda i: torch.matmul(x, wb[i].t(), out=out), bf16_copies,
                                 replays)
    plan = tg._plan("cuda", dev.index or 0, m, n, k, 1, False)
    row["config"] = f"{plan.cfg.bm}x{plan.cfg.bn} w{plan.cfg.warps} s{plan.cfg.stages} " \
                    f"split{plan.split}"
    if sweep:
        row["sweep"] = sweep_configs(m, n, k, replays, dev, a, a_s, out)
    return row


def _candidates(m):
    """Tile shapes no taller than needed, two stage depths, split-K only for small M."""
    out = []
    for bm in (b for b in (16, 32, 64, 128) if b <= max(16, 2 * m)):
        for bn in (64, 128):
            warps = 8 if bm * bn >= 128 * 128 else 4
            for stages in ((3, 5) if bm * bn < 128 * 128 else (3, 4)):
                for split in ((1, 2, 4, 8) if m <= 128 else (1,)):
                    out.append(tg.Config(bm, bn, warps, stages, split))
    return out


def sweep_configs(m, n, k, replays, dev, a, a_s, out):
    """Times other tile configs for this shape (pre-quantized gemm); prints the best few."""
    copies = max(1, -(-ROTATE_BYTES // (n * k)))
    weights = _weights(n, k, copies, dev)
    results = []
    for cfg in _candidates(m):
        try:
            t = _graph_time_us(lambda i: tg.gemm(a, a_s, weights[i][0], weights[i][1], None,
                                                 out, config=cfg), copies, max(5, replays // 2))
        except Exception as e:  # e.g. out of shared memory for this config
            print(f"    {cfg}: failed ({type(e).__name__})")
            continue
        results.append((t, cfg))
    results.sort(key=lambda r: r[0])
    for t, cfg in results[:3]:
        print(f"    sweep m={m} n={n} k={k}: {t:8.2f} us  {cfg}")
    return [{"us": t, "cfg": list(c)} for t, c in results[:5]]


def eager_overhead_us(dev, calls=200):
    """Host time per eager call of fp8_linear at M=1 (custom models run eagerly)."""
    n = k = 4096
    w, s = fp8linear.quantize_weight(torch.randn(n, k, device=dev))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    for _ in range(5):
        fp8linear.fp8_linear(x, w, s)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fp8linear.fp8_linear(x, w, s)
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    total = (time.perf_counter() - t) / calls * 1e6
    return host, total


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--m", default=",".join(map(str, MS)), help="comma-separated M values")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                   help="comma-separated NxK")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    os.environ["FP8LINEAR_BACKEND"] = "triton"
    dev = torch.device("cuda", torch.cuda.current_device())
    ms = [int(v) for v in args.m.split(",")]
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    print(f"device: {torch.cuda.get_device_name(dev)}  triton mode: {tg.mode(dev)}")
    host, total = eager_overhead_us(dev)
    print(f"eager fp8_linear M=1 4096x4096: {host:.1f} us host time per call, "
          f"{total:.1f} us per call incl. GPU\n")

    hdr = (f"{'M':>5} {'N':>6} {'K':>6} | {'gemm':>8} {'linear':>8} {'w-only':>8} {'bf16':>8} |"
           f" {'gemm/bf16':>9} {'lin/bf16':>8} | {'TFLOP/s':>7} {'GB/s':>6} | config")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for n, k in shapes:
        for m in ms:
            r = bench_shape(m, n, k, args.replays, dev, sweep=args.sweep)
            rows.append(r)
            t = r["triton_gemm"]
            tflops = 2 * m * n * k / t / 1e6
            gbs = (n * k + m * k + 2 * m * n) / t / 1e3
            print(f"{m:>5} {n:>6} {k:>6} | {t:8.2f} {r['triton_linear']:8.2f} "
                  f"{r['weight_only']:8.2f} {r['bf16']:8.2f} | {r['bf16'] / t:9.2f} "
                  f"{r['bf16'] / r['triton_linear']:8.2f} | {tflops:7.1f} {gbs:6.0f} | "
                  f"{r['config']}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(dev),
                                               "eager_us": [host, total], "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
