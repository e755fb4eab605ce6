"""backends/sm90/moe.py: its plan rules (moe-token-tile, moe-split-fill) on the CPU; on the
GPU, the MoE layer on the grouped expert GEMMs against the fp64 formulation of the same
dequantized math, NaN-poisoned scratch, run to run, and under a CUDA graph."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fp64_reference as R
from fp8linear import quantize_activation
from fp8linear.backends import dispatch
from fp8linear.backends.sm90.moe import (GroupedGemmPlan, expected_active, moe_plan,
                                        slot_three_takes)
from fp8linear.backends.sm90.tiles import GEMM_TILES, MOE_PREFILL_CONFIGS
from fp8linear.moe import fused_moe, moe_reference
from moe_cases import EDGE_COUNTS, experts, layer, topk_ids

MODELS = {  # experts, top_k, hidden, expert intermediate
    "qwen3_30b_a3b": (128, 8, 2048, 768), "qwen3_235b_a22b": (128, 8, 4096, 1536),
    "deepseek_v3": (256, 8, 7168, 2048), "mixtral_8x7b": (8, 2, 4096, 14336)}


def test_expected_active_experts():
    assert expected_active(1, 128) == pytest.approx(1.0)
    assert expected_active(8, 128) == pytest.approx(7.79, abs=0.01)
    assert expected_active(100_000, 8) == pytest.approx(8.0)


@pytest.mark.parametrize("model,m,tile", [
    ("qwen3_30b_a3b", 8, 8), ("qwen3_30b_a3b", 64, 8), ("qwen3_30b_a3b", 192, 16),
    ("qwen3_30b_a3b", 208, 32), ("qwen3_30b_a3b", 256, 32),
    ("mixtral_8x7b", 2, 8), ("mixtral_8x7b", 16, 8), ("mixtral_8x7b", 64, 32),
    ("deepseek_v3", 16, 8), ("deepseek_v3", 640, 64),
    ("mixtral_8x7b", 16, 8), ("mixtral_8x7b", 80, 64), ("deepseek_v3", 512, 32),
    ("qwen3_235b_a22b", 256, 32), ("qwen3_30b_a3b", 384, 32)])
def test_token_tile_holds_an_experts_expected_tokens(model, m, tile):
    e, k, h, i = MODELS[model]
    plan = moe_plan(m, k, e, h, i, 132)
    assert plan.token_tile == tile and "moe-token-tile" in plan.rule and not plan.prefill
    # wide experts with >= 16 tokens each: twice the tokens (moe-token-tile-2x); narrower
    # ones the mean plus its square root (moe-token-tile-spread: Qwen3-30B-A3B 12 an expert
    # at 192 tokens fit 16-token tiles, 13 at 208 take 32)
    assert ("moe-token-tile-2x" in plan.rule) == (h >= 4096 and m * k / min(e, m * k) >= 15.9)
    assert ("moe-token-tile-spread" in plan.rule) == (h < 4096)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 1024, 4096])
def test_splits_fill_one_wave_with_two_k_blocks_a_split(model, m):
    e, k, h, i = MODELS[model]
    plan = moe_plan(m, k, e, h, i, 132)
    for g, n, kdim in ((plan.gate_up, 2 * i, h), (plan.down, h, i)):
        assert g.ctas_per_sm == (2 if plan.token_tile <= 32 else 1) or (
            plan.slot_tiles and g.ctas_per_sm == 3)  # (moe-slot-three)
        assert 1 <= g.splits <= max(1, -(-kdim // 128) // 2)


def test_decode_sizes_split_k_where_the_experts_leave_sms_idle():
    # Qwen3-30B-A3B at M = 1: 8 experts x 12 row blocks = 96 CTAs for 264 slots -> 2 splits
    plan = moe_plan(1, 8, 128, 2048, 768, 132)
    assert (plan.gate_up.splits, plan.down.splits) == (2, 2)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_one_token_runs_slot_tiles(model):
    e, k, h, i = MODELS[model]
    plan = moe_plan(1, k, e, h, i, 132)
    assert plan.slot_tiles and plan.rule.startswith("moe-slot-tiles+") and plan.token_tile == 8
    # (a tile a pair: the CTAs are the pairs' row blocks, split as the sorted plan's would be;
    # the sorted tiles keep 4 weight stages in flight, the slot tiles the kernel's 2)
    sorted_plan = moe_plan(1, k, e, h, i, 132, slot_tiles=False)
    unwindowed = dataclasses.replace
    assert (plan.gate_up, plan.down) == (unwindowed(sorted_plan.gate_up, window=-1),
                                         unwindowed(sorted_plan.down, window=-1))
    assert not sorted_plan.slot_tiles and sorted_plan.gate_up.window == 4
    assert "moe-decode-window" in sorted_plan.rule and "moe-decode-window" not in plan.rule


@pytest.mark.parametrize("model, m, gate_up, down", [
    ("qwen3_30b_a3b", 1, 2, 2),    # 192 / 256 CTAs: one wave at two an SM
    ("qwen3_30b_a3b", 2, 2, 2),
    ("qwen3_30b_a3b", 3, 3, 3),    # 288 / 384: one wave at three, two at two
    ("qwen3_30b_a3b", 4, 3, 2),    # 384 / 512: down two waves either way
    ("qwen3_30b_a3b", 5, 2, 3),    # 480 / 640
    ("qwen3_235b_a22b", 2, 3, 2),  # 384 / 512
    ("deepseek_v3", 1, 2, 2),      # 56 K blocks: no room at three an SM
])
def test_slot_tiles_run_three_ctas_an_sm_where_that_takes_fewer_waves(model, m, gate_up, down):
    e, k, h, i = MODELS[model]
    plan = moe_plan(m, k, e, h, i, 132)
    assert plan.slot_tiles and (plan.gate_up.ctas_per_sm, plan.down.ctas_per_sm) == (gate_up, down)
    for g, n in ((plan.gate_up, 2 * i), (plan.down, h)):
        ctas = -(-n // 128) * m * k * g.splits
        assert (g.ctas_per_sm == 3) == (-(-ctas // 396) < -(-ctas // 264))


def test_forced_ctas_are_checked():
    from fp8linear.backends.sm90 import moe as sm90_moe
    e, k, h, i = MODELS["qwen3_30b_a3b"]
    with sm90_moe.forced(ctas=3, slot_tiles=True):  # small shapes: the kernel the rule takes
        forced = sm90_moe._apply_forced(moe_plan(1, k, e, h, i, 132, True), h, i)
        assert (forced.gate_up.ctas_per_sm, forced.down.ctas_per_sm) == (3, 3)
    with sm90_moe.forced(ctas=3, slot_tiles=False), pytest.raises(ValueError, match="ctas=3"):
        sm90_moe._apply_forced(moe_plan(64, k, e, h, i, 132, False), h, i)
    with sm90_moe.forced(ctas=2, token_tile=64), pytest.raises(
            ValueError, match=r"^ctas=2 runs slot tiles \(3\) or token tiles <= 32 \(2\), "
                              r"got token tile 64$"):
        sm90_moe._apply_forced(moe_plan(64, k, e, h, i, 132, False), h, i)
    with sm90_moe.forced(ctas=3, prefill=True), pytest.raises(
            ValueError, match=r"got token tile 128, the prefill kernel$"):
        sm90_moe._apply_forced(moe_plan(64, k, e, h, i, 132, False), h, i)
    with pytest.raises(ValueError, match=r"^ctas must be 1, 2 or 3, got 4$"):
        with sm90_moe.forced(ctas=4):
            pass
    with sm90_moe.forced(slot_tiles=True):  # forced otherwise: the rule's CTAs an SM stay
        plan = moe_plan(4, k, e, h, i, 132, True)
        assert sm90_moe._apply_forced(plan, h, i).gate_up.ctas_per_sm == 3


@pytest.mark.parametrize("model, m, window", [
    ("deepseek_v3", 32, 4), ("qwen3_30b_a3b", 256, 4),  # 8- / 16-token tiles, two CTAs an SM
    ("mixtral_8x7b", 96, -1),                            # the prefill kernel: no ring window
    ("deepseek_v3", 1, -1)])                             # slot tiles: the kernel's own
def test_sorted_decode_tiles_keep_four_weight_stages_in_flight(model, m, window):
    e, k, h, i = MODELS[model]
    plan = moe_plan(m, k, e, h, i, 132)
    assert (plan.gate_up.window, plan.down.window) == (window, window)
    assert ("moe-decode-window" in plan.rule) == (window == 4)
    from fp8linear.backends.sm90 import moe as sm90_moe
    with sm90_moe.forced(token_tile=64):  # one CTA an SM: the kernel's rule (the whole ring)
        forced = sm90_moe._apply_forced(moe_plan(32, k, e, h, i, 132), h, i)
        assert (forced.gate_up.ctas_per_sm, forced.gate_up.window) == (1, -1)


@pytest.mark.parametrize("model, most", [("qwen3_30b_a3b", 5), ("qwen3_235b_a22b", 2),
                                         ("deepseek_v3", 2), ("mixtral_8x7b", 1)])
def test_slot_tiles_while_expected_rereads_stay_under_30_mb(model, most):
    # pairs beyond the active experts reread an expert's 3 * H * I weight bytes each
    e, k, h, i = MODELS[model]
    for m in range(1, 9):
        rereads = (m * k - expected_active(m * k, e)) * 3 * h * i
        assert moe_plan(m, k, e, h, i, 132).slot_tiles == (m <= most)
        assert m == 1 or (rereads <= 30e6) == (m <= most)
    # forced on for several tokens: one tile each of the m * k pairs
    forced = moe_plan(4, k, e, h, i, 132, slot_tiles=True)
    assert forced.slot_tiles and not forced.prefill and forced.token_tile == 8
    want = max(1, min(2 * 132 // (-(-h // 128) * 4 * k), -(-i // 128) // 2))
    # (moe-slot-kbs: <= 64 K blocks a split, Mixtral's 112 in two at least; moe-slot-three)
    splits = max(want, -(-i // 128 // 64))
    ctas = 3 if slot_three_takes(-(-h // 128) * 4 * k * splits, 132, -(-i // 128 // splits)) else 2
    assert forced.down == GroupedGemmPlan(splits, ctas)


# ------------------------------------------------------------------------------ GPU
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
    """fused_moe(*args) with got_pieces forced (backends.sm90.moe.forced), on NaN-poisoned
    scratch: finite and bitwise that with want_pieces forced. Returns it."""
    from fp8linear.backends.sm90 import moe as sm90_moe
    with sm90_moe.forced(**want_pieces):
        want = fused_moe(*args)
    _poison_cache()
    with sm90_moe.forced(**got_pieces):
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
        want = R.dequant(want_q.cpu(), want_st[:, :len(rows)].t().cpu())
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
    from fp8linear.backends.sm90 import moe as sm90_moe
    with sm90_moe.forced(slot_tiles=True, ctas=ctas):
        _check_case(m, e, top_k, h, inter, routing, dtype, monkeypatch, ids_dtype=ids_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_act", [True, False])
@pytest.mark.parametrize("m,e,top_k,h,inter,routing,dtype", PREFILL_CASES)
def test_prefill_kernel_matches_fp64(m, e, top_k, h, inter, routing, dtype, fused_act,
                                     monkeypatch):
    # fused_act: gate_up's epilogue writes h = SiLU(gate) * up quantized (the rule), or
    # gate_up for the SiLU-and-mul launch (forced off)
    from fp8linear.backends.sm90 import moe as sm90_moe
    with sm90_moe.forced(prefill=True, fused_act=fused_act):
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
    from fp8linear.backends.sm90 import moe as sm90_moe
    with sm90_moe.forced(slot_tiles=False, token_tile=8):
        assert (sm90_moe._apply_forced(moe_plan(m, top_k, e, h, inter, 132, False), h, inter)
                .token_rows == (h <= sm90_moe.TOKEN_ROWS_MAX_HIDDEN))
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
    _assert_rows_match_fp64(R.dequant(hq.cpu(), h_scale_t[:, :len(tokens)].t().cpu()),
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
    slot_tiles = sm90_moe.moe_plan(m, top_k, e, h, inter, 132,
                                   sm90_moe._forced.get("slot_tiles")).slot_tiles
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
    from fp8linear.backends.sm90 import moe as sm90_moe
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
    with sm90_moe.forced(prefill=kernel == "prefill", slot_tiles=kernel == "slot_tiles"):
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
    from fp8linear.backends.sm90 import moe as sm90_moe
    with sm90_moe.forced(prefill=kernel == "prefill", slot_tiles=kernel == "slot_tiles"):
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


def test_forced_pieces_are_checked_and_restored():
    from fp8linear.backends.sm90 import moe as sm90_moe
    with pytest.raises(ValueError, match=r"^token_tile must be one of \(8, 16, 32, 64, 128\), "
                                         r"got 24$"):
        with sm90_moe.forced(token_tile=24):
            pass
    with pytest.raises(ValueError, match=r"^splits must be >= 1, got 0$"):
        with sm90_moe.forced(splits=0):
            pass
    with sm90_moe.forced(token_tile=64, pdl=False):
        assert sm90_moe._forced["slot_tiles"] is False  # a forced tile: the sorted layer
        plan = sm90_moe._apply_forced(moe_plan(2, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.token_tile, plan.pdl, plan.gate_up.ctas_per_sm, plan.rule) == (
            64, False, 1, "forced")
        assert not plan.fused_act  # (the decode kernel has no such epilogue)
    with pytest.raises(ValueError, match=r"^the prefill kernel takes 128-token tiles, got 64$"):
        with sm90_moe.forced(token_tile=64, prefill=True):
            pass
    with pytest.raises(ValueError, match=r"^slot tiles run 8-token tiles without the prefill "
                                         r"kernel, got token_tile=None, prefill=True$"):
        with sm90_moe.forced(prefill=True, slot_tiles=True):
            pass
    with pytest.raises(ValueError, match=r"^group_m must be >= 1, got 0$"):
        with sm90_moe.forced(group_m=0):
            pass
    with pytest.raises(ValueError, match=r"^window must be >= 0 \(0: the whole ring\), got -1$"):
        with sm90_moe.forced(window=-1):
            pass
    assert moe_plan(1, 8, 128, 2048, 768, 132).gate_up.window == -1  # slot tiles: the kernel's
    with sm90_moe.forced(window=3):
        plan = sm90_moe._apply_forced(moe_plan(2, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.gate_up.window, plan.down.window) == (3, 3)
    with sm90_moe.forced(tile_route=False):
        plan = sm90_moe._apply_forced(moe_plan(16, 8, 128, 2048, 768, 132), 2048, 768)
        assert not plan.tile_route and not plan.slot_tiles
    with pytest.raises(ValueError, match=r"^token_rows=True needs tile_route \(gate_up finds "
                                         r"its tiles' tokens from the ids\)$"):
        with sm90_moe.forced(token_rows=True, tile_route=False):
            sm90_moe._apply_forced(moe_plan(16, 8, 128, 2048, 768, 132), 2048, 768)
    with sm90_moe.forced(token_rows=False):
        plan = sm90_moe._apply_forced(moe_plan(16, 8, 128, 2048, 768, 132), 2048, 768)
        assert plan.tile_route and not plan.token_rows
    plan = sm90_moe._apply_forced(moe_plan(16, 8, 128, 2048, 768, 132), 2048, 768)
    assert plan.token_rows and plan.down_route  # (the rules', as for the plan)
    with sm90_moe.forced(down_route=False):
        plan = sm90_moe._apply_forced(moe_plan(16, 8, 128, 2048, 768, 132), 2048, 768)
        assert plan.tile_route and not plan.down_route
    with sm90_moe.forced(prefill=True):  # (the rule's for the kernel forced)
        assert not sm90_moe._apply_forced(moe_plan(16, 8, 128, 2048, 768, 132), 2048,
                                          768).down_route
    for piece in ("tile_route", "down_route"):
        for pieces, kernel in ((dict(prefill=True), "prefill kernel"),
                               (dict(slot_tiles=True), "slot tiles")):
            with pytest.raises(ValueError, match=rf"^{piece}=True runs the decode kernel's "
                                                 rf"sorted tiles, got the {kernel}$"):
                with sm90_moe.forced(**{piece: True}, **pieces):
                    plan = moe_plan(16, 8, 128, 2048, 768, 132,
                                    sm90_moe._forced.get("slot_tiles"))
                    sm90_moe._apply_forced(plan, 2048, 768)
    with sm90_moe.forced(prefill=True):
        plan = sm90_moe._apply_forced(moe_plan(2, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.prefill, plan.token_tile) == (True, 128)
        assert plan.gate_up.group_m == plan.down.group_m == 1  # (the decode plan's)
        with sm90_moe.forced(group_m=5):
            plan = sm90_moe._apply_forced(moe_plan(2, 8, 128, 2048, 768, 132), 2048, 768)
            assert (plan.gate_up.group_m, plan.down.group_m) == (5, 5)
        assert plan.fused_act  # (the prefill kernel's epilogue, unless forced off)
        with sm90_moe.forced(fused_act=False):
            plan = sm90_moe._apply_forced(moe_plan(2, 8, 128, 2048, 768, 132), 2048, 768)
            assert plan.prefill and not plan.fused_act
        with pytest.raises(ValueError, match=r"^the prefill kernel needs hidden and 2 \* "
                                             r"intermediate multiples of 128, got 2080, 768$"):
            sm90_moe._apply_forced(moe_plan(1, 8, 128, 2080, 768, 132), 2080, 768)
    with pytest.raises(ValueError, match=r"^prefill_config must be one of \(13, 14\), "
                                         r"got 0$"):
        with sm90_moe.forced(prefill_config=0):
            pass
    with sm90_moe.forced(prefill=True, prefill_config=14):
        plan = sm90_moe._apply_forced(moe_plan(2, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.gate_up.prefill_config, plan.down.prefill_config) == (14, 14)
        assert not plan.fused_act  # (a 192-column tile: no SiLU-and-mul epilogue)
    with pytest.raises(ValueError, match=r"^the SiLU-and-mul epilogue runs 128-column tiles, "
                                         r"got prefill_config=14 \(192 columns\)$"):
        with sm90_moe.forced(prefill=True, prefill_config=14, fused_act=True):
            sm90_moe._apply_forced(moe_plan(2, 8, 128, 2048, 768, 132), 2048, 768)
    # a plan on the pairs' tile takes the default one forced, and with it the epilogue
    with sm90_moe.forced(prefill_config=13):
        plan = sm90_moe._apply_forced(moe_plan(4096, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.gate_up.prefill_config, plan.fused_act) == (13, True)
    with pytest.raises(ValueError, match=r"^the SiLU-and-mul epilogue is the prefill kernel's: "
                                         r"fused_act=True needs prefill, got the decode "
                                         r"kernel's plan$"):
        with sm90_moe.forced(fused_act=True):
            sm90_moe._apply_forced(moe_plan(2, 8, 128, 2048, 768, 132), 2048, 768)
    assert sm90_moe._forced == {}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("m", [1, 2, 4, 16, 64, 256, 1024])
def test_sorted_decode_tiles_route_their_own_experts(model, m):
    # moe-tile-route: the decode kernel's sorted tiles, not the slot tiles (no routing) nor
    # the prefill kernel
    e, k, h, i = MODELS[model]
    plan = moe_plan(m, k, e, h, i, 132)
    assert plan.tile_route == (not plan.prefill and not plan.slot_tiles)
    assert ("moe-tile-route" in plan.rule) == plan.tile_route
    # moe-down-route: down's too, SiLU-and-mul letting it launch at its start
    assert plan.down_route == plan.tile_route
    assert ("moe-down-route" in plan.rule) == plan.down_route
    from fp8linear.backends.sm90 import moe as sm90_moe
    from fp8linear.backends.triton import moe as triton_moe
    silu = sm90_moe.stages(plan).silu_mul_quant
    assert silu.func is triton_moe.silu_mul_quant
    assert silu.keywords == {"early_next": plan.down_route}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("m", [1, 8, 16, 64, 128, 1024])
def test_narrow_experts_8_token_tiles_read_their_tokens_rows(model, m):
    # moe-token-rows: under moe-tile-route, 8-token tiles of hidden <= 2048 (Qwen3-30B-A3B)
    e, k, h, i = MODELS[model]
    plan = moe_plan(m, k, e, h, i, 132)
    want = plan.tile_route and h <= 2048 and plan.token_tile == 8
    assert plan.token_rows == want and ("moe-token-rows" in plan.rule) == want
    assert plan.token_rows == (model == "qwen3_30b_a3b" and 8 <= m <= 64)


@pytest.mark.parametrize("model, m, prefill", [
    ("qwen3_30b_a3b", 384, False), ("qwen3_30b_a3b", 512, True),  # 24 / 32 tokens an expert
    ("mixtral_8x7b", 64, False), ("mixtral_8x7b", 96, True),      # 16 / 24 (hidden 4096)
    ("deepseek_v3", 512, False), ("deepseek_v3", 768, True),      # 16 / 24 (hidden 7168)
    ("qwen3_30b_a3b", 1024, True), ("deepseek_v3", 2048, True)])
def test_prefill_kernel_from_32_tokens_an_expert_24_if_wide(model, m, prefill):
    e, k, h, inter = MODELS[model]
    plan = moe_plan(m, k, e, h, inter, 132)
    assert plan.prefill == prefill and ("moe-prefill" in plan.rule) == prefill
    assert plan.token_tile == 128 or not prefill
    # moe-prefill-fused-act: SiLU-and-mul + quantization in gate_up's epilogue, to hidden 4096
    # (on 128-column tiles: below 128 tokens an expert, test_prefill_pairs_from_128_tokens...)
    fused = prefill and h <= 4096
    assert plan.fused_act == fused and ("moe-prefill-fused-act" in plan.rule) == fused
    from fp8linear.backends.sm90 import moe as sm90_moe
    assert (sm90_moe.stages(plan).gate_up_silu_quant is not None) == fused
    if prefill:  # no K splits: the persistent kernel walks whole K
        assert plan.gate_up == plan.down == GroupedGemmPlan(1, 1)
    # hidden sizes off the 128 grid keep the decode kernel
    assert not moe_plan(m, k, e, h + 16, inter, 132).prefill


@pytest.mark.parametrize("model, m, band", [
    ("mixtral_8x7b", 512, 1), ("mixtral_8x7b", 1024, 4),  # 128 / 256 tokens an expert
    ("mixtral_8x7b", 4096, 4), ("qwen3_235b_a22b", 4096, 1),  # 12 MB of gate_up an expert
    ("deepseek_v3", 4096, 1), ("qwen3_30b_a3b", 4096, 1)])
def test_prefill_bands_for_experts_past_the_l2_with_two_tiles(model, m, band):
    e, k, h, inter = MODELS[model]
    plan = moe_plan(m, k, e, h, inter, 132)
    assert plan.prefill and plan.gate_up == plan.down
    assert (plan.gate_up.splits, plan.gate_up.ctas_per_sm, plan.gate_up.group_m) == (1, 1, band)
    assert ("moe-prefill-band" in plan.rule) == (band > 1)


@pytest.mark.parametrize("model, m, pairs", [
    ("mixtral_8x7b", 256, False), ("mixtral_8x7b", 512, True),  # 64 / 128 tokens an expert
    ("qwen3_235b_a22b", 1024, False), ("qwen3_235b_a22b", 4096, True),
    ("deepseek_v3", 2048, False), ("deepseek_v3", 4096, True),  # 64 / 128
    ("qwen3_30b_a3b", 1024, False), ("qwen3_30b_a3b", 4096, True)])
def test_prefill_pairs_from_128_tokens_an_expert(model, m, pairs):
    e, k, h, inter = MODELS[model]
    plan = moe_plan(m, k, e, h, inter, 132)
    want = GroupedGemmPlan(1, 1, plan.gate_up.group_m, 14 if pairs else 13)
    assert plan.prefill and plan.gate_up == plan.down == want
    assert ("moe-prefill-pairs" in plan.rule) == pairs
    # the SiLU-and-mul epilogue runs 128-column tiles only
    assert plan.fused_act == (not pairs and h <= 4096)


@pytest.mark.parametrize("m, k, parallel", [(31, 8, False), (32, 8, True), (127, 2, False),
                                            (128, 2, True)])
def test_parallel_routing_from_256_slots(m, k, parallel):
    plan = moe_plan(m, k, 128, 2048, 768, 132)
    assert plan.parallel_route == parallel and ("moe-route-parallel" in plan.rule) == parallel
    from fp8linear.backends.sm90 import moe as sm90_moe
    from fp8linear.backends.triton import moe as triton_moe
    want = triton_moe.route_parallel if parallel else triton_moe.route
    route = sm90_moe.stages(plan).route  # (moe-tile-route: with the early launches)
    assert route.func is want and route.keywords == {"early_next": plan.tile_route}


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
