"""Device smoke check for the sm90 kernels: builds them, checks both paths against the fp64
reference on a spread of shapes, and times a few shapes against bf16 F.linear.

Used while developing (one device call builds, checks and times); the full suites are
tests/kernels/ and benchmarks/bench_gemm.py.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp8linear  # noqa: E402
from fp8linear.kernels import heuristics  # noqa: E402


def build_ext():
    t = time.time()
    from fp8linear.kernels import build
    ext = build.load()
    print(f"build/load: {time.time() - t:.1f}s", flush=True)
    return ext


def ref(a, a_s, w, w_s, bias):
    out = fp8linear.dequantize_activation(a, a_s).double() @ \
        fp8linear.dequantize_weight(w, w_s).double().t()
    if bias is not None:
        out += bias.double()
    return out


def check(m, n, k, per_row, dtype, with_bias, mode):
    dev = "cuda"
    w = torch.randn(n, k, device=dev) * 0.05
    wq, ws = fp8linear.quantize_weight(w)
    if per_row:
        ws = ws.repeat_interleave(128, 0)[:n].contiguous() * (
            1 + 0.1 * torch.rand(n, 1, device=dev))
    x = torch.randn(m, k, device=dev, dtype=dtype)
    bias = torch.randn(n, device=dev, dtype=dtype) if with_bias else None
    xq, xs = fp8linear.quantize_activation(x)
    r = ref(xq, xs, wq, ws, bias)
    if mode == "gemm":
        out = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
        fp8linear.block_fp8_gemm(xq, xs, wq, ws, out_dtype=dtype, out=out, bias=bias)
    else:
        out = fp8linear.fp8_linear(x, wq, ws, bias)
    torch.cuda.synchronize()
    err = ((out.double() - r).norm() / r.norm()).item()
    nan = bool(out.isnan().any())
    return err, nan


def bench(fn, iters=50):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def timing(n, k, ms, copies_mb=512):
    dev = "cuda"
    r = max(2, int(copies_mb * 2**20 // (n * k)))
    ws = [fp8linear.quantize_weight(torch.randn(n, k, device=dev) * 0.05) for _ in range(min(r, 8))]
    ws = [ws[i % len(ws)] for i in range(r)]
    # distinct copies so L2 never holds them
    ws = [(a.clone(), b.clone()) for a, b in ws]
    wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, r // 2))]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        xq, xs = fp8linear.quantize_activation(x)

        def ours_linear():
            for a, b in ws:
                fp8linear.fp8_linear(x, a, b)

        def ours_gemm():
            for a, b in ws:
                fp8linear.block_fp8_gemm(xq, xs, a, b)

        def bf16():
            for b in wb:
                torch.nn.functional.linear(x, b)

        t_l = bench(ours_linear) / len(ws)
        t_g = bench(ours_gemm) / len(ws)
        t_b = bench(bf16) / len(wb)
        floor = n * k / 3.0e12 * 1e6
        rows.append((n, k, m, heuristics.sm90_plan(m, n, k, 132), t_l, t_g, t_b, floor,
                     2 * m * n * k / t_g / 1e6))
    return rows


def quant_diag(ext):
    """Our quant kernel vs torch's quantize_activation, byte for byte."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        m, k = 64, 4096
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        q = torch.empty(m, k, device="cuda", dtype=torch.float8_e4m3fn)
        st = torch.empty(k // 128, m, device="cuda")
        ext.quant(x, q, st, False)  # (no PDL)
        tq, ts = fp8linear.quantize_activation(x)
        cq, cs = fp8linear.quantize_activation(x.cpu())
        qb, tb, cb = (t.view(torch.uint8) for t in (q, tq, cq.cuda()))
        bad = (qb != tb).nonzero()
        print(f"quant {dtype}: scales equal torch-gpu {torch.equal(st.t(), ts)} torch-cpu "
              f"{torch.equal(st.t(), cs.cuda())}; bytes != torch-gpu {(qb != tb).sum().item()}, "
              f"!= torch-cpu {(qb != cb).sum().item()}, torch gpu != cpu {(tb != cb).sum().item()}",
              flush=True)
        for r, c in bad[:4].tolist():
            xv = x[r, c].float().item()
            sc = ts[r, c // 128].item()
            print(f"   x={xv!r} scale={sc!r} x/scale={xv / sc!r} ours={q[r, c].float().item()} "
                  f"torch={tq[r, c].float().item()} cpu={cq[r, c].float().item()}", flush=True)


def main():
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    quant_diag(build_ext())
    fails = 0
    cases = []
    for (n, k) in [(256, 256), (4096, 4096), (2112, 7168), (1000, 1040), (136, 272), (24576, 1536)]:
        for m in [1, 3, 8, 16, 33, 64, 65, 128, 300, 1024]:
            cases.append((m, n, k))
    t0 = time.time()
    for i, (m, n, k) in enumerate(cases):
        per_row = i % 3 == 1
        dtype = torch.float16 if i % 4 == 3 else torch.bfloat16
        with_bias = i % 2 == 0
        for mode in ("gemm", "linear"):
            try:
                err, nan = check(m, n, k, per_row, dtype, with_bias, mode)
            except Exception as e:  # noqa: BLE001
                print(f"FAIL {mode} m={m} n={n} k={k}: {e}", flush=True)
                fails += 1
                continue
            ok = err <= 2e-3 and not nan
            fails += not ok
            if not ok or i % 10 == 0:
                print(f"{'ok  ' if ok else 'FAIL'} {mode:6s} m={m:5d} n={n:6d} k={k:6d} "
                      f"per_row={per_row:d} {str(dtype)[6:]:8s} bias={with_bias:d} "
                      f"plan={heuristics.sm90_plan(m, n, k, 132)} err={err:.2e} nan={nan}",
                      flush=True)
    print(f"correctness: {len(cases) * 2 - fails}/{len(cases) * 2} ok in {time.time() - t0:.1f}s",
          flush=True)
    if os.environ.get("SKIP_TIMING"):
        return fails
    print(f"{'N':>6} {'K':>6} {'M':>5} {'plan':24s} {'linear':>8} {'gemm':>8} {'bf16':>8} "
          f"{'floor':>7} {'TFLOPS':>7}")
    for shape in [(4096, 4096), (2112, 7168), (28672, 4096), (7168, 16384)]:
        for row in timing(*shape, ms=[1, 8, 16, 64, 128, 512, 4096]):
            n, k, m, plan, tl, tg, tb, fl, tf = row
            print(f"{n:6d} {k:6d} {m:5d} {str(plan):24s} {tl:8.1f} {tg:8.1f} {tb:8.1f} "
                  f"{fl:7.1f} {tf:7.0f}", flush=True)
    return fails


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
