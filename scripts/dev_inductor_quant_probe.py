"""Device probe: activation quantization written in torch ops, for Inductor to fuse into the
kernel before the GEMM, against fp8_linear's own quantization (fused into the decode kernel
at <= 16 tokens, else our separate quant kernel).

Llama-3.1-8B-shaped layers without attention (add + RMSNorm -> qkv -> a stand-in elementwise
op -> o_proj -> add + RMSNorm -> gate_up -> SiLU-and-mul -> down), LAYERS distinct layers
(> L2), compiled with Inductor's triton.enable_pdl as the vLLM plugin sets it, one CUDA graph
per variant, replays interleaved. Variants:
  linear  FP8Linear's fp8_linear custom op
  native  quantize_activation's torch ops (scales written M-major, ld % 4 == 0) traced into
          the graph, then the block_fp8_gemm custom op
Prints us per layer, the Inductor kernel count, and the outputs' agreement.
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import common as C  # noqa: E402
import fp8linear  # noqa: E402
from fp8linear.quant import AMAX_EPS, BLOCK, FP8_DTYPE, FP8_MAX  # noqa: E402

H, FFN, QKV = 4096, 14336, 6144
LAYERS = int(os.environ.get("LAYERS", "4"))


def native_quant(x):
    """quantize_activation in torch ops, scales [M, Kb] M-major with ld = M rounded up to 4."""
    m, k = x.shape
    kb = k // BLOCK
    g = x.float().view(m, kb, BLOCK)
    amax = g.abs().amax(-1).clamp(min=AMAX_EPS)
    s = amax / FP8_MAX
    q = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, k)
    ld = (m + 3) // 4 * 4
    st = F.pad(s.t(), (0, ld - m))          # [Kb, ld] contiguous
    return q, st[:, :m].t()


def rms(x, w):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


class Layer(torch.nn.Module):
    def __init__(self, g, native):
        super().__init__()
        self.native = native

        def lin(n, k):
            w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
            q, s = fp8linear.quantize_weight(w)
            return torch.nn.Parameter(q, requires_grad=False), torch.nn.Parameter(
                s, requires_grad=False)
        self.w = torch.nn.ParameterList()
        for n, k in ((QKV, H), (H, H), (2 * FFN, H), (H, FFN)):
            self.w.extend(lin(n, k))
        self.n1 = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16, device="cuda"))
        self.n2 = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16, device="cuda"))

    def mm(self, x, i):
        w, s = self.w[2 * i], self.w[2 * i + 1]
        if self.native:
            q, qs = native_quant(x)
            return fp8linear.block_fp8_gemm(q, qs, w, s)
        return fp8linear.fp8_linear(x, w, s)

    def forward(self, x, res):
        res = x + res
        qkv = self.mm(rms(res, self.n1), 0)
        a = qkv[:, :H] * torch.sigmoid(qkv[:, H:H + 1024].repeat(1, 4))  # stand-in attention
        res = self.mm(a.contiguous(), 1) + res
        gu = self.mm(rms(res, self.n2), 2)
        return self.mm(F.silu(gu[:, :FFN]) * gu[:, FFN:], 3), res


class Stack(torch.nn.Module):
    def __init__(self, native):
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer(g, native) for _ in range(LAYERS))

    def forward(self, x):
        res = torch.zeros_like(x)
        for layer in self.layers:
            x, res = layer(x, res)
        return x + res


def graph_of(fn, x):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x)
    return g, out


def main():
    ms = [int(v) for v in os.environ.get("MS", "1,4,16,32,64").split(",")]
    from torch._inductor import metrics
    stacks = {name: Stack(name == "native").eval() for name in ("linear", "native")}
    # same weights in both (same generator seed)
    print(f"{'M':>4} {'linear':>9} {'native':>9} {'native/linear':>13} kernels(l/n) rel_diff",
          flush=True)
    for m in ms:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(m))
        graphs, outs, kernels = {}, {}, {}
        for name, st in stacks.items():
            torch._dynamo.reset()
            metrics.reset()
            fn = torch.compile(st, options={"triton.enable_pdl": True}, dynamic=False)
            with torch.no_grad():
                graphs[name], outs[name] = graph_of(fn, x)
            kernels[name] = metrics.generated_kernel_count
        # interleaved replays between CUDA events (benchmarks/common.py), us per layer
        times = C.time_graphs_interleaved(graphs, 30)
        med = {n: statistics.median(t) / LAYERS for n, t in times.items()}
        a, b = outs["linear"].float(), outs["native"].float()
        diff = float((a - b).norm() / a.norm())
        print(f"{m:>4} {med['linear']:9.2f} {med['native']:9.2f} "
              f"{med['native'] / med['linear']:13.3f} {kernels['linear']}/{kernels['native']}"
              f" {diff:.2e}", flush=True)
    # the kernel sequence of one layer, each variant (M = 16)
    from torch.profiler import ProfilerActivity, profile
    for name, st in stacks.items():
        torch._dynamo.reset()
        fn = torch.compile(st.layers[0], options={"triton.enable_pdl": True}, dynamic=False)
        x = torch.randn(16, H, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            fn(x, x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn(x, x)
                torch.cuda.synchronize()
        ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{name}: {len(ks)} kernels: " + " | ".join(
            f"{e.name[:60]} {e.device_time:.1f}" for e in ks), flush=True)


if __name__ == "__main__":
    main()
