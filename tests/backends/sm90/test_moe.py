"""backends/sm90/moe.py: the MoE layer on the grouped expert GEMMs against the fp64
formulation of the same dequantized math, NaN-poisoned scratch, run to run, and under a CUDA
graph (GPU); the stages a plan runs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fp64_reference as R
from fp8linear import quantize_activation
from fp8linear.backends import dispatch
from fp8linear.backends.sm90 import moe_plan as sm90_plan
from fp8linear.backends.sm90.moe_plan import choose
from fp8linear.backends.sm90.tiles import GEMM_TILES, MOE_PREFILL_CONFIGS
from fp8linear.moe import fused_moe, moe_reference
from fp8linear.quant import scale_view
from moe_cases import EDGE_COUNTS, experts, layer, topk_ids

GPU_CASES = [  # (M, E, top_k, H, I, routing, dtype)
    (1, 8, 2, 256, 128, "random", torch.bfloat16),          # M = 1
    (1, 128, 8, 512, 256, "random", torch.bfloat16),        # decode of a wide MoE
    (5, 16, 4, 208, 128, "random", torch.float16),          # H off the 128 grid
    (40, 8, 2, 384, 256, "one_expert", torch.bfloat16),     # one expert takes every token
    (24, 32, 2, 256, 384, "few", torch.float16),            # most experts get no token
    (64, 16, 4, 1024, 256, "random", torch.bfloat16),       # split K
    (300, 8, 2, 512, 512, "random", torch.bfloat16),        # many tokens an expert: prefill
    (200, 16, 8, 256, 128, "random", torch.bfloat16),       # 1600 slots: parallel routing
]
# slot tiles (a tile a (token, slot) pair, the rule for one token), forced for several tokens:
# experts shared by pairs, one expert taking every token, H off the 128 grid, split K, fp16,
# int32 ids (the last field)
SLOT_CASES = [  # (the 1 x 208 output of one 128-channel h group a pair: 1.1% at the layer
    # level with I = 128, its GEMMs within 2e-3; the layer's 1e-2 needs more groups)
    (1, 16, 4, 208, 256, "random", torch.float16, torch.int64),
    (3, 8, 2, 384, 256, "one_expert", torch.bfloat16, torch.int32),
    (6, 16, 4, 1024, 256, "random", torch.bfloat16, torch.int64),
    (2, 128, 8, 512, 384, "random", torch.float16, torch.int32),
]
# the prefill kernel forced where the rules would not pick it: one token, many unused tiles,
# one expert taking every token, fp16; experts' last tiles with 63-65 and 127-129 rows
PREFILL_CASES = [
    (1, 8, 2, 256, 128, "random", torch.bfloat16),
    (sum(EDGE_COUNTS), 8, 1, 256, 256, "edges", torch.bfloat16),
    (24, 32, 2, 256, 384, "few", torch.float16),
    (200, 8, 2, 384, 256, "one_expert", torch.bfloat16),
    (96, 16, 4, 1024, 256, "random", torch.float16),
]


def _poison_cache():
    # the layer's scratch (sorted rows, GEMM outputs) comes from torch's caching allocator:
    # fill the memory it will hand out with NaN, so any row the kernels fail to write shows
    torch.cuda.empty_cache()
    torch.full((64 << 20,), float("nan"), device="cuda")


def _bitwise_alike(args, want_pieces: dict, got_pieces: dict):
    """fused_moe(*args) with got_pieces forced (backends.sm90.moe_plan.forced), on NaN-poisoned
    scratch: finite and bitwise that with want_pieces forced. Returns it."""
    with sm90_plan.forced(**want_pieces):
        want = fused_moe(*args)
    _poison_cache()
    with sm90_plan.forced(**got_pieces):
        got = fused_moe(*args)
    assert torch.isfinite(got).all()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    return got


def _assert_rows_match_fp64(a64, experts, w, w_scale, got):
    """got's row i against fp64 a64[i] times expert experts[i]'s dequantized weights."""
    ids = torch.tensor(experts)
    ref = torch.empty(len(experts), w.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():  # (each expert dequantized once, its rows in one product)
        rows = (ids == e).nonzero().flatten()
        ref[rows] = a64[rows] @ R.dequant(w[e].cpu(), w_scale[e].cpu()).t()
    got = got.cpu().double()
    assert torch.isfinite(got).all()
    assert R.rel_err(got, ref) <= 2e-3, R.rel_err(got, ref)


def _check_grouped(calls):
    """Each grouped GEMM's output rows of real tokens against fp64 of its own inputs. gate_up
    with SiLU-and-mul + quantization in its epilogue (out: (fp8 h, its scales, gate_up)):
    gate_up (the same kernel without the epilogue) against fp64, h against silu_mul_quant of
    that gate_up (fp8 rounding would turn gate_up's last-bit differences from fp64 into
    whole fp8 steps)."""
    from fp8linear import silu_mul_quant
    for a, a_scale, w, w_scale, r, out in calls:
        rows = (r.row_token >= 0).nonzero().flatten().cpu()
        experts = r.tile_expert.cpu()[rows // r.token_tile].long().tolist()
        if a_scale is None:  # (gate_up reading its rows' tokens, moe-token-rows: a is x)
            a64 = R.dequant(*quantize_activation(a.cpu()[r.row_token.cpu()[rows]]))
        else:
            a64 = R.dequant(a.cpu()[rows], a_scale.cpu()[rows])
        hq, h_scale, out = out if isinstance(out, tuple) else (None, None, out)
        _assert_rows_match_fp64(a64, experts, w, w_scale, out.cpu()[rows])
        if hq is None:
            continue
        want_q, want_st = silu_mul_quant(out[rows.cuda()])
        want = R.dequant(want_q.cpu(), scale_view(want_st, len(rows)).cpu())
        got_q, got = hq.cpu()[rows], R.dequant(hq.cpu()[rows], h_scale.cpu()[rows])
        assert torch.isfinite(got).all()
        # (silu's exp and division on the GPU against torch's may move a value by an fp8 step)
        same = (got_q.view(torch.uint8) == want_q.cpu().view(torch.uint8)).float().mean()
        assert same >= 0.999 and R.rel_err(got, want) <= 1e-3, (same, R.rel_err(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("m,e,top_k,h,inter,routing,dtype", GPU_CASES)
def test_fused_moe_matches_fp64(m, e, top_k, h, inter, routing, dtype, monkeypatch):
    _check_case(m, e, top_k, h, inter, routing, dtype, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("ctas", [None, 3])  # (3: moe-slot-three's kernel on small shapes)
@pytest.mark.parametrize("m,e,top_k,h,inter,routing,dtype,ids_dtype", SLOT_CASES)
def test_slot_tiles_match_fp64(m, e, top_k, h, inter, routing, dtype, ids_dtype, ctas,
                               monkeypatch):
    with sm90_plan.forced(slot_tiles=True, ctas=ctas):
        _check_case(m, e, top_k, h, inter, routing, dtype, monkeypatch, ids_dtype=ids_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_act", [True, False])
@pytest.mark.parametrize("m,e,top_k,h,inter,routing,dtype", PREFILL_CASES)
def test_prefill_kernel_matches_fp64(m, e, top_k, h, inter, routing, dtype, fused_act,
                                     monkeypatch):
    # fused_act: gate_up's epilogue writes h = SiLU(gate) * up quantized (the rule), or
    # gate_up for the SiLU-and-mul launch (forced off)
    with sm90_plan.forced(prefill=True, fused_act=fused_act):
        _check_case(m, e, top_k, h, inter, routing, dtype, monkeypatch, prefill=True,
                    fused_act=fused_act)


# the decode kernel's sorted tiles forced where the rules take slot tiles: 8-token tiles whose
# gate_up reads its rows' tokens (moe-token-rows; most experts none, fp16), and past the
# hidden size it takes (H = 2176: the gather)
TOKEN_ROWS_CASES = [
    (24, 32, 2, 256, 384, "few", torch.float16),
    (40, 16, 4, 512, 256, "random", torch.bfloat16),
    (64, 32, 4, 2176, 128, "random", torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,e,top_k,h,inter,routing,dtype", TOKEN_ROWS_CASES)
def test_sorted_tiles_reading_tokens_match_fp64(m, e, top_k, h, inter, routing, dtype,
                                                monkeypatch):
    with sm90_plan.forced(slot_tiles=False, token_tile=8):
        assert (sm90_plan._apply_forced(choose(m, top_k, e, h, inter, 132, False), h, inter)
                .token_rows == (h <= sm90_plan.TOKEN_ROWS_MAX_HIDDEN))
        _check_case(m, e, top_k, h, inter, routing, dtype, monkeypatch, prefill=False)


def _check_slots(calls, x, ids, wts, out):
    """The slot tiles' GEMM outputs (a row a (token, slot) pair, in order) against fp64 of
    their inputs quantized as the kernel does: gate_up of the pair's token row, down of
    SiLU-and-mul of the pair's gate_up row (as the Triton kernel of the sorted layer
    computes it); and the combine into out against the same sum of down's rows in torch."""
    from fp8linear import silu_mul_quant
    from fp8linear.moe_routing import Routing, combine
    (a0, w13, s13, gate_up, kw0), (a1, w2, s2, y, kw1) = calls
    assert not kw0["silu_in"] and kw1["silu_in"] and a0 is x and torch.equal(a1, gate_up)
    experts_of = ids.cpu().flatten().long().tolist()
    tokens = torch.arange(ids.numel()) // ids.shape[1]
    hq, h_scale_t = silu_mul_quant(gate_up)
    _assert_rows_match_fp64(R.dequant(*quantize_activation(x.cpu()[tokens])), experts_of, w13,
                            s13, gate_up)
    _assert_rows_match_fp64(R.dequant(hq.cpu(), scale_view(h_scale_t, len(tokens)).cpu()),
                            experts_of, w2, s2, y)
    in_order = Routing(8, ids.cpu(), tokens, torch.arange(ids.numel()).view(ids.shape), ids.cpu())
    want = combine(y.cpu(), in_order, wts.cpu(), torch.empty(out.shape, dtype=out.dtype)).float()
    # (the same fp32 sum in the same order, one rounding; fused multiply-adds may move the
    # fp32 sum by an ulp, and so its rounding by one step)
    assert torch.allclose(out.cpu().float(), want, rtol=2 ** -7, atol=0), out


