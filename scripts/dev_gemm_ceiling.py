"""Device dev check for issue 3's target: how fast is a GEMM that does no block scaling at all?

Per point (the large-M benchmark's shapes, M >= 512), three methods on the same fp8 data, each
one CUDA graph cycling through > --min-mb of weight copies (as bench_gemm.py times them):
  fp8linear   block_fp8_gemm (the heuristic's tile),
  deepgemm    DeepGEMM's fp8_gemm_nt (1x128 / 128x128 scales, PDL on, as vLLM calls it),
  tensorwise  cuBLAS's per-tensor FP8 GEMM (torch._scaled_mm with scalar scales): the same
              wgmma work with no per-K-block promotion, no scale loads and one fp32 chain per
              output; its output is checked against A_fp8 . W_fp8^T, the others' against the
              block-scaled reference.
Timed interleaved (one replay of each in turn, median of --replays) and, with --alone S,
each graph replayed alone for S seconds (the power cap charges each its own draw, as in a
model's prefill). DeepGEMM time / tensorwise time is what a block-scaled kernel as fast as
cuBLAS's unscaled GEMM would gain over DeepGEMM at that point.

    python scripts/dev_gemm_ceiling.py --ms 512,1024,2048,4096,8192 --alone 0.5 --out c.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import bench_gemm as B  # noqa: E402
import common as C  # noqa: E402

METHODS = ("fp8linear", "deepgemm", "tensorwise")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--ms", default="512,1024,2048,4096,8192")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--alone", type=float, default=0.0, help="seconds alone per graph (0: off)")
    ap.add_argument("--min-mb", type=float, default=420.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = C.parse_shapes(args.shapes)
    ms = [int(v) for v in args.ms.split(",")]
    libs = B.Libs(["fp8linear", "deepgemm"], probe_cublas=False)
    if "deepgemm" in libs.dropped:
        sys.exit(f"deepgemm: {libs.dropped['deepgemm']}")
    sampler = C.ClockSampler() if args.alone > 0 else None
    one = torch.ones((), dtype=torch.float32, device="cuda")
    rows, bad = [], []
    for n, k in shapes:
        r = C.copies_for(C.fp8_weight_bytes(n, k), args.min_mb * 1e6)
        sd = B.ShapeData(n, k, r, 0, seed=n * 31 + k)
        wq = sd.wq
        for m in ms:
            md = B.MData(sd, m, libs, seed=m)
            launch = {meth: B.make_launch(meth, sd, md, libs) for meth in METHODS[:2]}
            a = md.a
            launch["tensorwise"] = lambda i, a=a: torch._scaled_mm(
                a, wq[i % r].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            ref = B.reference(sd, md)
            ref_tw = a.float() @ wq[0].float().t()
            errs = {}
            for meth, f in launch.items():
                out = f(0)[:m]
                errs[meth] = B.rel_err(out, ref_tw if meth == "tensorwise" else ref)
                # (bf16 output: the tensorwise check allows its rounding, 2^-8 relative)
                if not errs[meth] <= (8e-3 if meth == "tensorwise" else 2e-3):
                    bad.append(f"{meth} {n}x{k} M={m}: rel_err {errs[meth]:.2e}")
            torch.cuda.synchronize()
            L = C.launches_for(r, C.est_us(m, n, k))
            graphs = {meth: C.capture_graph(f, L) for meth, f in launch.items()}
            times = C.time_graphs_interleaved(graphs, args.replays)
            us = {meth: C.median(ts) / L for meth, ts in times.items()}
            alone = {}
            if sampler is not None:
                for meth, g in graphs.items():
                    res = C.replay_alone(g, args.alone, sampler)
                    alone[meth] = dict(res, us=res["us"] / L)
            for meth in METHODS:
                row = {"method": meth, "M": m, "N": n, "K": k, "us": us[meth],
                       "tflops": 2 * m * n * k / us[meth] / 1e6, "rel_err": errs[meth],
                       "launches": L, "copies": r}
                if meth in alone:
                    row.update(us_alone=alone[meth]["us"], clock_mhz=alone[meth]["clock_mhz"],
                               power_w=alone[meth]["power_w"])
                rows.append(row)
            line = f"{C.shape_label(n, k):>12} {m:5d} " + " ".join(
                f"{us[meth]:9.1f}" for meth in METHODS)
            if alone:
                line += "  alone " + " ".join(f"{alone[meth]['us']:9.1f}" for meth in METHODS)
            print(line, flush=True)
            del graphs, md
        del sd
        torch.cuda.empty_cache()
    if sampler is not None:
        sampler.stop()

    def ratios(key):
        out = {}
        for n, k in shapes:
            for m in ms:
                p = {r_["method"]: r_ for r_ in rows if (r_["N"], r_["K"], r_["M"]) == (n, k, m)}
                if all(key in p[meth] for meth in METHODS):
                    out[(n, k, m)] = {meth: p[meth][key] for meth in METHODS}
        return out

    summary = {}
    print(f"\n{'':>12} {'M':>5}  ours/DG  tw/DG   (speedup over DeepGEMM; tw = per-tensor cuBLAS)")
    for key in ("us", "us_alone"):
        pts = ratios(key)
        if not pts:
            continue
        ours = {p: v["deepgemm"] / v["fp8linear"] for p, v in pts.items()}
        tw = {p: v["deepgemm"] / v["tensorwise"] for p, v in pts.items()}
        best = {p: max(ours[p], tw[p]) for p in pts}
        s = {"points": len(pts), "ours_vs_dg": C.geomean(ours.values()),
             "tensorwise_vs_dg": C.geomean(tw.values()),
             "best_known_vs_dg": C.geomean(best.values()),
             "tensorwise_below_1.05": sum(v < 1.05 for v in tw.values()),
             "by_m": {m: {"ours": C.geomean(ours[p] for p in pts if p[2] == m),
                          "tensorwise": C.geomean(tw[p] for p in pts if p[2] == m)}
                      for m in ms}}
        summary[key] = s
        print(f"[{key}] {len(pts)} points: ours {s['ours_vs_dg']:.3f}x DeepGEMM, per-tensor cuBLAS "
              f"{s['tensorwise_vs_dg']:.3f}x, the faster of the two at each point "
              f"{s['best_known_vs_dg']:.3f}x; per-tensor under 1.05x at "
              f"{s['tensorwise_below_1.05']} points")
        for m in ms:
            b = s["by_m"][m]
            print(f"    M={m:5d}: ours {b['ours']:.3f}x  per-tensor {b['tensorwise']:.3f}x")
    if bad:
        print("CHECK FAILED:\n  " + "\n  ".join(bad))
    if args.out:
        header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "date": C.utc_now(), "command": C.command_line(), "git_commit": C.git_commit(),
                  "versions": libs.versions, "summary": summary, "check_failures": bad}
        C.write_json(args.out, header, rows)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
