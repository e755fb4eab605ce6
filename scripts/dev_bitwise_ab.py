"""Device dev check: two builds of the kernels, bit for bit.

A kernel change that should not change any result (a reordered loop, a deeper pipeline) is
checked here before it is timed: block_fp8_gemm and fp8_linear on the GPU suite's random
cases (tests/kernels/test_gemm_gpu.py: tails in N and K, both weight-scale granularities,
bf16 / fp16 outputs, bias) under a list of forced plans (knob sets), each output
NaN-poisoned first. Every variant's output must equal the first variant's exactly, and the
first's must meet the suite's error bound against the fp64 reference. Exit status 1 on any
difference.

    python scripts/dev_bitwise_ab.py --variants "a:;b:FP8LINEAR_DEV_SO=.prebuilt_b/*/*.so" \
        --max-m 32 --count 40 --knobs "FP8LINEAR_SM90_DECODE_CTAS=1;FP8LINEAR_SM90_DECODE_CTAS=2"

(Variants as in dev_variants.py: a set of environment overrides, FP8LINEAR_DEV_SO naming a
DEV_NAMESPACE build.)
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

import fp8linear  # noqa: E402
import dev_variants as V  # noqa: E402
from tests.kernels import test_gemm_gpu as T  # noqa: E402

# plans that cover the decode kernel's code paths at M <= 32 (the default: the heuristic's)
DEFAULT_KNOBS = ";".join([
    "",
    "FP8LINEAR_SM90_DECODE_CTAS=1",
    "FP8LINEAR_SM90_DECODE_CTAS=2",
    "FP8LINEAR_SM90_DECODE_ROWS=128",
    "FP8LINEAR_SM90_DECODE_ROWS=64,FP8LINEAR_SM90_DECODE_SPLITS=1",
    "FP8LINEAR_SM90_DECODE_ROWS=80",
    "FP8LINEAR_SM90_DECODE_SPLITS=3",
    "FP8LINEAR_SM90_DECODE_CLUSTER=1",
    "FP8LINEAR_SM90_FUSE_QUANT=1",
    "FP8LINEAR_SM90_FUSE_QUANT=0",
])


def parse_sets(spec: str) -> list[dict[str, str]]:
    return [dict(a.split("=", 1) for a in s.split(",") if a) for s in spec.split(";")]


def run_case(case: dict) -> list[torch.Tensor]:
    """block_fp8_gemm into a poisoned output, and fp8_linear from the 16-bit activations."""
    x, a, a_s, wq, ws, bias = T.make_data(case)
    dt = T.DTYPES[case["out"]]
    out = torch.full((case["m"], case["n"]), float("nan"), dtype=dt, device="cuda")
    fp8linear.block_fp8_gemm(a, a_s, wq, ws, out_dtype=dt, out=out, bias=bias)
    y = fp8linear.fp8_linear(x, wq, ws, bias)
    torch.cuda.synchronize()
    return [out, y]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", required=True)
    ap.add_argument("--knobs", default=DEFAULT_KNOBS,
                    help="';'-separated knob sets (',' between a set's NAME=VALUE pairs)")
    ap.add_argument("--max-m", type=int, default=32)
    ap.add_argument("--count", type=int, default=40, help="cases per knob set")
    ap.add_argument("--seed", type=int, default=900)
    args = ap.parse_args()
    args.configs = None
    variants = V.parse_variants(args)
    names = list(variants)
    cases = [c for c in T.gen_cases("sm90", count=2000, seed=args.seed)
             if c["m"] <= args.max_m and c["out"] != "fp32"][:args.count]
    os.environ["FP8LINEAR_BACKEND"] = "sm90"
    bad = checked = 0
    for knobs in parse_sets(args.knobs):
        label = ",".join(f"{k.split('_', 2)[-1]}={v}" for k, v in knobs.items()) or "heuristic"
        diffs = 0
        for case in cases:
            outs = {}
            for name in names:
                V.use_build(variants[name])
                old = V.with_env({**variants[name], **knobs})
                try:
                    outs[name] = run_case(case)
                finally:
                    V.restore(old)
            x, a, a_s, wq, ws, bias = T.make_data(case)
            ref, mag = T.reference(a, a_s, wq, ws, bias)
            T.assert_close(outs[names[0]][0], ref, mag, f"{T._case_id(case)} {label}", bias=bias)
            for name in names[1:]:
                for what, o0, o1 in zip(("gemm", "linear"), outs[names[0]], outs[name]):
                    checked += 1
                    if not torch.equal(o0, o1):
                        diffs += 1
                        nd = int((o0 != o1).sum())
                        print(f"DIFF {name} vs {names[0]} {what} {T._case_id(case)} {label}: "
                              f"{nd} of {o0.numel()} elements", flush=True)
        bad += diffs
        print(f"{label:40s} cases {len(cases)}  differing outputs {diffs}", flush=True)
    print(f"bitwise_ab: {checked} output pairs compared, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
