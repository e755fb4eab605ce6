"""Device dev check: variants of our large-M GEMM (and DeepGEMM) each replayed *alone*, as a
model's prefill runs its GEMMs at the power cap.

An interleaved A/B (dev_variants.py, bench_gemm.py: one replay of each variant in turn) shares
one clock between the variants, so a change that only saves power (fewer spinning warps, fewer
L2 requests) cannot show there: the clock it buys goes to every variant alike. Here each
variant's graph runs alone for --seconds while nvidia-smi samples the SM clock and power; the
variants take turns in --rounds rounds, the order rotating each round (right after a change of
load the power limiter has not settled, so no variant may always go first). Per point: the
median µs over rounds, the median clock and power, each variant against the first and against
DeepGEMM; outputs checked against the fp32 reference and bit-compared with the first variant.

    python scripts/dev_alone_ab.py --shapes 8192x8192,4096x14336 --m 4096,8192 \
        --variants "a:;b:FP8LINEAR_DEV_SO=.prebuilt_b/*/*.so" --seconds 1 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

import bench_gemm as B  # noqa: E402
import common as C  # noqa: E402
import dev_variants as V  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192")
    ap.add_argument("--m", default="4096,8192")
    ap.add_argument("--variants", default="a:")
    ap.add_argument("--no-dg", action="store_true")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-mb", type=float, default=420.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["FP8LINEAR_BACKEND"] = "sm90"
    variants = V.parse_variants(argparse.Namespace(configs=None, variants=args.variants))
    names = list(variants)
    libs = B.Libs(["fp8linear"] + ([] if args.no_dg else ["deepgemm"]), probe_cublas=False)
    sampler = C.ClockSampler()
    rows, bad = [], []
    for n, k in C.parse_shapes(args.shapes):
        r = C.copies_for(C.fp8_weight_bytes(n, k), args.min_mb * 1e6)
        sd = B.ShapeData(n, k, r, 0, seed=n * 31 + k)
        for m in (int(v) for v in args.m.split(",")):
            md = B.MData(sd, m, libs, seed=m)
            ref = B.reference(sd, md)
            L = C.launches_for(r, C.est_us(m, n, k))
            graphs, outs = {}, {}
            for name in names:
                old = V.with_env(variants[name])
                V.use_build(variants[name])
                try:
                    launch = B.make_launch("fp8linear", sd, md, libs)
                    outs[name] = launch(0)
                    torch.cuda.synchronize()
                    err = B.rel_err(outs[name], ref)
                    if not err <= 2e-3:
                        bad.append(f"{name} {n}x{k} M={m}: rel_err {err:.2e}")
                    if not torch.equal(outs[name], outs[names[0]]):
                        bad.append(f"{name} {n}x{k} M={m}: bits differ from {names[0]}")
                    graphs[name] = C.capture_graph(launch, L)
                finally:
                    V.restore(old)
                    V.use_build({})
            if libs.dg is not None and n % 64 == 0 and k % 128 == 0:
                graphs["DG"] = C.capture_graph(B.make_launch("deepgemm", sd, md, libs), L)
            order = list(graphs)
            res = {g: [] for g in order}
            for rnd in range(args.rounds):
                rot = rnd % len(order)
                for g in order[rot:] + order[:rot]:
                    res[g].append(C.replay_alone(graphs[g], args.seconds, sampler))
            row = {"N": n, "K": k, "M": m, "launches": L}
            for g, rs in res.items():
                row[g] = {"us": C.median([x["us"] for x in rs]) / L,
                          "us_rounds": [x["us"] / L for x in rs],
                          "clock_mhz": C.median([x["clock_mhz"] for x in rs]),
                          "power_w": C.median([x["power_w"] for x in rs])}
            rows.append(row)
            print(f"{C.shape_label(n, k):>12} {m:5d} " + "  ".join(
                f"{g} {row[g]['us']:8.1f} us {row[g]['clock_mhz']:5.0f} MHz "
                f"{row[g]['power_w']:4.0f} W" for g in order), flush=True)
            del graphs, outs, md
        del sd
        torch.cuda.empty_cache()
    sampler.stop()
    for g in names[1:] + (["DG"] if rows and "DG" in rows[0] else []):
        rr = [row[names[0]]["us"] / row[g]["us"] for row in rows]
        print(f"{names[0]} time / {g} time: geomean {C.geomean(rr):.3f} min {min(rr):.3f} "
              f"max {max(rr):.3f} over {len(rr)} points (alone)")
    if bad:
        print("CHECK FAILED:\n  " + "\n  ".join(bad))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                           date=C.utc_now(), command=C.command_line(), variants=variants,
                           rows=rows, check_failures=bad), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