def _check_case(m, e, top_k, h, inter, routing, dtype, monkeypatch, prefill=None,
                ids_dtype=torch.int64, fused_act=None):
    from fp8linear.backends.sm90 import library
    from fp8linear.backends.sm90 import moe as sm90_moe
    assert dispatch.moe_backend(torch.device("cuda"), h, inter, True) == "sm90"
    gen = torch.Generator().manual_seed(m * 131 + e)
    x = R.random_matrix(m, h, gen, spread=1.0).to(dtype).cuda()
    w13, s13 = (t.cuda() for t in experts(e, 2 * inter, h, gen))
    w2, s2 = (t.cuda() for t in experts(e, h, inter, gen))
    ids = topk_ids(m, top_k, e, gen, routing).to(ids_dtype).cuda()
    wts = torch.softmax(torch.randn(m, top_k, generator=gen), 1).cuda()
    calls, real = [], sm90_moe.stages
    real_slots = library.Library.grouped_slots

    def spied_slots(self, x, w, w_scale, out, topk_ids, *args, **kw):
        real_slots(self, x, w, w_scale, out, topk_ids, *args, **kw)
        calls.append((x, w, w_scale, out.clone(), kw))
    monkeypatch.setattr(library.Library, "grouped_slots", spied_slots)

    def spied(plan):  # record each grouped GEMM's inputs and output
        if prefill is not None:
            assert plan.prefill == prefill
        if fused_act is not None:
            assert plan.fused_act == fused_act
        st = real(plan)

        def gemm(a, a_scale, w, w_scale, r, out, which):
            st.grouped_gemm(a, a_scale, w, w_scale, r, out, which)
            calls.append((a, a_scale, w, w_scale, r, out.clone()))

        def gate_up_silu_quant(a, a_scale, w, w_scale, r, dtype):
            hq, h_scale = st.gate_up_silu_quant(a, a_scale, w, w_scale, r, dtype)
            gate_up = torch.empty(r.rows, w.shape[1], dtype=dtype, device=a.device)
            st.grouped_gemm(a, a_scale, w, w_scale, r, gate_up, 0)  # (without the epilogue)
            calls.append((a, a_scale, w, w_scale, r, (hq.clone(), h_scale.clone(), gate_up)))
            return hq, h_scale
        return dataclasses.replace(st, grouped_gemm=gemm, gate_up_silu_quant=(
            gate_up_silu_quant if st.gate_up_silu_quant is not None else None))

    monkeypatch.setattr(sm90_moe, "stages", spied)
    _poison_cache()
    out = fused_moe(x, w13, s13, w2, s2, wts, ids)
    assert out.dtype == dtype and out.shape == (m, h) and torch.isfinite(out).all()
    # each GEMM as tight as a dense one; the layer: the intermediate's fp8 rounding turns the
    # GEMMs' last-bit differences into ~0.1-1% (an element near a rounding boundary moves by
    # one fp8 step), so it is checked against the fp64 formulation within 1e-2
    assert len(calls) == 2
    slot_tiles = choose(m, top_k, e, h, inter, 132,
                                   sm90_plan._forced.get("slot_tiles")).slot_tiles
    _check_slots(calls, x, ids, wts, out) if slot_tiles else _check_grouped(calls)
    xq, xs = quantize_activation(x.cpu())
    ref = R.moe(xq, xs, dtype, *(t.cpu() for t in (w13, s13, w2, s2, wts, ids)))
    assert R.rel_err(out.cpu(), ref) <= 1e-2
    assert R.rel_err(out, moe_reference(x, w13, s13, w2, s2, wts, ids)) <= 1e-2
    monkeypatch.undo()
    _poison_cache()
    again = fused_moe(x, w13, s13, w2, s2, wts, ids)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))  # run to run


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["decode", "prefill", "slot_tiles"])
def test_slots_held_elsewhere_add_nothing(kernel):
    # expert parallelism: slots of id -1 (another rank's experts) take no rows and add
    # nothing, their weights unread (NaN here); a token with every slot elsewhere is zero
    gen = torch.Generator().manual_seed(7)
    x, w13, s13, w2, s2, wts, ids = layer(gen, 40, 16, 4, 512, 256)
    away = torch.rand(ids.shape, generator=gen) < 0.5
    away[3] = True
    ids = ids.masked_fill(away, -1)
    xq, xs = quantize_activation(x)
    as_zero = R.moe(xq, xs, torch.bfloat16, w13, s13, w2, s2, wts.masked_fill(away, 0.0),
                    ids.clamp(min=0))
    args = [t.cuda() for t in (x, w13, s13, w2, s2, wts.masked_fill(away, float("nan")), ids)]
    _poison_cache()
    with sm90_plan.forced(prefill=kernel == "prefill", slot_tiles=kernel == "slot_tiles"):
        out = fused_moe(*args)
        again = fused_moe(*args)
    assert torch.isfinite(out).all() and torch.equal(out[3].cpu(), torch.zeros(512).bfloat16())
    assert R.rel_err(out.cpu(), as_zero) <= 1e-2
    assert R.rel_err(out, moe_reference(*args)) <= 1e-2
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("group_m", [2, 8, 64])
def test_prefill_tile_order_leaves_the_output_bitwise(group_m):
    # each 128x128 tile is one CTA's whole K, whatever order the CTAs walk the tiles in
    gen = torch.Generator().manual_seed(group_m)
    args = [t.cuda() for t in layer(gen, 700, 8, 2, 512, 384)]
    _bitwise_alike(args, dict(prefill=True, group_m=1), dict(prefill=True, group_m=group_m))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["decode", "slot_tiles"])
