"""Where the time between two GEMMs goes: %globaltimer stamps per CTA (kernel start, after
griddepcontrol.wait, first stage full, K loop done, exit; quant kernel start / wait / end) from a
timeline build, in one graph replay of R back-to-back block_fp8_gemm and fp8_linear calls over
rotated weight copies; per launch, every stamp relative to the previous GEMM's last CTA exit.

The stamps are not in the product: build the probe as a variant first, from a worktree with
results/2026-11-26_timeline_probe.patch applied:
  git worktree add /tmp/v_t HEAD && cd /tmp/v_t && git apply <repo>/benchmarks/results/2026-11-26_timeline_probe.patch
  DEV_NAMESPACE=fp8l_t scripts/prebuild_device_ext.sh <repo>/.prebuilt_t
then on the device (carry .prebuilt and .prebuilt_t):
  python3 scripts/dev_timeline.py N K M [M ...]
Session 23's output: results/2026-11-26_fp8_linear_hop_timeline_h100.log."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "scripts")]
import bench_gemm as B  # noqa: E402
import common as C  # noqa: E402
import dev_variants as V  # noqa: E402
from fp8linear.kernels import build  # noqa: E402

V.use_build({"FP8LINEAR_DEV_SO": ".prebuilt_t/*/*.so"})
mod = build._module
n, k = int(sys.argv[1]), int(sys.argv[2])
ms = [int(v) for v in sys.argv[3:]]
libs = B.Libs(["fp8linear"], probe_cublas=False)
copies = C.copies_for(n * k, 200e6)
sd = B.ShapeData(n, k, copies, 0, seed=1)
KMAX = 1 << 20
buf = torch.zeros(4 + 4 * KMAX, dtype=torch.int64, device="cuda")
names = {1: "quant", 2: "decode", 3: "gemm"}


for m in ms:
    md = B.MData(sd, m, libs, seed=2)
    for meth in ("fp8linear", "fp8linear_linear"):
        f = B.make_launch(meth, sd, md, libs)
        R = max(2 * copies, 12)
        g = C.capture_graph(f, R)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        buf.zero_()
        mod.dev_tl_set(buf.data_ptr())
        g.replay()
        torch.cuda.synchronize()
        mod.dev_tl_set(0)
        cnt = int(buf[0].item())
        rec = buf[4:4 + 4 * cnt].view(cnt, 4).cpu().tolist()
        # per kernel type and block: the r-th stamp of event 0 belongs to launch r
        by = {}
        for t, ke, blk, _sm in rec:
            kern, ev = ke >> 32, ke & 0xffffffff
            by.setdefault((kern, blk, ev), []).append(t)
        launches = {}
        for (kern, blk, ev), ts in by.items():
            for r, t in enumerate(sorted(ts)):
                launches.setdefault((kern, r), {}).setdefault(ev, []).append(t)
        kinds = sorted({kk for kk, _ in launches})
        t0 = min(r[0] for r in rec)
        plan = f"{meth} M={m} {n}x{k}: {cnt} stamps, kernels {[names[x] for x in kinds]}, R={R}"
        print("##", plan)
        # chain per launch index
        rows = []
        for r in range(R):
            row = {}
            for kern in kinds:
                L = launches.get((kern, r))
                if not L:
                    continue
                for ev, ts in L.items():
                    row[(kern, ev)] = (min(ts) - t0, C.median(ts) - t0, max(ts) - t0, len(ts))
            rows.append(row)
        gk = 2 if any(kk == 2 for kk in kinds) else 3
        def g_end(row):  # the GEMM's last CTA exit (decode: events 4 / 5; gemm: 3)
            e = [row[(gk, ev)][2] for ev in (3, 4, 5) if (gk, ev) in row]
            return max(e) if e else None
        hdr = "launch  period  " + ("q.start q.wait q.end  " if 1 in kinds else "") + \
              "g.start(min/med) g.wait(med/max) g.first(med/max) g.loop(med) g.end(max)   [us, from the previous GEMM's end]"
        print(hdr)
        periods = []
        for r in range(1, R):
            prev, cur = rows[r - 1], rows[r]
            pe, ce = g_end(prev), g_end(cur)
            if pe is None or ce is None:
                continue
            us = lambda v: (v - pe) / 1000.0
            s = f"{r:6d} {(ce - pe) / 1000:7.2f}  "
            periods.append((ce - pe) / 1000)
            if 1 in kinds:
                s += " ".join(f"{us(cur[(1, ev)][i]):6.2f}" if (1, ev) in cur else "   -  "
                              for ev, i in ((0, 0), (1, 0), (2, 2))) + "  "
            def cell(ev, a, b):
                if (gk, ev) not in cur:
                    return "     -      "
                return f"{us(cur[(gk, ev)][a]):5.2f}/{us(cur[(gk, ev)][b]):5.2f}"
            s += f"{cell(0, 0, 1)}      {cell(1, 1, 2)}      {cell(2, 1, 2)}     " \
                 f"{us(cur[(gk, 3)][1]) if (gk, 3) in cur else float('nan'):6.2f}    {us(ce):6.2f}"
            print(s)
        if periods:
            print(f"median period {C.median(periods):.2f} us over {len(periods)} launches")
        del g
        torch.cuda.synchronize()
