"""Does fp8_linear's hop (its time over block_fp8_gemm's, after an elementwise kernel) depend on
which other graphs are replayed between ours? Session 29 found bench_gemm's elem-mode hop at a
median of 0.54 us with only our two methods interleaved and 1.09 us with cuBLASLt and cuBLAS bf16
in the interleave (b2b: the same either way). Here the same captured graphs (so the same memory
addresses) are timed in rounds that alternate: ours only, ours with the anchors replayed between
them, each anchor alone between them, and a 256 MB write / read between them (the L2 scrubbed). A
difference between contexts is a replay-order effect (state left behind by the other graphs:
L2 contents, clocks), not an allocation one. The SM clock is read after each context's replays
(clock64 over globaltimer); --launches-x scales the launches a graph holds (an excess paid once
a replay shrinks with it). Results: results/2026-11-26_hop_context_h100.log.

  python scripts/dev_hop_context.py --shapes 10240x8192,4096x4096 --m 1,8,16
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import bench_gemm as B  # noqa: E402
import common as C  # noqa: E402

ANCHORS = ("cublaslt_blockwise", "bf16")


@triton.jit
def _clock_probe(out_ptr, iters):
    """One program: SM clock ticks and nanoseconds over a dependent FMA chain (-> MHz)."""
    z = tl.program_id(0)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [z], dtype=tl.int64,
                                   is_pure=False, pack=1)
    c0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [z], dtype=tl.int64,
                                   is_pure=False, pack=1)
    x = z.to(tl.float32) + 1.0
    for _ in range(iters):
        x = x * 1.0000001 + 1e-7
    c1 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,f", [x], dtype=tl.int64,
                                   is_pure=False, pack=1)
    t1 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,f", [x], dtype=tl.int64,
                                   is_pure=False, pack=1)
    tl.store(out_ptr + 0, c1 - c0)
    tl.store(out_ptr + 1, t1 - t0)
    tl.store(out_ptr + 2, x.to(tl.int64))


@triton.jit
def _empty_kernel(out_ptr):
    """Nothing but a launch (one store by one program, so that it is not compiled away)."""
    if tl.program_id(0) == 1 << 30:
        tl.store(out_ptr, 0)


class ClockProbe:
    """A graph of one clock-probe launch; read() is the SM clock of its last replay."""

    def __init__(self, iters=20000):
        self.buf = torch.zeros(3, dtype=torch.int64, device="cuda")
        _clock_probe[(1,)](self.buf, iters)  # (compiled outside the capture)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            _clock_probe[(1,)](self.buf, iters)

    def read(self) -> float:
        torch.cuda.synchronize()
        ticks, ns = (int(v) for v in self.buf[:2].tolist())
        return ticks / max(ns, 1) * 1e3


def measure(sd, md, libs, anchors, scrub, clock, L, args) -> dict:
    """{context: (block_fp8_gemm us, fp8_linear us, SM MHz after it, quant kernel us, empty kernel
    us)} with graphs of L launches each, the neighbour-only graph's time subtracted (the last
    two NaN without --quant)."""
    scrub_f, sink = scrub.view(torch.float32), torch.empty((), device="cuda")
    between = None if args.mode == "b2b" else md.neighbour(args.mode)
    graphs = {meth: C.capture_graph(B.make_launch(meth, sd, md, libs), L, between=between)
              for meth in ("fp8linear", "fp8linear_linear", *anchors)}
    if args.quant:  # fp8_linear's first kernel alone: the quant kernel on the same input
        from fp8linear.kernels import build
        ext, x = build.load(), md.x
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
        st = torch.empty(-(-x.shape[1] // 128), -(-x.shape[0] // 4) * 4, device="cuda")
        graphs["_quant"] = C.capture_graph(lambda i: ext.quant(x, q, st, True), L,
                                           between=between)
        # an empty kernel of the quant kernel's grid (8 groups a 256-thread CTA) in its place
        ctas, dummy = -(-x.shape[0] * -(-x.shape[1] // 128) // 8), torch.empty(1, device="cuda")
        graphs["_empty"] = C.capture_graph(lambda i: _empty_kernel[(ctas,)](dummy, num_warps=8),
                                           L, between=between)
    if between is not None:
        graphs["_elem"] = C.capture_graph(lambda i: None, L, between=between)
    ours = {g: v for g, v in graphs.items() if g not in anchors}
    # (a 256 MB write between ours leaves the L2 full of dirty lines; a 256 MB read, of clean
    # ones, as the anchors' weight reads do)
    flush = C.capture_graph(lambda i: scrub.zero_(), 1)
    read = C.capture_graph(lambda i: torch.sum(scrub_f, dim=0, out=sink), 1)
    contexts = {"ours": ours, "anchors": graphs, "flush": {**ours, "_flush": flush},
                "read": {**ours, "_read": read},
                **{a: {**ours, a: graphs[a]} for a in anchors}}
    got: dict = {ctx: {} for ctx in contexts}
    mhz: dict = {ctx: [] for ctx in contexts}
    for _ in range(args.rounds):
        for ctx, gs in contexts.items():
            for g, ts in C.time_graphs_interleaved(gs, args.replays).items():
                got[ctx].setdefault(g, []).extend(v / L for v in ts)
            # the SM clock right after the context's last replay
            clock.graph.replay()
            mhz[ctx].append(clock.read())
    res = {}
    for ctx in contexts:
        us = {g: C.median(v) for g, v in got[ctx].items()}
        e = us.get("_elem", 0.0)
        res[ctx] = (us["fp8linear"] - e, us["fp8linear_linear"] - e, C.median(mhz[ctx]),
                    us["_quant"] - e if "_quant" in us else float("nan"),
                    us["_empty"] - e if "_empty" in us else float("nan"))
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="10240x8192,8192x8192,4096x4096,2112x7168")
    p.add_argument("--m", default="1,8,16")
    p.add_argument("--mode", default="elem", help="b2b or a neighbour.KINDS kind")
    p.add_argument("--rounds", type=int, default=4, help="rounds over all the contexts")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--quant", action="store_true",
                   help="also time the quant kernel alone (its graph, with the same neighbour), "
                        "and an empty kernel of its grid")
    p.add_argument("--launches-x", default="1",
                   help="comma list of multipliers of the launches a graph holds (the benchmark's "
                        "count x each): an excess paid once a replay shrinks as 1 / launches")
    args = p.parse_args()
    os.environ["FP8LINEAR_BACKEND"] = "sm90"
    libs = B.Libs(["fp8linear", "fp8linear_linear", *ANCHORS])
    anchors = [a for a in ANCHORS if a not in libs.dropped]
    print(f"anchors {anchors}; dropped {libs.dropped}", flush=True)
    print(f"{'shape':>12} {'M':>3} {'context':>22} {'gemm':>7} {'linear':>7} {'hop':>6} "
          f"{'SM MHz':>6} {'quant':>6} {'empty':>6}", flush=True)
    hops: dict = {}
    scrub = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    clock = ClockProbe()
    for n, k in C.parse_shapes(args.shapes):
        copies = max(2, C.copies_for(n * k, 400e6))
        sd = B.ShapeData(n, k, copies, max(2, C.copies_for(2 * n * k, 400e6)), seed=n + k)
        for m in (int(v) for v in args.m.split(",")):
            md = B.MData(sd, m, libs, seed=m)
            for lx in (int(v) for v in args.launches_x.split(",")):
                L = lx * max(2, C.launches_for(copies, C.est_us(m, n, k)))
                got = measure(sd, md, libs, anchors, scrub, clock, L, args)
                for ctx, (g, lin, mhz, qu, em) in got.items():
                    hops.setdefault(f"{ctx} L x{lx}", []).append(lin - g)
                    print(f"{n:>6}x{k:<5} {m:>3} {ctx + ' L x' + str(lx):>22} {g:7.2f} "
                          f"{lin:7.2f} {lin - g:6.2f} {mhz:6.0f} {qu:6.2f} {em:6.2f}", flush=True)
            del md
        del sd
        torch.cuda.empty_cache()
    for ctx, h in hops.items():
        h = sorted(h)
        if h:
            print(f"{ctx}: hop median {h[len(h) // 2]:.2f} us, over 1 us at "
                  f"{sum(v > 1 for v in h)} of {len(h)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
