"""Device dev check: kernel variants of our sm90 path side by side with DeepGEMM, one run.

A variant is a set of FP8LINEAR_* environment overrides (e.g. a forced large-M tile config,
or the decode kernel's CTAs per SM). For each (N, K, M) and variant: the relative error
against the fp32 reference of the dequantized inputs (and a NaN-poisoned output), then the
time of every variant and DeepGEMM (CUDA graphs, weights rotated past L2, interleaved
replays; --elem puts an RMSNorm-sized elementwise kernel between GEMMs and subtracts it,
--between norm_pdl a Triton RMSNorm launched with PDL as torch Inductor's).
Prints one row per point: µs per variant, DeepGEMM's, the fastest variant, vs DeepGEMM.

    python scripts/dev_variants.py --configs 0,2,3            # large-M tile configs
    python scripts/dev_variants.py --m 1,4,16 --variants "c1:FP8LINEAR_SM90_DECODE_CTAS=1;c2:FP8LINEAR_SM90_DECODE_CTAS=2"
    (--linear times fp8_linear from bf16 instead of block_fp8_gemm)

A/B of two builds of the kernels in one process (run-to-run drift on the device is several
percent, larger than many kernel changes): build the other source tree with
`DEV_NAMESPACE=fp8l_b scripts/prebuild_device_ext.sh <repo>/.prebuilt_b` from a copy of the
repository holding the change (the script keeps that folder out of git; it empties its output
folder first, so never point it into .prebuilt), carry both folders, and name its .so in a
variant (a glob is fine). DEV_NAMESPACE builds it as its own module (fp8linear_sm90_C_b):
a second build under the default module name is not loaded at all, Python hands back the
first module (found 2026-11-24; every A/B of builds before that compared a build with
itself), so variants under the default name are refused:
    python scripts/dev_variants.py --variants "a:;b:FP8LINEAR_DEV_SO=.prebuilt_b/*/*.so"
The variant's launches are captured in its own CUDA graphs, so each graph runs its build.
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
import fp8linear  # noqa: E402


def parse_variants(args) -> dict[str, dict[str, str]]:
    out = {}
    if args.configs:
        for c in args.configs.split(","):
            out[f"c{c}"] = {"FP8LINEAR_SM90_GEMM_CONFIG": c}
    for spec in filter(None, (args.variants or "").split(";")):
        name, _, assigns = spec.partition(":")
        out[name] = dict(a.split("=", 1) for a in assigns.split(",") if a)
    return out or {"default": {}}


_DEV_SO = "FP8LINEAR_DEV_SO"
_loaded_so: dict = {}


def use_build(env: dict):
    """Points fp8linear at the extension build the variant names (FP8LINEAR_DEV_SO), or
    back at the default one; each .so is loaded once (as its own module object)."""
    import glob
    from fp8linear.kernels import build
    if "default" not in _loaded_so:
        _loaded_so["default"] = build.load()
    spec = env.get(_DEV_SO)
    if not spec:
        build._module = _loaded_so["default"]
        return
    paths = sorted(glob.glob(spec))
    if len(paths) != 1:
        raise SystemExit(f"{_DEV_SO}={spec!r} matches {len(paths)} files, expected one")
    if paths[0] not in _loaded_so:
        from pathlib import Path
        name = Path(paths[0]).stem
        if name == build.EXT_NAME:
            raise SystemExit(f"{paths[0]}: built under the default module name; rebuild it "
                             "with DEV_NAMESPACE=fp8l_b scripts/prebuild_device_ext.sh <out>")
        _loaded_so[paths[0]] = build._import(Path(paths[0]), name)
        print(f"variant build: {paths[0]}", flush=True)
    build._module = _loaded_so[paths[0]]


def with_env(env: dict):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fp8linear.kernels.heuristics.reload_env()  # knobs are read once per process otherwise
    return old


def restore(old: dict):
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    fp8linear.kernels.heuristics.reload_env()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="quick")
    p.add_argument("--m", default="512,1024,2048,4096,8192")
    p.add_argument("--configs", default=None, help="large-M configs to force, e.g. 0,2,3")
    p.add_argument("--variants", default=None, help="name:ENV=V,ENV=V;name:...")
    p.add_argument("--linear", action="store_true", help="time fp8_linear (bf16 in)")
    p.add_argument("--with-gemm", action="store_true",
                   help="(--linear) also block_fp8_gemm (no variant's env), interleaved: "
                        "each variant's hop, fp8_linear's time over the GEMM's")
    p.add_argument("--elem", action="store_true", help="elementwise kernel between GEMMs")
    p.add_argument("--between", default=None,
                   help="the kernel between GEMMs: one of benchmarks/neighbour.py's KINDS "
                        "(elem = --elem, norm, norm_pdl: a Triton RMSNorm without / with PDL)")
    p.add_argument("--no-dg", action="store_true")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ["FP8LINEAR_BACKEND"] = "sm90"
    variants = parse_variants(args)
    kind = args.between or ("elem" if args.elem else None)
    shapes = C.parse_shapes(args.shapes)
    ms = [int(v) for v in args.m.split(",")]
    libs = B.Libs(["fp8linear"] + ([] if args.no_dg else ["deepgemm"]), probe_cublas=False)
    meth = "fp8linear_linear" if args.linear else "fp8linear"
    names = list(variants)
    rows = []
    bw = C.measure_read_bandwidth()["read_bw_gbps"]
    print(f"{'shape':>12} {'M':>5} " + " ".join(f"{n:>8}" for n in names) +
          f" {'DG':>8} {'best':>8} {'best/DG':>7} {'floor%':>6} maxerr", flush=True)
    for n, k in shapes:
        copies = max(2, C.copies_for(n * k, 400e6 if min(ms) <= 256 else 120e6))
        sd = B.ShapeData(n, k, copies, 0, seed=n * 31 + k)
        for m in ms:
            md = B.MData(sd, m, libs, seed=m)
            ref = B.reference(sd, md)
            L = max(2, C.launches_for(copies, C.est_us(m, n, k)))
            between = md.neighbour(kind) if kind else None
            graphs, errs = {}, {}
            for name in names:
                old = with_env(variants[name])
                use_build(variants[name])
                try:
                    launch = B.make_launch(meth, sd, md, libs)
                    out = launch(0)
                    torch.cuda.synchronize()
                    errs[name] = B.rel_err(out, ref)
                    if not args.linear:
                        pz = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                        fp8linear.block_fp8_gemm(md.a, md.as_, sd.wq[0], sd.ws[0], out=pz)
                        torch.cuda.synchronize()
                        if not bool(torch.isfinite(pz).all()):
                            errs[name] = float("inf")
                    graphs[name] = C.capture_graph(launch, L, between=between)
                finally:
                    restore(old)
                    use_build({})
            if args.with_gemm:
                graphs["GEMM"] = C.capture_graph(B.make_launch("fp8linear", sd, md, libs), L,
                                                 between=between)
            if libs.dg is not None and n % 64 == 0 and k % 128 == 0:
                graphs["DG"] = C.capture_graph(B.make_launch("deepgemm", sd, md, libs), L,
                                               between=between)
            if kind:
                graphs["_elem"] = C.capture_graph(lambda i: None, L, between=between)
            times = C.time_graphs_interleaved(graphs, args.replays)
            us = {g: C.median(t) / L for g, t in times.items()}
            e = us.pop("_elem", 0.0)
            us = {g: v - e for g, v in us.items()}
            best = min(names, key=lambda v: us[v])
            dg = us.get("DG")
            # the read floor: weight bytes (fp8 + block scales) at the measured read bandwidth
            floor = (n * k + 4 * (n // 128 + 1) * (k // 128 + 1)) / (bw * 1e3)
            print(f"{n:>6}x{k:<5} {m:>5} " + " ".join(f"{us[v]:8.2f}" for v in names) +
                  f" {dg if dg else float('nan'):8.2f} {best:>8} "
                  f"{(dg / us[best]) if dg else float('nan'):7.2f} "
                  f"{100 * floor / us[best]:6.0f} {max(errs.values()):.1e}"
                  + (" hop " + " ".join(f"{us[v] - us['GEMM']:5.2f}" for v in names)
                     if "GEMM" in us else ""), flush=True)
            rows.append(dict(n=n, k=k, m=m, us=us, errs=errs, best=best, elem_us=e))
            del graphs, md
        del sd
        torch.cuda.empty_cache()
    bad = [r for r in rows if max(r["errs"].values()) > 2e-3]
    # each variant against the first (the A/B's baseline): speedup geomean, min, max
    for name in names[1:]:
        r = [row["us"][names[0]] / row["us"][name] for row in rows]
        if r:
            print(f"{name} vs {names[0]}: geomean {C.geomean(r):.3f} min {min(r):.3f} "
                  f"max {max(r):.3f} over {len(r)} points", flush=True)
    for name in names if args.with_gemm else ():
        hops = sorted(row["us"][name] - row["us"]["GEMM"] for row in rows)
        if hops:
            print(f"{name} hop over the GEMM: median {hops[len(hops) // 2]:.2f} us, "
                  f"over 1 us at {sum(h > 1 for h in hops)} of {len(hops)} points", flush=True)
    print(f"points {len(rows)}; error > 2e-3: {len(bad)}; read bandwidth {bw:.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                           read_bw_gbps=bw, variants=variants, rows=rows), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
