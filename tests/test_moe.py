"""fp8linear.moe.moe_reference (the MoE layer's numerics) against an fp64 formulation of the
same dequantized math, written from the definition with tests/fp64_reference.py."""
from __future__ import annotations

import pytest
import torch

import fp64_reference as R
from fp8linear import quantize_activation
from moe_cases import experts, layer, topk_ids
from fp8linear.moe import fused_moe, moe_reference


def _fp64_moe(x, w13, s13, w2, s2, weights, ids):
    xq, xs = quantize_activation(x)   # (the activations' quantization: bit-exact elsewhere)
    return R.moe(xq, xs, x.dtype, w13, s13, w2, s2, weights, ids)


CASES = [  # (M, E, top_k, H, I, routing, dtype, per_row)
    (1, 8, 2, 256, 128, "random", torch.bfloat16, False),        # M = 1
    (7, 8, 2, 200, 96, "random", torch.bfloat16, False),         # H and I off the 128 grid
    (16, 16, 4, 384, 256, "one_expert", torch.float16, False),   # one expert takes every token
    (12, 16, 2, 256, 192, "few", torch.bfloat16, True),          # most experts get no token
    (33, 4, 2, 136, 160, "random", torch.float16, True),
]


@pytest.mark.parametrize("m,e,top_k,h,inter,routing,dtype,per_row", CASES)
def test_moe_reference_matches_fp64(m, e, top_k, h, inter, routing, dtype, per_row):
    gen = torch.Generator().manual_seed(m * 1000 + e * 10 + top_k)
    x = R.random_matrix(m, h, gen, spread=1.0).to(dtype)
    w13, s13 = experts(e, 2 * inter, h, gen, per_row)
    w2, s2 = experts(e, h, inter, gen, per_row)
    ids = topk_ids(m, top_k, e, gen, routing)
    weights = torch.softmax(torch.randn(m, top_k, generator=gen), dim=1)
    out = moe_reference(x, w13, s13, w2, s2, weights, ids)
    ref = _fp64_moe(x, w13, s13, w2, s2, weights, ids)
    assert out.dtype == dtype and out.shape == (m, h)
    assert R.rel_err(out, ref) <= 2e-3
    # and it is not the unquantized layer: quantizing the intermediate moves the result
    assert torch.isfinite(out).all() and out.abs().sum() > 0


@pytest.mark.parametrize("fn", [moe_reference, fused_moe])
def test_slots_of_experts_held_elsewhere_are_skipped(fn):
    # expert parallelism: -1 marks a slot whose expert another rank holds; the layer is the
    # sum over the other slots (weights of -1 slots unread, even NaN), which the fp64
    # formulation gets from expert 0 with weight 0
    gen = torch.Generator().manual_seed(11)
    x, w13, s13, w2, s2, wts, ids = layer(gen, 9, 4, 3, 256, 128)
    ids[torch.rand(ids.shape, generator=gen) < 0.5] = -1
    ids[0] = -1  # a token with no slot here: a zero row
    out = fn(x, w13, s13, w2, s2, wts.masked_fill(ids < 0, float("nan")), ids)
    as_zero = (x, w13, s13, w2, s2, wts.masked_fill(ids < 0, 0.0), ids.clamp(min=0))
    assert torch.equal(out.view(torch.int16), moe_reference(*as_zero).view(torch.int16))
    assert R.rel_err(out, _fp64_moe(*as_zero)) <= 2e-3
    assert torch.equal(out[0], torch.zeros(256, dtype=out.dtype))


def test_moe_reference_is_deterministic_and_routing_sensitive():
    x, w13, s13, w2, s2, wts, ids = layer(torch.Generator().manual_seed(5), 9, 4, 2, 128, 128)
    a = moe_reference(x, w13, s13, w2, s2, wts, ids)
    assert torch.equal(a.view(torch.int16), moe_reference(x, w13, s13, w2, s2, wts, ids)
                       .view(torch.int16))
    assert not torch.equal(a, moe_reference(x, w13, s13, w2, s2, wts, (ids + 1) % 4))


