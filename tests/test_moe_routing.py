"""fp8linear.moe_routing: the expert-sorted rows (route), the fixed-order combine, and the
whole sorted pipeline on the reference grouped GEMM against moe_reference, bit for bit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8linear import quantize_activation, quantize_weight
from fp8linear.backends import reference
from fp8linear.moe import moe_reference
from fp8linear.moe_routing import combine, gather_quant, max_tiles, route, sorted_moe


def _ids(m, k, e, gen, routing):
    if routing == "one_expert":  # expert 3 takes every token (and experts 4.. the other slots)
        return (torch.arange(k) + 3).repeat(m, 1)
    if routing == "few":
        return torch.randint(0, 2, (m, 1), generator=gen).repeat(1, k) * 0 + torch.arange(k)
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)])


@pytest.mark.parametrize("m,k,e,tile,routing", [
    (1, 8, 128, 8, "random"), (5, 3, 6, 8, "random"), (64, 8, 128, 16, "random"),
    (33, 2, 8, 32, "random"), (40, 2, 8, 8, "one_expert"), (17, 2, 16, 64, "few"),
    (300, 8, 16, 128, "random")])
def test_route_places_every_slot_in_its_experts_tile(m, k, e, tile, routing):
    gen = torch.Generator().manual_seed(m * 7 + k)
    ids = _ids(m, k, e, gen, routing)
    r = route(ids, e, tile)
    assert r.tile_expert.dtype == torch.int32
    assert r.rows == max_tiles(m * k, e, tile) * tile == r.tile_expert.numel() * tile
    rows = r.slot_row.reshape(-1)
    assert rows.unique().numel() == m * k                        # one row a slot
    assert torch.equal(r.tile_expert[rows // tile].long(), ids.reshape(-1))  # its expert's tile
    assert torch.equal(r.row_token[rows], torch.arange(m * k) // k)          # and its token
    assert int((r.row_token >= 0).sum()) == m * k                # every other row is padding
    # tiles: each used expert's tiles contiguous, ascending experts, unused ones (-1) last
    used = r.tile_expert[r.tile_expert >= 0]
    assert torch.all(used[1:] >= used[:-1])
    assert torch.equal(used.unique(), ids.unique().to(torch.int32))
    n_used = used.numel()
    assert torch.all(r.tile_expert[n_used:] == -1)
    # within an expert: ascending (token, slot)
    for ex in ids.unique().tolist():
        slots = (ids.reshape(-1) == ex).nonzero().flatten()
        assert torch.all(rows[slots][1:] > rows[slots][:-1])


@pytest.mark.parametrize("m,k,e,tile", [(1, 8, 128, 8), (40, 2, 8, 16), (300, 8, 16, 128)])
def test_route_gives_slots_held_elsewhere_no_row(m, k, e, tile):
    # expert parallelism: -1 slots take no row; the others sit where the routing of those
    # slots alone puts them
    gen = torch.Generator().manual_seed(m + k)
    ids = _ids(m, k, e, gen, "random")
    away = torch.rand(m, k, generator=gen) < 0.5
    r = route(ids.masked_fill(away, -1), e, tile)
    assert torch.all(r.slot_row[away] == -1)
    assert r.rows == max_tiles(m * k, e, tile) * tile  # (the bound of all the slots)
    here = r.slot_row[~away]
    assert here.unique().numel() == here.numel() == int((r.row_token >= 0).sum())
    assert torch.equal(r.tile_expert[here // tile].long(), ids[~away])
    assert torch.equal(r.row_token[here], (torch.arange(m * k) // k).view(m, k)[~away])
    used = r.tile_expert[r.tile_expert >= 0]
    assert torch.equal(used.unique(), ids[~away].unique().to(torch.int32))
    assert torch.all(r.tile_expert[used.numel():] == -1)
    # every slot of one token held elsewhere: nothing routed, every tile unused
    none = route(torch.full((m, k), -1), e, tile)
    assert torch.all(none.slot_row == -1) and torch.all(none.tile_expert == -1)
    assert torch.all(none.row_token == -1)


def test_combine_sums_the_slots_in_order_in_fp32():
    y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [1e8, -1e8], [5.0, 6.0]])
    r = route(torch.tensor([[0, 1], [1, 0]]), 2, 8)
    y_rows = torch.zeros(r.rows, 2)
    y_rows[r.slot_row.reshape(-1)] = y
    w = torch.tensor([[0.5, 2.0], [1.0, 1.0]])
    out = torch.full((2, 2), float("nan"))
    assert combine(y_rows, r, w, out) is out
    assert torch.equal(out, torch.tensor([[0.5 + 6.0, 1.0 + 8.0], [1e8 + 5.0, -1e8 + 6.0]]))
    half = combine(y_rows, r, w, torch.empty(2, 2, dtype=torch.bfloat16))
    assert torch.equal(half, out.to(torch.bfloat16))  # fp32 sums, rounded once
    # a slot held elsewhere (-1) adds nothing, whatever its weight
    away = route(torch.tensor([[0, -1], [-1, -1]]), 2, 8)
    y_rows = torch.full((away.rows, 2), float("nan"))
    y_rows[away.slot_row[0, 0]] = y[0]
    w = torch.tensor([[0.5, float("nan")], [float("inf"), 1.0]])
    assert torch.equal(combine(y_rows, away, w, torch.empty(2, 2)),
                       torch.tensor([[0.5, 1.0], [0.0, 0.0]]))


def test_gather_quant_zeroes_padding_rows():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    r = route(torch.tensor([[1], [0], [1]]), 2, 8)
    q, scale = gather_quant(x, r)
    assert q.shape == (r.rows, 256) and scale.shape == (r.rows, 2)
    real = r.row_token >= 0
    assert torch.equal(q[~real].float(), torch.zeros(int((~real).sum()), 256))
    assert torch.equal(scale[~real], torch.zeros(int((~real).sum()), 2))
    xq, xs = quantize_activation(x)
    assert torch.equal(q[real].view(torch.uint8), xq[r.row_token[real]].view(torch.uint8))
    assert torch.equal(scale[real], xs[r.row_token[real]])


def _experts(num, n, k, gen):
    ws, ss = zip(*(quantize_weight(torch.randn(n, k, generator=gen) * 0.05) for _ in range(num)))
    return torch.stack(ws), torch.stack(ss)


@pytest.mark.parametrize("m,k,e,h,inter,tile,routing,dtype", [
    (1, 2, 8, 256, 128, 8, "random", torch.bfloat16),
    (9, 4, 16, 200, 256, 8, "random", torch.float16),         # H off the 128 grid
    (16, 2, 8, 128, 128, 16, "one_expert", torch.bfloat16),
    (12, 2, 16, 256, 128, 32, "few", torch.bfloat16)])
def test_sorted_pipeline_is_moe_reference_bit_for_bit(m, k, e, h, inter, tile, routing, dtype):
    gen = torch.Generator().manual_seed(m + 100 * k)
    x = torch.randn(m, h, generator=gen).to(dtype)
    w13, s13 = _experts(e, 2 * inter, h, gen)
    w2, s2 = _experts(e, h, inter, gen)
    ids = _ids(m, k, e, gen, routing)
    wts = torch.softmax(torch.randn(m, k, generator=gen), 1)
    got = sorted_moe(x, w13, s13, w2, s2, wts, ids, tile, reference.moe_stages())
    want = moe_reference(x, w13, s13, w2, s2, wts, ids)
    assert got.dtype == dtype and torch.equal(got, want)
    # with slots held elsewhere (-1, expert parallelism)
    ids = ids.masked_fill(torch.rand(m, k, generator=gen) < 0.4, -1)
    got = sorted_moe(x, w13, s13, w2, s2, wts, ids, tile, reference.moe_stages())
    assert torch.equal(got, moe_reference(x, w13, s13, w2, s2, wts, ids))


def _small_layer(seed: int):
    """(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids): 20 bf16 tokens, 8 experts,
    top-2, hidden and intermediate 256."""
    gen = torch.Generator().manual_seed(seed)
    m, k, e, h, inter = 20, 2, 8, 256, 256
    x = torch.randn(m, h, generator=gen).to(torch.bfloat16)
    w13, s13 = _experts(e, 2 * inter, h, gen)
    w2, s2 = _experts(e, h, inter, gen)
    ids, wts = _ids(m, k, e, gen, "random"), torch.softmax(torch.randn(m, k, generator=gen), 1)
    return x, w13, s13, w2, s2, wts, ids


def test_a_fused_gate_up_stage_replaces_the_gemm_and_silu_mul():
    # Stages.gate_up_silu_quant (a backend's gate_up GEMM with SiLU-and-mul + quantization in
    # its epilogue) runs in place of gate_up's grouped GEMM and the silu_mul_quant stage
    args = _small_layer(5)
    st, ran = reference.moe_stages(), []

    def gate_up_silu_quant(a, a_scale, w, w_scale, r, dtype):
        gate_up = torch.empty(r.rows, w.shape[1], dtype=dtype)
        st.grouped_gemm(a, a_scale, w, w_scale, r, gate_up, 0)
        ran.append(dtype)
        return st.silu_mul_quant(gate_up, r)

    def down_only(a, a_scale, w, w_scale, r, out, which):
        assert which == 1
        st.grouped_gemm(a, a_scale, w, w_scale, r, out, which)

    def no_silu(gate_up, r):
        raise AssertionError("the fused stage took its place")
    fused = dataclasses.replace(st, grouped_gemm=down_only, silu_mul_quant=no_silu,
                                gate_up_silu_quant=gate_up_silu_quant)
    got = sorted_moe(*args, 32, fused)
    assert ran == [torch.bfloat16]
    assert torch.equal(got, moe_reference(*args))


def test_a_gate_up_reading_tokens_replaces_the_gather():
    # Stages.gate_up_reads_tokens: gate_up's GEMM takes x itself (a_scale None) and quantizes
    # its rows' tokens (row_token) itself; no gather runs, and the layer is the same
    args = _small_layer(6)
    x = args[0]
    st, took = reference.moe_stages(), []

    def gemm(a, a_scale, w, w_scale, r, out, which):
        took.append((which, a_scale is None and a is x))
        if a_scale is None:
            a, a_scale = st.gather_quant(a, r)
        st.grouped_gemm(a, a_scale, w, w_scale, r, out, which)

    def no_gather(x, r):
        raise AssertionError("gate_up reads its tokens itself")
    reads = dataclasses.replace(st, grouped_gemm=gemm, gather_quant=no_gather,
                                gate_up_reads_tokens=True)
    got = sorted_moe(*args, 8, reads)
    assert took == [(0, True), (1, False)]
    assert torch.equal(got, moe_reference(*args))
