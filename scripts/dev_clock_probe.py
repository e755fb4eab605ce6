"""Device dev check: do our large-M GEMM and DeepGEMM run at the same SM clock and power?
Each method's CUDA graph (weights rotated past L2) is replayed for --seconds while
nvidia-smi samples clocks.sm / power.draw every 20 ms; prints per method: us per GEMM,
TFLOPS, median SM clock (MHz), median power (W), and TFLOPS per GHz (work per clock).
Methods run in turn, twice, so a drift shows up.

    python scripts/dev_clock_probe.py --shapes 8192x8192 --m 4096
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import bench_gemm as B  # noqa: E402
import common as C  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192")
    ap.add_argument("--m", default="4096")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--methods", default="fp8linear,deepgemm,cublaslt_blockwise")
    args = ap.parse_args()
    methods = args.methods.split(",")
    libs = B.Libs(methods, probe_cublas="cublaslt_blockwise" in methods)
    methods = [m for m in methods if m not in libs.dropped]
    for m_, why in libs.dropped.items():
        print(f"# dropped {m_}: {why}")
    sampler = C.ClockSampler()

    rows = []
    for spec in args.shapes.split(","):
        n, k = (int(v) for v in spec.split("x"))
        copies = max(2, C.copies_for(n * k, 400e6))
        sd = B.ShapeData(n, k, copies, 0, seed=n * 31 + k)
        for m in (int(v) for v in args.m.split(",")):
            md = B.MData(sd, m, libs, seed=m)
            launches = max(2, C.launches_for(copies, C.est_us(m, n, k), target_us=20000))
            graphs = {meth: C.capture_graph(B.make_launch(meth, sd, md, libs), launches)
                      for meth in methods}
            for rep in range(2):
                for meth, g in graphs.items():
                    r = C.replay_alone(g, args.seconds, sampler)
                    us, clk, pw = r["us"] / launches, r["clock_mhz"], r["power_w"]
                    tf = 2 * m * n * k / us / 1e6
                    rows.append(f"{spec:>11} M={m:<5d} rep {rep} {meth:>18}: {us:8.1f} us "
                                f"{tf:6.0f} TFLOPS  SM {clk:5.0f} MHz  {pw:5.0f} W  "
                                f"{tf / (clk / 1000):6.0f} TFLOPS/GHz  ({r['samples']} samples)")
                    print(rows[-1], flush=True)
            del graphs
    sampler.stop()


if __name__ == "__main__":
    main()
