#!/usr/bin/env python3
"""A handful of small shapes, once each, through the sm90 backend, for compute-sanitizer:

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
      python tests/backends/sm90/sanitize_gemm.py
  compute-sanitizer --tool racecheck --error-exitcode 9 \
      python tests/backends/sm90/sanitize_gemm.py --quick

(PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own cudaMalloc, so memcheck sees a
read or write past a tensor's end instead of landing silently in a neighbour of the
allocator's pool.)

Covers both sm90 paths as fp8linear.backends.sm90.plan.choose picks them (decode: swap-AB,
split-K, fused quant, M <= 32; large M: quant kernel + TMA/wgmma GEMM), tails in M, N and K
(partial last scale blocks), both weight-scale granularities, bias, bf16 and fp16 outputs,
block_fp8_gemm and fp8_linear; then the MoE layer (fused_moe: routing, the grouped expert
GEMMs with and without split K, token tiles of 8 to 128, and the prefill kernel) on
MOE_CASES. Data and references are made on the CPU, so the GPU runs little besides our
kernels (and the instrumented run stays short). Exit code 0 only if every result
is right. --configs i,j runs the cases again with each large-M configuration i, j forced
(plan.forced(gemm_config=i): the cluster and 128x192 configurations are not picked for shapes
this small otherwise); --configs all runs the cases once as the rules plan them and then once
under each configuration forced, in one process (one sanitizer start), and the decode cases
again under DECODE_PLANS (the plans whose producer keeps a window of weight stages in flight:
128-row CTAs two an SM, and 64-row ones two an SM with split K, which relay their weight
stages; the former are not picked for N this small otherwise). FP8LINEAR_BACKEND (--backend)
stays an environment variable; the plans are forced through plan.forced, never the
environment.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # (tests/backends/sm90/ -> the checkout)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import fp8linear  # noqa: E402
from fp8linear import knobs  # noqa: E402
from fp8linear.backends.sm90 import moe_plan  # noqa: E402
from fp8linear.backends.sm90 import plan as sm90_plan  # noqa: E402
from fp8linear.backends.sm90.tiles import GEMM_TILES  # noqa: E402

# (M, N, K, per_row, out dtype, bias)
CASES = [
    (1, 136, 272, False, torch.bfloat16, True),      # decode, one token, tails in N and K
    (7, 264, 400, True, torch.float16, False),       # decode, per-row scales, K tail of 16
    (12, 264, 1040, True, torch.float16, True),      # decode, 16-token tile, fused quant
    (20, 136, 4224, False, torch.bfloat16, True),    # decode, 32-token tile, split K
    (64, 200, 528, True, torch.bfloat16, False),     # large-M path, 64x64 tiles
    (65, 136, 272, False, torch.bfloat16, True),     # large-M path, smallest M
    (300, 264, 400, True, torch.float16, True),      # large-M path, M tail, per-row
    (1000, 392, 1040, False, torch.bfloat16, False), # large-M path, several tiles
]
# MoE layers (M, experts, top_k, hidden, intermediate, dtype[, MoE plan pieces forced:
# backends.sm90.moe_plan.forced]), checked against moe_reference
MOE_CASES = [
    (1, 16, 4, 1024, 256, torch.float16),    # one token: slot tiles, split K
    (5, 16, 4, 208, 256, torch.float16),
    (40, 4, 2, 384, 128, torch.bfloat16),
    (1, 8, 2, 256, 128, torch.bfloat16),     # slot tiles
    (300, 8, 2, 256, 128, torch.bfloat16),   # >= 32 tokens an expert: the prefill kernel
    (100, 8, 2, 256, 128, torch.bfloat16),   # 200 slots: the one-program routing
    (200, 8, 2, 256, 256, torch.bfloat16),   # prefill again
    # the prefill kernel's pairs of 128x192 tiles (gate_up's 512 and down's 384 columns: a
    # last tile past N; M blocks of one expert and of two, an odd count)
    (700, 8, 2, 384, 256, torch.bfloat16, {"prefill": True, "prefill_config": 14}),
    (200, 8, 2, 384, 256, torch.float16, {"prefill": True, "prefill_config": 14}),
    # the decode kernel's sorted tiles (the rules take slot tiles at these small sizes): 16-token
    # tiles after the parallel routing, gate_up finding its tiles' experts from the ids
    # (moe-tile-route); 8-token tiles reading their rows' tokens too (moe-token-rows)
    (64, 32, 4, 2176, 128, torch.float16, {"slot_tiles": False}),
    (40, 16, 4, 512, 256, torch.bfloat16, {"slot_tiles": False, "token_tile": 8}),
    # slot tiles three CTAs an SM (moe-slot-three), split K
    (3, 16, 4, 1024, 256, torch.float16, {"slot_tiles": True, "ctas": 3, "splits": 2}),
]
QUICK = [0, 2, 5, 6, 7]   # racecheck is slow on warp-specialized kernels: fewer dense cases
# decode plans forced for the decode cases under --configs all (plan.forced pieces)
DECODE_PLANS = [
    {"decode_rows": 128, "decode_ctas": 2},
    {"decode_rows": 128, "decode_ctas": 2, "decode_splits": 3},
    # 64-row CTAs two an SM with split K: the relaying producer (decode.cu relay_plan)
    {"decode_rows": 64, "decode_ctas": 2, "decode_splits": 3},
]


def deq64(q, s):
    r, k = q.shape
    s = s.double()
    if s.shape[0] != r:
        s = s.repeat_interleave(128, 0)[:r]
    return q.double() * s.repeat_interleave(128, 1)[:, :k]


def plan_of(m, n, k):
    try:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return sm90_plan.choose(m, n, k, sms)
    except Exception as e:  # noqa: BLE001
        return f"? ({e})"


def run_case(i, m, n, k, per_row, dtype, with_bias, dev="cuda"):
    g = torch.Generator().manual_seed(1000 + i)
    x = (torch.randn(m, k, generator=g) * torch.exp(0.5 * torch.randn(m, 1, generator=g)))
    w = 0.05 * torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    xq, xs = fp8linear.quantize_activation(x.to(dtype))
    wq, ws = fp8linear.quantize_activation(w) if per_row else fp8linear.quantize_weight(w)
    bias = (0.5 * torch.randn(n, generator=g)).to(dtype) if with_bias else None
    ref = deq64(xq, xs) @ deq64(wq, ws).t()
    if bias is not None:
        ref += bias.double()
    xd, xqd, xsd = x.to(dtype).to(dev), xq.to(dev), xs.to(dev)
    wqd, wsd = wq.to(dev), ws.to(dev)
    bd = bias.to(dev) if bias is not None else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
    fp8linear.block_fp8_gemm(xqd, xsd, wqd, wsd, out_dtype=dtype, out=out, bias=bd)
    y = fp8linear.fp8_linear(xd, wqd, wsd, bd)
    if dev == "cuda":
        torch.cuda.synchronize()
    errs = []
    for name, o in (("block_fp8_gemm", out), ("fp8_linear", y)):
        oc = o.double().cpu()
        if not torch.isfinite(oc).all():
            errs.append(f"{name}: {int((~torch.isfinite(oc)).sum())} NaN/inf outputs")
            continue
        rel = float((oc - ref).norm() / ref.norm())
        floor = float((ref.to(dtype).double() - ref).norm() / ref.norm())
        if rel > max(2e-3, floor + 3e-4):
            errs.append(f"{name}: rel err {rel:.3e}")
    return errs


def run_moe_case(i, m, e, top_k, h, inter, dtype, forced=None, dev="cuda"):
    g = torch.Generator().manual_seed(2000 + i)
    x = torch.randn(m, h, generator=g).to(dtype)
    experts = []
    for n, k in ((2 * inter, h), (h, inter)):
        ws, ss = zip(*(fp8linear.quantize_weight(0.05 * torch.randn(n, k, generator=g))
                       for _ in range(e)))
        experts += [torch.stack(ws), torch.stack(ss)]
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(m)])
    wts = torch.softmax(torch.randn(m, top_k, generator=g), 1)
    ref = fp8linear.moe_reference(x, *experts, wts, ids).double()
    with moe_plan.forced(**(forced or {})):
        out = fp8linear.fused_moe(x.to(dev), *(t.to(dev) for t in experts), wts.to(dev),
                                  ids.to(dev)).double().cpu()
    if not torch.isfinite(out).all():
        return [f"fused_moe: {int((~torch.isfinite(out)).sum())} NaN/inf outputs"]
    rel = float((out - ref).norm() / ref.norm())
    # (1e-2: the intermediate's fp8 rounding amplifies the GEMMs' last-bit differences)
    return [f"fused_moe: rel err {rel:.3e} against moe_reference"] if rel > 1e-2 else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"only dense cases {QUICK}, every MoE case (for racecheck)")
    p.add_argument("--backend", default="sm90", help="FP8LINEAR_BACKEND to force")
    p.add_argument("--device", default="cuda",
                   help="cpu: dry run of this script on the torch reference")
    p.add_argument("--configs", default="",
                   help="then again with each large-M configuration forced: 'all' or e.g. 0,5")
    a = p.parse_args(argv)
    if a.device == "cpu":
        a.backend = "reference"
    elif not torch.cuda.is_available():
        print("sanitize_gemm: no CUDA device", file=sys.stderr)
        return 2
    os.environ[knobs.BACKEND.name] = a.backend
    knobs.reload()
    t0 = time.time()
    if a.backend == "sm90":
        from fp8linear.backends.sm90 import backend as sm90
        if not sm90.available():
            print("sanitize_gemm: the sm90 backend is not available", file=sys.stderr)
            return 3
    forced = [{}]  # plan pieces to force; the rules' plans first
    if a.configs:
        forced += [{"gemm_config": int(c)}
                   for c in (range(len(GEMM_TILES)) if a.configs == "all"
                             else a.configs.split(","))]
        if a.configs == "all":
            forced += DECODE_PLANS
    fails = 0
    for pieces in forced:
        decode_only = any(k.startswith("decode_") for k in pieces)
        if pieces:
            print("forced: " + ",".join(f"{k}={v}" for k, v in pieces.items()), flush=True)
        with sm90_plan.forced(**pieces):
            for i, case in enumerate(CASES):
                if a.quick and i not in QUICK:
                    continue
                if decode_only and case[0] > sm90_plan.DECODE_MAX_M:  # (not a decode case)
                    continue
                m, n, k, per_row, dtype, with_bias = case
                t = time.time()
                errs = run_case(i, *case, dev=a.device)
                status = "ok" if not errs else "FAIL " + "; ".join(errs)
                fails += bool(errs)
                print(f"case {i}: M={m} N={n} K={k} {'row' if per_row else 'blk'} "
                      f"{str(dtype).split('.')[-1]} bias={with_bias} "
                      f"plan={plan_of(m, n, k) if a.device == 'cuda' else '-'} "
                      f"{time.time() - t:.1f}s {status}", flush=True)
    for i, case in enumerate(MOE_CASES):  # (--quick too: each a fraction of a second)
        t = time.time()
        errs = run_moe_case(i, *case, dev=a.device)
        fails += bool(errs)
        m, e, top_k, h, inter, dtype = case[:6]
        pieces = "".join(f"{k}={v} " for k, v in (case[6] if len(case) > 6 else {}).items())
        print(f"moe case {i}: M={m} E={e} top_k={top_k} H={h} I={inter} "
              f"{str(dtype).split('.')[-1]} {pieces}{time.time() - t:.1f}s "
              f"{'ok' if not errs else 'FAIL ' + '; '.join(errs)}", flush=True)
    print(f"sanitize_gemm: {'ALL OK' if not fails else f'{fails} FAILED'} "
          f"({time.time() - t0:.1f}s)", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
