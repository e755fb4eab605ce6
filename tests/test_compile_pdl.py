"""fp8_linear inside torch.compile'd decoder blocks whose Inductor kernels launch with PDL
(``triton.enable_pdl``, what the vLLM plugin turns on): the neighbours of every GEMM then let
it start early and start early after it, so a missed wait on either side would show as
results that change from run to run. Checked: bitwise-identical outputs over repeated runs
(eager launches and CUDA-graph replays) and agreement with the same blocks compiled without
PDL and run eagerly. GPU only."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8linear import FP8Linear

pytestmark = pytest.mark.gpu

HIDDEN, FFN, LAYERS = 1024, 2816, 4


def _rms(x, w):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


class Block(nn.Module):
    """A Llama-like layer's kernel sequence: add + RMSNorm -> GEMM -> elementwise -> GEMM ->
    add + RMSNorm -> GEMM -> SiLU-and-mul -> GEMM."""

    def __init__(self, g):
        super().__init__()
        def lin(n, k):
            layer = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
            with torch.no_grad():
                layer.weight.normal_(0, k ** -0.5, generator=g)
            return FP8Linear.from_linear(layer)
        self.qkv, self.o = lin(2 * HIDDEN, HIDDEN), lin(HIDDEN, HIDDEN)
        self.gate_up, self.down = lin(2 * FFN, HIDDEN), lin(HIDDEN, FFN)
        self.n1 = nn.Parameter(torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda"))
        self.n2 = nn.Parameter(torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda"))

    def forward(self, x, res):
        res = x + res
        q, v = self.qkv(_rms(res, self.n1)).chunk(2, -1)
        res = self.o(torch.tanh(q) * v) + res
        g, u = self.gate_up(_rms(res, self.n2)).chunk(2, -1)
        return self.down(torch.nn.functional.silu(g) * u), res


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(0)
        self.blocks = nn.ModuleList(Block(g) for _ in range(LAYERS))

    def forward(self, x):
        res = torch.zeros_like(x)
        for b in self.blocks:
            x, res = b(x, res)
        return x + res


def _inductor_has_pdl() -> bool:
    # the plugin's own check, loaded from its file: the GPU machine runs the tests from the
    # source tree, where the plugin package (fp8linear_vllm, integrations/vllm) is not
    # installed (it imports torch and fp8linear only)
    path = Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "compile_config.py"
    spec = importlib.util.spec_from_file_location("_fp8linear_compile_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.inductor_has_pdl()


@pytest.fixture(scope="module")
def stack():
    if not _inductor_has_pdl():
        pytest.skip("this torch's Inductor has no triton.enable_pdl")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    return Stack().eval()


@pytest.mark.parametrize("m", [1, 4, 16, 64, 160, 512])
def test_inductor_pdl_neighbours_deterministic(stack, m):
    torch._dynamo.reset()
    pdl = torch.compile(stack, options={"triton.enable_pdl": True}, dynamic=False)
    plain = torch.compile(stack, options={"triton.enable_pdl": False}, dynamic=False)
    x = torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(m))
    with torch.no_grad():
        ref = plain(x).float()
        first = pdl(x).clone()
        assert torch.isfinite(first).all()
        err = ((first.float() - ref).norm() / ref.norm()).item()
        # same kernels, same order: only Inductor's own reduction configs may differ
        print(f"M={m}: Inductor PDL vs without: rel err {err:.2e}")
        assert err < 1e-2, err
        for _ in range(30):
            assert torch.equal(pdl(x), first), "eager runs with Inductor PDL differ"
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            pdl(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            out = pdl(x)
        for _ in range(30):
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, first), "CUDA-graph replays with Inductor PDL differ"
