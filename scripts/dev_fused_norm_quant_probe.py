"""Device probe: what fusing the activation quantization into the kernel before the GEMM would
buy (NOTES session 15, Next 1b), on Llama-3.1-8B-shaped layers.

Both variants run the same chain per layer, every non-GEMM kernel a Triton kernel launched
with PDL the way torch Inductor's are (gdc_wait before the first load, gdc_launch_dependents
after the last), except the stand-in for attention (a torch op, no PDL, as vLLM's):
  add + RMSNorm -> qkv_proj -> [attention stand-in] -> o_proj -> add + RMSNorm -> gate_up_proj
  -> SiLU-and-mul -> down_proj
  today  the norms / SiLU-and-mul write bf16; every GEMM is fp8_linear (our quant kernel, or
         the decode kernel's fused quantization)
  fused  the norms / SiLU-and-mul also quantize (fp8 + M-major per-group scales) and
         qkv / gate_up / down run block_fp8_gemm on that; o_proj stays fp8_linear
Each norm / SiLU-and-mul row is split over K / (128 CG) programs (CG=4: 8 for H, 28 for the
FFN), the same split in both variants. LAYERS distinct layers (> L2), one CUDA graph per
variant, 30 interleaved replays; prints us per layer and the outputs' agreement.
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import common as C  # noqa: E402
import fp8linear  # noqa: E402

H, FFN, QKV = 4096, 14336, 6144
LAYERS = int(os.environ.get("LAYERS", "4"))


@triton.jit
def _group_quant_store(y, row, c, q_ptr, s_ptr, s_ld, K: tl.constexpr, CG: tl.constexpr):
    # y: [CG * 128] fp32 (bf16-rounded values of groups c*CG ..); per 128-group amax ->
    # scale = amax / 448, q = y / scale (IEEE division, as fp8linear.quant), scales M-major:
    # s[kb * s_ld + row]
    g = tl.reshape(y, (CG, 128))
    amax = tl.maximum(tl.max(tl.abs(g), axis=1), 1e-10)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    q = tl.math.div_rn(g, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
    kbs = c * CG + tl.arange(0, CG)
    cols = kbs[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(q_ptr + row * K + cols, q, mask=cols < K)
    tl.store(s_ptr + kbs * s_ld + row, scale, mask=kbs * 128 < K)


@triton.jit
def add_rmsnorm(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, q_ptr, s_ptr, s_ld,
                K: tl.constexpr, KB: tl.constexpr, QUANT: tl.constexpr, CG: tl.constexpr):
    # program (row, c): the row's sum of squares from the whole row (re-read by each of the
    # KB / CG programs of a row: 8 KB from L2), then its CG groups of 128 normalised (and
    # quantised) and stored
    row = tl.program_id(0)
    c = tl.program_id(1)
    cols = tl.arange(0, KB * 128)
    mask = cols < K
    mine = c * CG * 128 + tl.arange(0, CG * 128)
    mmask = mine < K
    tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    xm = tl.load(x_ptr + row * K + mine, mask=mmask, other=0.0).to(tl.float32)
    rm = tl.load(res_ptr + row * K + mine, mask=mmask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + mine, mask=mmask, other=0.0).to(tl.float32)
    tl.extra.cuda.gdc_launch_dependents()
    hf = (x + r).to(tl.bfloat16).to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + 1e-6)
    h = (xm + rm).to(tl.bfloat16)
    tl.store(res_out_ptr + row * K + mine, h, mask=mmask)
    y = ((h.to(tl.float32) * inv).to(tl.bfloat16).to(tl.float32) * w).to(tl.bfloat16)
    if QUANT:
        _group_quant_store(y.to(tl.float32), row, c, q_ptr, s_ptr, s_ld, K, CG)
    else:
        tl.store(y_ptr + row * K + mine, y, mask=mmask)


@triton.jit
def silu_mul(gu_ptr, y_ptr, q_ptr, s_ptr, s_ld, F: tl.constexpr, QUANT: tl.constexpr,
             CG: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * CG * 128 + tl.arange(0, CG * 128)
    mask = cols < F
    tl.extra.cuda.gdc_wait()
    g = tl.load(gu_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    tl.extra.cuda.gdc_launch_dependents()
    y = (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16)
    if QUANT:
        _group_quant_store(y.to(tl.float32), row, c, q_ptr, s_ptr, s_ld, F, CG)
    else:
        tl.store(y_ptr + row * F + cols, y, mask=mask)


def _quant_bufs(m, k, dev):
    kb = k // 128
    ld = (m + 3) // 4 * 4
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
    st = torch.empty(kb, ld, dtype=torch.float32, device=dev)
    return q, st, st[:, :m].t()


class Layer:
    def __init__(self, g):
        def lin(n, k):
            w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
            return fp8linear.quantize_weight(w)
        self.w = [lin(n, k) for n, k in ((QKV, H), (H, H), (2 * FFN, H), (H, FFN))]
        self.n1 = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
        self.n2 = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()


CG = int(os.environ.get("CG", "4"))  # groups of 128 a program (the row split KB / CG ways)


def norm(x, res, w, quant, bufs):
    m = x.shape[0]
    res_out = torch.empty_like(x)
    kb = H // 128
    grid = (m, kb // CG)
    if quant:
        q, st, s = bufs
        add_rmsnorm[grid](x, res, w, x, res_out, q, st, st.stride(0), K=H, KB=kb, QUANT=True,
                          CG=CG, num_warps=4, launch_pdl=True)
        return (q, s), res_out
    y = torch.empty_like(x)
    add_rmsnorm[grid](x, res, w, y, res_out, y, y, 0, K=H, KB=kb, QUANT=False, CG=CG,
                      num_warps=4, launch_pdl=True)
    return y, res_out


def act(gu, quant, bufs):
    m = gu.shape[0]
    grid = (m, FFN // 128 // CG)
    if quant:
        q, st, s = bufs
        silu_mul[grid](gu, gu, q, st, st.stride(0), F=FFN, QUANT=True, CG=CG, num_warps=4,
                       launch_pdl=True)
        return q, s
    y = torch.empty(m, FFN, dtype=gu.dtype, device=gu.device)
    silu_mul[grid](gu, y, y, y, 0, F=FFN, QUANT=False, CG=CG, num_warps=4, launch_pdl=True)
    return y


def gemm(a, w, fused):
    return fp8linear.block_fp8_gemm(a[0], a[1], *w) if fused else fp8linear.fp8_linear(a, *w)


def step(layers, x, fused, bufs):
    res = torch.zeros_like(x)
    for L in layers:
        a, res = norm(x, res, L.n1, fused, bufs["h"])
        qkv = gemm(a, L.w[0], fused)
        att = qkv[:, :H] * torch.sigmoid(qkv[:, H:H + 1].float()).to(qkv.dtype)  # no PDL
        o = fp8linear.fp8_linear(att, *L.w[1])
        a, res = norm(o, res, L.n2, fused, bufs["h"])
        gu = gemm(a, L.w[2], fused)
        x = gemm(act(gu, fused, bufs["f"]), L.w[3], fused)
    return x + res


def main():
    ms = [int(v) for v in os.environ.get("MS", "1,4,16,32,64").split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(g) for _ in range(LAYERS)]
    print(f"{'M':>4} {'today':>9} {'fused':>9} {'fused/today':>11} rel_diff", flush=True)
    for m in ms:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(m))
        bufs = {"h": _quant_bufs(m, H, "cuda"), "f": _quant_bufs(m, FFN, "cuda")}
        graphs, outs = {}, {}
        for name in ("today", "fused"):
            fused = name == "fused"
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step(layers, x, fused, bufs)
            torch.cuda.current_stream().wait_stream(s)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                outs[name] = step(layers, x, fused, bufs)
            graphs[name] = gr
        # interleaved replays between CUDA events (benchmarks/common.py), us per layer
        times = C.time_graphs_interleaved(graphs, 30)
        med = {n: statistics.median(t) / LAYERS for n, t in times.items()}
        a, b = outs["today"].float(), outs["fused"].float()
        diff = float((a - b).norm() / a.norm())
        print(f"{m:>4} {med['today']:9.2f} {med['fused']:9.2f} "
              f"{med['fused'] / med['today']:11.3f} {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
