"""integrations/vllm/norm_quant_pass.py on graphs made of vLLM's IR norm ops and our linear op
(the post-grad form vLLM hands its custom passes), run on the CPU: the rewritten graph must
compute bit-identical results, and graphs the pass must not touch stay as they were."""
from __future__ import annotations

import operator

import pytest
import torch

pytest.importorskip("vllm")
import vllm.ir  # noqa: E402,F401  (registers the vllm_ir ops)
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import fp8linear  # noqa: E402
from fp8linear_vllm.norm_quant_pass import NormQuantPass  # noqa: E402

if not hasattr(torch.ops.vllm_ir, "fused_add_rms_norm"):
    pytest.skip("this vLLM has no IR norm ops", allow_module_level=True)

M, K, N = 6, 256, 384


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).bfloat16()
    return fp8linear.quantize_weight(w)


def _inputs(seed=0, m=M):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    res = torch.randn(m, K, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(K, generator=g)).bfloat16()
    return x, res, nw


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _run(f, args):
    gm = make_fx(f, tracing_mode="fake")(*args)
    ref = gm(*args)
    p = NormQuantPass()
    p(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, p, ref, gm(*args)


def test_decoder_layer_norms_rewritten_bitwise():
    wq, ws = _weights(1)
    wq2, ws2 = _weights(2)
    bias = torch.randn(N).bfloat16()

    def layer(x, res, nw, wq, ws, wq2, ws2, bias):
        y, r = torch.ops.vllm_ir.fused_add_rms_norm.default(x, res, nw, 1e-6, None)
        a = torch.ops.fp8linear.fp8_linear.default(y, wq, ws, None)
        b = torch.ops.fp8linear.fp8_linear.default(y, wq2, ws2, bias)  # two linears, one norm
        y2 = torch.ops.vllm_ir.rms_norm.default(r, nw, 1e-5, None)
        c = torch.ops.fp8linear.fp8_linear.default(y2, wq, ws, None)
        return a, b, c, r

    args = (*_inputs(), wq, ws, wq2, ws2, bias)
    gm, p, ref, got = _run(layer, args)
    assert p.rewritten == 2
    targets = _targets(gm)
    assert torch.ops.fp8linear.fp8_linear.default not in targets
    assert torch.ops.vllm_ir.fused_add_rms_norm.default not in targets
    assert torch.ops.vllm_ir.rms_norm.default not in targets
    assert targets.count(torch.ops.fp8linear.block_fp8_gemm_scale_t.default) == 3
    assert targets.count(torch.ops.fp8linear.add_rms_norm_quant.default) == 1
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_norms_with_other_users_are_left_alone():
    wq, ws = _weights(3)

    def f(x, res, nw, wq, ws):
        y, r = torch.ops.vllm_ir.fused_add_rms_norm.default(x, res, nw, 1e-6, None)
        a = torch.ops.fp8linear.fp8_linear.default(y, wq, ws, None)
        y2 = torch.ops.vllm_ir.rms_norm.default(r, nw, 1e-6, None)
        return a, y * 2, torch.ops.fp8linear.fp8_linear.default(y2[:, :128].contiguous(),
                                                                 wq[:, :128].contiguous(),
                                                                 ws[:, :1].contiguous(), None)

    args = (*_inputs(4), wq, ws)
    gm, p, ref, got = _run(f, args)
    assert p.rewritten == 0            # y feeds a multiply too; y2 feeds a slice
    assert torch.ops.vllm_ir.fused_add_rms_norm.default in _targets(gm)
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_channels_not_a_multiple_of_128_are_left_alone():
    g = torch.Generator().manual_seed(5)
    wq, ws = fp8linear.quantize_weight(torch.randn(N, 144, generator=g).bfloat16())

    def f(x, nw, wq, ws):
        y = torch.ops.vllm_ir.rms_norm.default(x, nw, 1e-6, None)
        return torch.ops.fp8linear.fp8_linear.default(y, wq, ws, None)

    args = (torch.randn(M, 144, generator=g).bfloat16(), torch.ones(144).bfloat16(), wq, ws)
    gm, p, ref, got = _run(f, args)
    assert p.rewritten == 0 and torch.equal(ref, got)


def test_uuid_follows_the_fused_kernel_sources():
    p = NormQuantPass()
    assert p.uuid() == NormQuantPass().uuid() and len(p.uuid()) >= 16
