"""Device probe (session 16): time of the fused (norm | SiLU-and-mul) + quantization kernels
at decode and prefill token counts with each kernel's program split: the heuristic's (auto)
and forced ones (--groups; default 4 groups a program, session 15's fixed split, and the
biggest: the norm's whole row, 16 groups for SiLU-and-mul).

    python scripts/dev_fused_quant_split.py [--out LOG]

Shapes: Llama 8B's norms (K 4096, with the residual add) and SiLU-and-mul (d 14336). CUDA
graphs of 24 calls (bench_triton_quick's timer), time per call = median of 30 replays / 24,
fresh inputs per shape.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fp8linear import norm_quant as nq
from fp8linear.kernels import triton_norm_quant, triton_swiglu_quant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_triton_quick import _graph_time_us  # noqa: E402  (the CUDA-graph timer)


def timed(fn) -> float:
    return _graph_time_us(lambda i: fn(), copies=1, replays=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--ms", default="1,16,64,256,1024,8192")
    ap.add_argument("--groups", default="4,max",
                    help="forced splits timed beside the heuristic's (max: the biggest)")
    ap.add_argument("--warps", default="auto",
                    help="num_warps for each forced split (auto: heuristics.fused_quant_split's)")
    args = ap.parse_args()
    k, d = 4096, 14336
    combos = [(g, w) for g in args.groups.split(",") for w in args.warps.split(",")]
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us per call",
             f"{'op':8} {'M':>5} | {'auto':>7} " +
             " ".join(f"{'g' + g + ('' if w == 'auto' else 'w' + w):>7}" for g, w in combos)]
    for m in map(int, args.ms.split(",")):
        x = torch.randn(m, k, device="cuda").bfloat16()
        res = torch.randn(m, k, device="cuda").bfloat16()
        w = (1 + 0.1 * torch.randn(k, device="cuda")).bfloat16()
        q, s = nq._buffers(x)
        r_out = torch.empty_like(x)
        xa = (torch.randn(m, 2 * d, device="cuda") * 3).bfloat16()
        qa, sa = nq._buffers(xa[:, :d])
        for op, biggest, call in (
                ("norm", k // 128, lambda g, nw: triton_norm_quant.launch(
                    x, res, w, 1e-5, q, s, r_out, groups=g, warps=nw)),
                ("silu_mul", triton_swiglu_quant.MAX_GROUPS_PER_PROGRAM,
                 lambda g, nw: triton_swiglu_quant.launch(xa, qa, sa, groups=g, warps=nw))):
            runs = [(None, None)] + [(biggest if g == "max" else int(g),
                                      None if nw == "auto" else int(nw)) for g, nw in combos]
            ts = [timed(lambda g=g, nw=nw: call(g, nw)) for g, nw in runs]
            lines.append(f"{op:8} {m:5} | " + " ".join(f"{t:7.2f}" for t in ts))
            print(lines[-1], flush=True)
    if args.out:
        open(args.out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
