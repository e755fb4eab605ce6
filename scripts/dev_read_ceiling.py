"""Device probe: issue 4's two open targets against what any kernel of this kind can reach.

1. The floor (>= 85% of weight bytes / read bandwidth where that is >= 8 us, 75% below):
   scripts/dev_read_ceiling.cu's read_ceiling, a decode GEMM with free math (weights staged
   through a shared-memory ring, no slot reused before griddepcontrol.wait returns), swept
   over rows a CTA, split count, ring bytes and PDL trigger placement, timed as
   bench_gemm.py times a GEMM (a CUDA graph of L launches cycling copies past 420 MB,
   median over interleaved replays), beside block_fp8_gemm on the same shape. The best
   variant per shape is a ceiling for kernels that stage weights through shared memory.
2. fp8_linear's hop (within 1 us of block_fp8_gemm at M <= 16): block_fp8_gemm with an empty
   PDL kernel before it (griddepcontrol.wait + launch_dependents; one CTA, or the quant
   kernel's grid) against block_fp8_gemm alone: the least a second kernel (a quantization
   kernel) adds to a step; and the quant kernel itself before block_fp8_gemm.

3. What the decode kernel's other parts cost on the ceiling (activation tiles in the ring, the
   split reduction), beside block_fp8_gemm, in the same modes.

    python scripts/dev_read_ceiling.py [--so build/dev_read_ceiling.so] [--part floor,parts,hop]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common as C  # noqa: E402

FLOOR_SHAPES = [(2112, 7168), (4096, 4096), (7168, 2048), (6144, 4096), (4096, 7168),
                (4096, 14336), (8192, 8192)]
# (N, K, M): the points where fp8_linear's hop was over 1 us back to back (bench_decode v44)
HOP_POINTS = [(4096, 4096, 1), (4096, 4096, 8), (4096, 4096, 16), (4096, 7168, 8),
              (4096, 7168, 16), (4096, 14336, 4),
              (4096, 14336, 16), (7168, 2048, 8), (7168, 2048, 16), (8192, 8192, 16),
              (8192, 28672, 1), (10240, 8192, 4), (10240, 8192, 16), (24576, 1536, 16),
              (28672, 4096, 1), (57344, 8192, 1),
              # (and three under 1 us)
              (4096, 7168, 1), (6144, 4096, 1), (8192, 8192, 1)]


def build(so: str) -> ctypes.CDLL:
    src = os.path.join(ROOT, "scripts", "dev_read_ceiling.cu")
    os.makedirs(os.path.dirname(os.path.abspath(so)), exist_ok=True)
    subprocess.run(["nvcc", "-arch=sm_90a", "-O3", "-shared", "-Xcompiler", "-fPIC",
                    "-I" + os.path.join(ROOT, "csrc"), src, "-o", so], check=True)
    lib = ctypes.CDLL(so)
    lib.ceiling_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_void_p] + [ctypes.c_int] * 7 + [
                                   ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2
    lib.empty_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 4
    return lib


def stream_ptr() -> int:
    return torch.cuda.current_stream().cuda_stream


def variants():
    """(name, rows, splits, ring KB, trigger_early, layout): layout 0 the decode kernel's 2D
    boxes, 1 contiguous stages (c)"""
    out = []
    for rows in (64, 128):
        for splits in (1, 2, 4):
            for kb in (32, 64, 96, 128, 192):
                for early in (1, 0):
                    out.append((f"r{rows}s{splits}k{kb}{'e' if early else 'l'}", rows, splits,
                                kb, early, 0))
                if kb in (64, 128):
                    out.append((f"r{rows}s{splits}k{kb}ec", rows, splits, kb, 1, 1))
    return out


MODES = ("b2b", "elem", "fused_norm")  # back to back; after bench_gemm's neighbour kernels


class Shape:
    """One weight shape's timing set-up: the floor, copies past 420 MB, launches a graph,
    random weight bytes for the probe (rows padded to 128: the contiguous layout reads whole
    tiles) and the neighbour kernel of each mode (between(i) for C.capture_graph)."""

    def __init__(self, n, k, gbps):
        import neighbour
        self.n, self.k = n, k
        self.floor = C.fp8_weight_bytes(n, k) / (gbps * 1e3)
        self.copies = max(2, C.copies_for(n * k, 420e6))
        self.L = C.launches_for(self.copies, self.floor)
        self.ws = [torch.randint(0, 256, (-(-n // 128) * 128, k), dtype=torch.uint8,
                                 device="cuda") for _ in range(self.copies)]
        x = torch.randn(8, k, device="cuda").to(torch.bfloat16)
        g = torch.randn(k, device="cuda").to(torch.bfloat16)
        self.betweens = {"b2b": None}
        for mode in MODES[1:]:
            run = neighbour.make(mode, x, g, torch.empty_like(x))
            self.betweens[mode] = lambda i, run=run: run()

    def graph(self, launch, mode):
        return C.capture_graph(launch, self.L, warmup_calls=self.copies,
                               between=self.betweens[mode])

    def add_ours(self, graphs, ms, key):
        """block_fp8_gemm on fp8 weights of this shape at each M of ms, every mode, under
        key.format(mode=, m=)"""
        from fp8linear import block_fp8_gemm, quantize_activation
        wq, wsc = fp8_weights(self.n, self.k, self.copies)
        r = self.copies
        for m in ms:
            a, sc = quantize_activation(torch.randn(m, self.k, device="cuda").to(torch.bfloat16))
            sc = C.m_major_scales(sc, m)
            for mode in MODES:
                graphs[key.format(mode=mode, m=m)] = self.graph(
                    lambda i, a=a, sc=sc: block_fp8_gemm(a, sc, wq[i % r], wsc[i % r]), mode)

    def time(self, graphs, replays):
        """{key: us a launch}, the neighbour's own time (a graph of it alone) subtracted in
        the modes that have one."""
        for mode in MODES[1:]:
            graphs[f"{mode}:_nb"] = self.graph(lambda i: None, mode)
        t = C.time_graphs_interleaved(graphs, replays)
        us = {name: C.median(v) / self.L for name, v in t.items()}
        for mode in MODES[1:]:
            nb = us.pop(f"{mode}:_nb")
            for key in us:
                if key.startswith(mode + ":"):
                    us[key] -= nb
        return us


def fp8_weights(n, k, copies):
    from fp8linear import quantize_weight
    pairs = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
    return [q for q, _ in pairs], [sc for _, sc in pairs]


def floor_part(lib, gbps, replays, res):
    print(f"\n# 1. floor: read_ceiling (free math) vs block_fp8_gemm (read bandwidth {gbps:.0f} "
          f"GB/s); modes: back to back, after an elementwise kernel, after our fused norm "
          f"(its time subtracted)")
    print(f"{'shape':>11} {'mode':>10} {'floor':>6} {'ours M=1':>9} {'%':>5} {'ours M=16':>9} "
          f"{'%':>5} {'ceiling':>8} {'%':>5}  best variant (next two); the b2b best here; "
          f"best with contiguous stages")
    for n, k in FLOOR_SHAPES:
        sh = Shape(n, k, gbps)
        floor, copies, ws = sh.floor, sh.copies, sh.ws
        out = torch.empty(4 * 132 * 8, dtype=torch.float32, device="cuda")
        graphs = {}
        for name, rows, splits, kb, early, layout in variants():
            depth = kb * 1024 // (rows * 128)
            if depth < 2:
                continue

            def launch(i, rows=rows, splits=splits, depth=depth, early=early, layout=layout):
                e = lib.ceiling_launch(stream_ptr(), ws[i % copies].data_ptr(), n, k,
                                       out.data_ptr(), rows, splits, depth, early, 0, 1, layout,
                                       None, 0, 0, 0, None, None)
                if e:
                    raise RuntimeError(f"ceiling_launch: cuda error {e}")
            for mode in MODES if layout == 0 else ("b2b",):
                graphs[f"{mode}:{name}"] = sh.graph(launch, mode)
        sh.add_ours(graphs, (1, 16), "{mode}:ours{m}")
        us = sh.time(graphs, replays)
        res.setdefault("floor", []).append({"shape": f"{n}x{k}", "floor_us": floor, "us": us})
        b2b_best = None
        for mode in MODES:
            mine = {key.split(":", 1)[1]: v for key, v in us.items() if key.startswith(mode + ":")}
            ranked = sorted((v, name) for name, v in mine.items()
                            if not name.startswith("ours") and not name.endswith("c"))
            best = ranked[0]
            if mode == "b2b":
                b2b_best = best[1]
            tail = f"; {b2b_best} {mine[b2b_best]:.2f} {100 * floor / mine[b2b_best]:.1f}%"
            if mode == "b2b":
                bc = min((v, name) for name, v in mine.items() if name.endswith("c"))
                tail = f"; {bc[1]} {bc[0]:.2f} {100 * floor / bc[0]:.1f}%"
            print(f"{n:>5}x{k:<5} {mode:>10} {floor:6.2f} {mine['ours1']:9.2f} "
                  f"{100 * floor / mine['ours1']:5.1f} {mine['ours16']:9.2f} "
                  f"{100 * floor / mine['ours16']:5.1f} {best[0]:8.2f} "
                  f"{100 * floor / best[0]:5.1f}  {best[1]} ("
                  + ", ".join(f"{nm} {v:.2f}" for v, nm in ranked[1:3]) + ")" + tail,
                  flush=True)
        del graphs, sh
        torch.cuda.empty_cache()


# the decode kernel's parts other than the weight stream and the math, added to read_ceiling:
# (name, act, first, reduce)
PARTS = [("free", 0, 0, 0), ("act", 1, 0, 0), ("act8", 1, 8, 0), ("red", 0, 0, 1),
         ("act+red", 1, 0, 1), ("act8+red", 1, 8, 1)]
# (rows, splits, weight ring KB): the decode plans' own geometries and the ceiling's best
GEOMETRIES = [(64, 1, 128), (64, 1, 96), (64, 2, 96), (64, 2, 128), (64, 4, 64), (64, 4, 96),
              (128, 2, 192)]


def parts_part(lib, gbps, replays, res):
    print(f"\n# 3. parts: read_ceiling (early trigger) plus the decode kernel's other parts "
          f"(act: 8-token activation tiles a stage after the whole ring, act8: after 8 weight "
          f"stages; red: split partials through a workspace, the last CTA summing; an fp32 "
          f"partial store without splits), us; ours = block_fp8_gemm at M = 1 / 8; read "
          f"bandwidth {gbps:.0f} GB/s")
    for n, k in FLOOR_SHAPES:
        sh = Shape(n, k, gbps)
        floor, copies, ws = sh.floor, sh.copies, sh.ws
        x8 = torch.randint(0, 256, (8, k), dtype=torch.uint8, device="cuda")
        out = torch.empty(n * 8 + 4096, dtype=torch.float32, device="cuda")
        work = torch.empty(n * 4 * 8 + 4096, dtype=torch.float32, device="cuda")
        counters = torch.zeros(256, dtype=torch.int32, device="cuda")
        graphs = {}
        for rows, splits, kb in GEOMETRIES:
            depth = kb * 1024 // (rows * 128)
            for pname, act, first, reduce in PARTS:
                def launch(i, rows=rows, splits=splits, depth=depth, act=act, first=first,
                           reduce=reduce):
                    e = lib.ceiling_launch(stream_ptr(), ws[i % copies].data_ptr(), n, k,
                                           out.data_ptr(), rows, splits, depth, 1, 0, 1, 0,
                                           x8.data_ptr(), act, first, reduce, work.data_ptr(),
                                           counters.data_ptr())
                    if e:
                        raise RuntimeError(f"ceiling_launch: cuda error {e}")
                for mode in MODES:
                    graphs[f"{mode}:r{rows}s{splits}k{kb}:{pname}"] = sh.graph(launch, mode)
        sh.add_ours(graphs, (1, 8), "{mode}:ours:{m}")
        us = sh.time(graphs, replays)
        res.setdefault("parts", []).append({"shape": f"{n}x{k}", "floor_us": floor, "us": us})
        for mode in MODES:
            print(f"{n}x{k} {mode} (floor {floor:.2f} us): ours M=1 {us[f'{mode}:ours:1']:.2f}, "
                  f"M=8 {us[f'{mode}:ours:8']:.2f}")
            print(f"{'geometry':>14} " + " ".join(f"{pn:>9}" for pn, *_ in PARTS))
            for rows, splits, kb in GEOMETRIES:
                g = f"r{rows}s{splits}k{kb}"
                print(f"{g:>14} " + " ".join(f"{us[f'{mode}:{g}:{pn}']:9.2f}"
                                             for pn, *_ in PARTS), flush=True)
        del graphs, sh
        torch.cuda.empty_cache()


def hop_part(lib, replays, res):
    from fp8linear import block_fp8_gemm, fp8_linear, quantize_activation
    from fp8linear.kernels import build
    ext = build.load()
    print("\n# 2. hop (us, back to back): block_fp8_gemm alone; after an empty PDL kernel of one "
          "CTA releasing its dependents first, as the quant kernel does (+e1) or after its wait "
          "(+late); after an empty kernel of the quant kernel's grid (+eG: M x K/128 warps, 8 a "
          "CTA); after the quant kernel itself (+quant: block_fp8_gemm on its output); "
          "fp8_linear (hop)")
    print(f"{'point':>18} {'gemm':>8} {'+e1':>6} {'+late':>6} {'+eG':>6} {'+quant':>7} "
          f"{'hop':>6}")
    for n, k, m in HOP_POINTS:
        copies = max(2, C.copies_for(n * k, 420e6))
        est = n * k / 3e6
        L = C.launches_for(copies, est)
        wq, wsc = fp8_weights(n, k, copies)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        a, s = quantize_activation(x)
        s = C.m_major_scales(s, m)
        kb = -(-k // 128)
        qx = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
        ld = -(-m // 4) * 4
        st = torch.empty(kb, ld, dtype=torch.float32, device="cuda")
        grid = -(-(m * kb) // 8)

        def gemm(i):
            return block_fp8_gemm(a, s, wq[i % copies], wsc[i % copies])

        def empty_gemm(i, first, g, t):
            e = lib.empty_launch(stream_ptr(), 1, first, g, t)
            if e:
                raise RuntimeError(f"empty_launch: cuda error {e}")
            return gemm(i)

        def quant_gemm(i):
            ext.quant(x, qx, st, True)
            return block_fp8_gemm(qx, st[:, :m].t(), wq[i % copies], wsc[i % copies])
        launches = {"gemm": gemm, "e1": lambda i: empty_gemm(i, 1, 1, 32),
                    "late": lambda i: empty_gemm(i, 0, 1, 32),
                    "eG": lambda i: empty_gemm(i, 1, grid, 256), "quant": quant_gemm,
                    "linear": lambda i: fp8_linear(x, wq[i % copies], wsc[i % copies])}
        graphs = {name: C.capture_graph(f, L, warmup_calls=copies) for name, f in launches.items()}
        ref = quant_gemm(0).float()
        got = fp8_linear(x, wq[0], wsc[0]).float()
        err = float((got - ref).norm() / ref.norm())
        t = C.time_graphs_interleaved(graphs, replays)
        us = {name: C.median(v) / L for name, v in t.items()}
        res.setdefault("hop", []).append({"point": [n, k, m], "us": us, "quant_vs_linear": err})
        g = us["gemm"]
        print(f"{n:>6}x{k:<6} x{m:<3} {g:8.2f} {us['e1'] - g:6.2f} {us['late'] - g:6.2f} "
              f"{us['eG'] - g:6.2f} {us['quant'] - g:7.2f} {us['linear'] - g:6.2f}"
              + (f"  (quant+gemm vs fp8_linear: rel err {err:.1e})" if err > 1e-6 else ""),
              flush=True)
        del graphs
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--so", default=os.path.join(ROOT, "build", "dev_read_ceiling.so"))
    ap.add_argument("--part", default="floor,hop")
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    lib = build(args.so)
    bw = C.measure_read_bandwidth()
    gbps = bw["read_bw_gbps"]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; read bandwidth "
          f"{gbps:.0f} GB/s ({bw['read_bw_op']} over {bw['read_bw_bytes'] / 2**30:.0f} GiB)")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "read_bw_gbps": gbps}
    parts = args.part.split(",")
    if "floor" in parts:
        floor_part(lib, gbps, args.replays, res)
    if "parts" in parts:
        parts_part(lib, gbps, args.replays, res)
    if "hop" in parts:
        hop_part(lib, args.replays, res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