@pytest.mark.parametrize("window", [0, 1, 3])
def test_decode_window_leaves_the_output_bitwise(kernel, window):
    # the weight stages in flight pace the loads only: every product and sum is the same
    gen = torch.Generator().manual_seed(window)
    m = 3 if kernel == "slot_tiles" else 40
    args = [t.cuda() for t in layer(gen, m, 16, 4, 1024, 512)]
    plan = dict(prefill=False, slot_tiles=kernel == "slot_tiles")
    got = _bitwise_alike(args, plan, dict(plan, window=window))
    if kernel == "decode":  # (slot tiles: each GEMM against fp64, test_slot_tiles_match_fp64)
        assert R.rel_err(got, moe_reference(*args)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m,dtype", [(3, torch.bfloat16), (5, torch.float16)])
def test_three_ctas_an_sm_leave_the_slot_tiles_bitwise(m, dtype):
    # moe-slot-three's kernel quantizes its tokens 4 groups a batch (the two-CTA kernel 8):
    # the same values, the same products
    gen = torch.Generator().manual_seed(m)
    args = [t.cuda() for t in layer(gen, m, 16, 4, 1024, 512, dtype=dtype)]
    _bitwise_alike(args, dict(slot_tiles=True, ctas=2), dict(slot_tiles=True, ctas=3))


@pytest.mark.gpu
@pytest.mark.parametrize("m,e,top_k,h,inter,routing,ids_dtype,away", [
    (40, 16, 4, 1024, 512, "random", torch.int64, 0.0),   # one routing program
    (24, 32, 2, 256, 384, "few", torch.int32, 0.0),       # most experts get no token
    (40, 8, 2, 384, 256, "one_expert", torch.int32, 0.0),
    (200, 16, 8, 256, 128, "random", torch.int32, 0.0),   # 1600 slots: parallel routing
    (9, 300, 4, 208, 128, "random", torch.int64, 0.0),    # 10 experts a lane of the scan
    (40, 16, 4, 512, 256, "random", torch.int32, 0.5),    # slots held elsewhere (id -1)
])
@pytest.mark.parametrize("piece, token_tile", [("tile_route", 8), ("tile_route", 32),
                                               ("token_rows", 8), ("token_rows", 16),
                                               ("down_route", 8), ("down_route", 64)])
def test_gemms_routing_themselves_leave_the_output_bitwise(m, e, top_k, h, inter, routing,
                                                           ids_dtype, away, piece, token_tile):
    # gate_up's CTAs find their tiles' experts from the ids as the routing places them
    # (moe-tile-route), and their rows' tokens, quantized as the gather does (moe-token-rows);
    # so do down's (moe-down-route, launched at SiLU-and-mul's start): the same rows, products
    # and sums
    gen = torch.Generator().manual_seed(m + e)
    x, w13, s13, w2, s2, wts, ids = layer(gen, m, e, top_k, h, inter, routing)
    ids = ids.masked_fill(torch.rand(ids.shape, generator=gen) < away, -1).to(ids_dtype)
    args = [t.cuda() for t in (x, w13, s13, w2, s2, wts, ids)]
    plan = dict(prefill=False, slot_tiles=False, token_tile=token_tile, token_rows=False,
                down_route=False)
    if piece == "token_rows":
        plan["tile_route"] = True
    got = _bitwise_alike(args, dict(plan, **{piece: False}), dict(plan, **{piece: True}))
    assert R.rel_err(got, moe_reference(*args)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", MOE_PREFILL_CONFIGS[1:])
@pytest.mark.parametrize("routing", ["random", "edges"])
def test_prefill_tiles_leave_the_output_bitwise(config, routing):
    # every tile computes an output element from the same products in the same K order as
    # the default one: pairs along M (multicasting the weights where both M blocks hold one
    # expert, else not; an M block of none idle), 192 columns (a last tile past N: 512 and
    # 768 columns), one partial or two. "edges": experts of 0-3 tiles, so pairs of both kinds
    gen = torch.Generator().manual_seed(config)
    m, e, k = (700, 8, 2) if routing == "random" else (sum(EDGE_COUNTS), 8, 1)
    args = [t.cuda() for t in layer(gen, m, e, k, 512, 384, routing)]
    fused = GEMM_TILES[config].bn == 128  # (the SiLU-and-mul epilogue's tiles)
    plan = dict(prefill=True, fused_act=fused)
    _bitwise_alike(args, plan, dict(plan, prefill_config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["decode", "prefill", "slot_tiles"])
def test_fused_moe_under_a_cuda_graph_follows_new_routing(kernel):
    with sm90_plan.forced(prefill=kernel == "prefill", slot_tiles=kernel == "slot_tiles"):
        _graph_follows_routing()


def _graph_follows_routing():
    gen = torch.Generator().manual_seed(3)
    m, e, k = 4, 32, 4
    x, w13, s13, w2, s2, wts, ids = (t.cuda() for t in layer(gen, m, e, k, 256, 256))
    fused_moe(x, w13, s13, w2, s2, wts, ids)  # warm-up (plans, library load)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe(x, w13, s13, w2, s2, wts, ids)
    for seed in range(3):
        ids.copy_(topk_ids(m, k, e, torch.Generator().manual_seed(seed), "random"))
        g.replay()
        want = fused_moe(x, w13, s13, w2, s2, wts, ids)
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_grouped_entry_points_refuse_bad_arguments_before_launching():
    """The grouped GEMMs' C entry points (library.grouped / grouped_prefill) name what is
    wrong, and launch nothing."""
    from fp8linear.backends.sm90 import library
    lib = library.load()
    e, n, k = 4, 256, 256
    w = torch.zeros(e, n, k, dtype=torch.float8_e4m3fn, device="cuda")
    ws = torch.ones(e, n // 128, k // 128, device="cuda")
    a = torch.zeros(256, k, dtype=torch.float8_e4m3fn, device="cuda")
    a_scale = torch.ones(k // 128, 256, device="cuda").t()
    tiles = torch.zeros(2, dtype=torch.int32, device="cuda")
    row_token = torch.arange(256, device="cuda")
    out = torch.full((256, n), float("nan"), dtype=torch.bfloat16, device="cuda")

    def refused(match, call):
        with pytest.raises(library.KernelError, match=match):
            call()
        torch.cuda.synchronize()
        assert torch.isnan(out).all()  # nothing ran

    refused(r"moe prefill: M must be whole 128-row token tiles",
            lambda: lib.grouped_prefill(a[:200], a_scale[:200], w, ws, out[:200], tiles,
                                        row_token, 1, False))
    refused(r"moe prefill: N must be a multiple of 128",
            lambda: lib.grouped_prefill(a, a_scale, w[:, :200], ws, out[:, :200], tiles,
                                        row_token, 1, False))
    # the rows' tokens (the kernel's half tiles read them) are required
    refused(r"moe prefill: grouped GEMMs need tile_expert and row_token", lambda: library._check(
        lib._gemm(library._GEMM.pack(
            a.data_ptr(), a_scale.data_ptr(), w.data_ptr(), ws.data_ptr(), 0, out.data_ptr(),
            library._stream(0), tiles.data_ptr(), 0, 0, 0, 0, library._IN[a.dtype],
            a_scale.stride(1), 0, False, False, library._OUT[out.dtype], 256, n, k,
            library.MOE_PREFILL_CONFIG, False, False, 0, 1, e, 0))))
    # 16-bit activations (no scales) are not quantized for the grouped kernel: refused
    bf = torch.zeros(256, k, dtype=torch.bfloat16, device="cuda")
    refused(r"moe prefill: grouped GEMMs take fp8 activations", lambda: library._check(
        lib._gemm(library._GEMM.pack(
            bf.data_ptr(), 0, w.data_ptr(), ws.data_ptr(), 0, out.data_ptr(),
            library._stream(0), tiles.data_ptr(), row_token.data_ptr(), 0, 0, 0,
            library._IN[bf.dtype], 0, 0, False,
            False, library._OUT[out.dtype], 256, n, k, library.MOE_PREFILL_CONFIG, False,
            False, 0, 1, e, 0))))
    # SiLU-and-mul in gate_up's epilogue: whole 128-channel groups of h, 16-byte scale rows
    hq = torch.zeros(256, n // 2, dtype=torch.float8_e4m3fn, device="cuda")
    h_scale = torch.full((n // 256, 256), float("nan"), device="cuda")
    refused(r"moe prefill: SiLU-and-mul: N \(2I\) must be a multiple of 256",
            lambda: lib.grouped_prefill(a, a_scale, w[:, :128], ws, hq[:, :64], tiles,
                                        row_token, 1, False, h_scale.t(), torch.bfloat16))
    short = torch.full((n // 256, 252), float("nan"), device="cuda")  # rows of 252 < M
    refused(r"moe prefill: out_scale_ld must be >= M and % 4",
            lambda: lib.grouped_prefill(a, a_scale, w, ws, hq, tiles, row_token, 1, False,
                                        short.t(), torch.bfloat16))
    # the tile: one the grouped kernel is built for; the SiLU-and-mul epilogue's 128 columns
    refused(r"moe prefill: gemm config 0 is not a grouped prefill tile",
            lambda: lib.grouped_prefill(a, a_scale, w, ws, out, tiles, row_token, 1, False,
                                        config=0))
    refused(r"moe prefill: the SiLU-and-mul epilogue runs 128-column tiles",
            lambda: lib.grouped_prefill(a, a_scale, w, ws, hq, tiles, row_token, 1, False,
                                        h_scale.t(), torch.bfloat16, config=14))
    assert torch.isnan(h_scale).all()
    refused(r"M must be whole token tiles",
            lambda: lib.grouped(a[:100], a_scale[:100], w, ws, out[:100], tiles, 0, 4, 4, 1,
                                1, False))
    refused(r"splits must be in \[1, ceil\(K/128\)\]",
            lambda: lib.grouped(a, a_scale, w, ws, out, tiles, 0, 4, 0, 3, 1, False))
    # slot tiles: 16-bit tokens, out a row a (token, slot) pair
    ids = torch.zeros(64, 4, dtype=torch.int32, device="cuda")
    refused(r"grouped decode: slot tiles take bf16/fp16 activations",
            lambda: lib.grouped_slots(a[:64], w, ws, out, ids, 0, 512, 1, 2, False, False,
                                      False))
    refused(r"grouped decode: slot tiles: M must be tokens x top_k",
            lambda: lib.grouped_slots(bf[:64], w, ws, out[:255], ids, 0, 512, 1, 2, False,
                                      False, False))
    refused(r"grouped decode: ctas_per_sm must be 1, 2 or 3",
            lambda: lib.grouped_slots(bf[:16], w, ws, out[:64], ids[:16], 0, 128, 1, 4, False,
                                      False, False))
    # (three CTAs an SM: the slot tiles' kernel only)
    refused(r"grouped decode: ctas_per_sm must be 1, or 2 with token tiles <= 32",
            lambda: lib._decode_call(a, a_scale, w, ws, False, None, out, 0, 256, 0, 128, 1,
                                     3, False, False, False, tiles))
    # (grouped_slots always passes config 0: the raw call, with the 32-token tile's config)
    refused(r"grouped decode: slot tiles run decode config 0",
            lambda: lib._decode_call(bf[:16], None, w, ws, False, None, out[:64], 0, 128, 2,
                                     128, 1, 2, False, False, False, ids[:16],
                                     (4, False, False, False), 64))
    # sorted tiles: 16-bit tokens only with their rows' tokens and the ids (moe-token-rows),
    # no bias, the ids' experts counted in a CTA's ring (moe-tile-route)
    refused(r"grouped decode: grouped GEMMs take fp8 activations \(sorted by expert\), or "
            r"bf16/fp16 tokens with row_token, route_ids and route_top_k",
            lambda: lib.grouped(bf, None, w, ws, out, tiles, 0, 4, 0, 1, 1, False))
    bias = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    refused(r"grouped decode: grouped GEMMs take no bias",
            lambda: lib._decode_call(a, a_scale, w, ws, False, bias, out, 0, 4, 0, 128, 1, 1,
                                     False, False, False, tiles))
    many = torch.zeros(1, n, k, dtype=torch.float8_e4m3fn, device="cuda").expand(4096, n, k)
    refused(r"grouped decode: route_slots must be >= 0, and 0 without route_ids or above 4095 "
            r"experts",
            lambda: lib.grouped(a, a_scale, many, ws, out, tiles, 0, 4, 0, 1, 1, False,
                                ids=ids))
