"""Device probe: how close a pure read of B bytes gets to the weight-read floor, back to back.

The decode benchmarks' floor is weight bytes / the read bandwidth of one reduction over 2 GiB,
where launch, ramp-up and tail are negligible. A decode GEMM reads 7-30 MB; this times
torch's own single-pass reductions (sum, amax) over buffers of exactly those sizes the way
bench_gemm.py times a GEMM: a CUDA graph of L launches cycling R copies (> 420 MB, past the
50 MB L2), median over replays. What they reach is a practical ceiling for any kernel that
reads B bytes once and launches back to back without PDL.

    python scripts/dev_read_floor_probe.py [--mb 15.1,16.8,25.2,29.4]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import common as C  # noqa: E402

# weight bytes (N * K) of the decode benchmark's shapes
SHAPES = {"2112x7168": 2112 * 7168, "7168x2048": 7168 * 2048, "4096x4096": 4096 * 4096,
          "32768x512": 32768 * 512, "6144x4096": 6144 * 4096, "4096x7168": 4096 * 7168,
          "24576x1536": 24576 * 1536, "4096x14336": 4096 * 14336,
          "8192x8192": 8192 * 8192, "10240x8192": 10240 * 8192}


def time_reads(nbytes: int, op, min_total: float = 420e6, replays: int = 30) -> float:
    """us per launch of op over an nbytes fp32 buffer: one graph of a launch per copy, copies
    past min_total bytes, timed with the benchmark's own helpers (benchmarks/common.py)."""
    n = nbytes // 4
    copies = max(2, C.copies_for(nbytes, min_total))
    bufs = [torch.empty(n, dtype=torch.float32, device="cuda").uniform_(-1, 1)
            for _ in range(copies)]
    out = torch.empty((), dtype=torch.float32, device="cuda")
    g = C.capture_graph(lambda i: op(bufs[i], out=out), copies, warmup_calls=copies)
    us = C.median(C.time_graphs_interleaved({"read": g}, replays)["read"]) / copies
    del g, bufs
    torch.cuda.empty_cache()
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="", help="extra sizes in MB (comma list)")
    args = ap.parse_args()
    sizes = dict(SHAPES)
    for v in filter(None, args.mb.split(",")):
        sizes[f"{v} MB"] = int(float(v) * 1e6)
    bw = C.measure_read_bandwidth()
    gbps = bw["read_bw_gbps"]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; read bandwidth "
          f"{gbps:.0f} GB/s ({bw['read_bw_op']} over {bw['read_bw_bytes'] / 2**30:.0f} GiB)")
    print(f"{'size':>12} {'MB':>7} {'floor us':>9} {'sum us':>8} {'%floor':>7} "
          f"{'amax us':>8} {'%floor':>7}")
    ops = {"sum": lambda b, out: torch.sum(b, dim=0, out=out),
           "amax": lambda b, out: torch.amax(b, dim=0, out=out)}
    for name, nbytes in sizes.items():
        nbytes -= nbytes % 4
        floor = nbytes / (gbps * 1e3)
        res = {k: time_reads(nbytes, op) for k, op in ops.items()}
        print(f"{name:>12} {nbytes / 1e6:7.1f} {floor:9.2f} {res['sum']:8.2f} "
              f"{100 * floor / res['sum']:6.1f}% {res['amax']:8.2f} "
              f"{100 * floor / res['amax']:6.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