@pytest.mark.parametrize("fn", [moe_reference, fused_moe])
def test_errors_name_the_tensor(fn):
    gen = torch.Generator().manual_seed(1)
    w13, s13 = experts(2, 256, 128, gen)
    w2, s2 = experts(2, 128, 128, gen)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    ids = torch.zeros(3, 1, dtype=torch.int64)
    wts = torch.ones(3, 1)
    with pytest.raises(ValueError, match=r"^topk_ids must be expert ids in 0\.\.1 or -1, got "
                                         r"values from 0 to 2$"):
        fn(x, w13, s13, w2, s2, wts, torch.tensor([[0], [2], [1]]))
    with pytest.raises(ValueError, match=r"^topk_ids must be expert ids in 0\.\.1 or -1, got "
                                         r"values from -2 to 1$"):
        fn(x, w13, s13, w2, s2, wts, torch.tensor([[0], [-2], [1]]))
    with pytest.raises(ValueError, match=r"^w2 must be float8_e4m3fn \[2, 128, 128\], got "
                                         r"\(2, 128, 64\) torch.float8_e4m3fn$"):
        fn(x, w13, s13, w2[:, :, :64], s2, wts, ids)
    with pytest.raises(ValueError, match=r"^w13_scale must be fp32 of shape \(2, 2, 1\) "
                                         r"\(128x128 blocks\) or \(2, 256, 1\) \(per row\), got "
                                         r"\(2, 1, 1\) torch.float32$"):
        fn(x, w13, s13[:, :1], w2, s2, wts, ids)
    with pytest.raises(ValueError, match=r"^topk_weights must have topk_ids' shape \(3, 1\), "
                                         r"got \(3, 2\)$"):
        fn(x, w13, s13, w2, s2, torch.ones(3, 2), ids)
    with pytest.raises(ValueError, match=r"^topk_weights must be contiguous \(shape \(3, 2\), "
                                         r"strides \(1, 3\)\)$"):
        fn(x, w13, s13, w2, s2, torch.ones(2, 3).t(), torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^topk_ids must be on x's device cpu, got meta$"):
        fn(x, w13, s13, w2, s2, wts, ids.to("meta"))


def test_fused_moe_on_the_cpu_is_the_reference():
    x, w13, s13, w2, s2, wts, ids = layer(torch.Generator().manual_seed(11), 6, 4, 2, 256, 128)
    assert torch.equal(fused_moe(x, w13, s13, w2, s2, wts, ids),
                       moe_reference(x, w13, s13, w2, s2, wts, ids))
    assert fused_moe(x[:0], w13, s13, w2, s2, wts[:0], ids[:0]).shape == (0, 256)


def test_fused_moe_writes_into_out():
    x, w13, s13, w2, s2, wts, ids = layer(torch.Generator().manual_seed(13), 6, 4, 2, 256, 128)
    out = torch.full_like(x, float("nan"))
    assert fused_moe(x, w13, s13, w2, s2, wts, ids, out=out) is out
    assert torch.equal(out, moe_reference(x, w13, s13, w2, s2, wts, ids))
    # a wrong out is refused before anything is written
    for bad, got in ((torch.empty(6, 128, dtype=x.dtype), r"\(6, 128\) torch.bfloat16 on cpu"),
                     (torch.empty(6, 256), r"\(6, 256\) torch.float32 on cpu"),
                     (torch.full((256, 6), 7.0, dtype=x.dtype).t(),
                      r"\(6, 256\) torch.bfloat16 on cpu \(not contiguous\)")):
        with pytest.raises(ValueError, match=r"^out must be a contiguous torch.bfloat16 tensor "
                                             r"of x's shape \(6, 256\) on cpu, got " + got + "$"):
            fused_moe(x, w13, s13, w2, s2, wts, ids, out=bad)
    assert torch.all(bad == 7.0)


def test_fused_moe_compiles_as_one_opaque_op():
    x, w13, s13, w2, s2, wts, ids = layer(torch.Generator().manual_seed(12), 5, 4, 2, 256, 128)
    compiled = torch.compile(fused_moe, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w13, s13, w2, s2, wts, ids),
                       moe_reference(x, w13, s13, w2, s2, wts, ids))
    graph = torch._dynamo.explain(fused_moe)(x, w13, s13, w2, s2, wts, ids)
    assert graph.graph_count == 1 and graph.graph_break_count == 0
    out = torch.empty_like(x)  # into a given out: the op mutates it
    compiled(x, w13, s13, w2, s2, wts, ids, out=out)
    assert torch.equal(out, moe_reference(x, w13, s13, w2, s2, wts, ids))
