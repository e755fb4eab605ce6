"""backends/sm90/moe_plan.py: the MoE plan rules (token tiles, K splits, slot tiles, the
prefill kernel and what folds into which launch) on the CPU, and ``forced``'s checks."""
from __future__ import annotations

import dataclasses
import math

import pytest

from expect import undocumented
from fp8linear.backends.sm90 import moe_plan as sm90_plan
from fp8linear.backends.sm90.moe_plan import (GroupedGemmPlan, choose, expected_active,
                                             slot_three_takes)

MODELS = {  # experts, top_k, hidden, expert intermediate
    "qwen3_30b_a3b": (128, 8, 2048, 768), "qwen3_235b_a22b": (128, 8, 4096, 1536),
    "deepseek_v3": (256, 8, 7168, 2048), "mixtral_8x7b": (8, 2, 4096, 14336)}


def test_expected_active_experts():
    assert expected_active(1, 128) == pytest.approx(1.0)
    assert expected_active(8, 128) == pytest.approx(7.79, abs=0.01)
    assert expected_active(100_000, 8) == pytest.approx(8.0)


@pytest.mark.parametrize("model,m,tile", [
    ("qwen3_30b_a3b", 8, 8), ("qwen3_30b_a3b", 64, 8), ("qwen3_30b_a3b", 192, 16),
    ("qwen3_30b_a3b", 208, 32), ("qwen3_30b_a3b", 256, 32), ("qwen3_30b_a3b", 384, 32),
    ("qwen3_30b_a3b", 416, 32),
    ("mixtral_8x7b", 2, 8), ("mixtral_8x7b", 16, 8), ("mixtral_8x7b", 64, 32),
    ("mixtral_8x7b", 24, 16), ("mixtral_8x7b", 48, 32),
    # wide experts: 4 / 5 tokens an expert 8-token tiles, 7 and 11 16-token, 12 and 15 32
    ("deepseek_v3", 16, 8), ("deepseek_v3", 112, 8), ("deepseek_v3", 144, 8),
    ("deepseek_v3", 192, 16), ("deepseek_v3", 336, 16), ("deepseek_v3", 368, 32),
    ("deepseek_v3", 480, 32), ("deepseek_v3", 512, 32), ("qwen3_235b_a22b", 256, 32)])
def test_token_tile_holds_an_experts_expected_tokens(model, m, tile):
    e, k, h, i = MODELS[model]
    plan = choose(m, k, e, h, i, 132)
    assert plan.token_tile == tile and "moe-token-tile" in plan.rule and not plan.prefill
    # wide experts with >= 16 tokens each: twice the tokens (moe-token-tile-2x); below, the
    # mean plus 1.25 standard deviations, or one for narrower experts (moe-token-tile-spread:
    # Qwen3-30B-A3B 12 an expert at 192 tokens fit 16-token tiles, 13 at 208 take 32)
    two_x = h >= 4096 and m * k / min(e, m * k) >= 15.9
    assert ("moe-token-tile-2x" in plan.rule) == two_x
    assert ("moe-token-tile-spread" in plan.rule) == (not two_x)


def poisson_tail(lam: float, t: int) -> float:
    """P(X > t) for X ~ Poisson(lam)."""
    term, below = math.exp(-lam), 0.0
    for j in range(t + 1):
        below += term
        term *= lam / (j + 1)
    return 1.0 - below


@pytest.mark.parametrize("model", sorted(MODELS))
def test_sorted_tiles_rarely_split_an_expert_at_any_token_count(model):
    # the lesson of a sweep between the grid's points: where an expert's mean tokens filled
    # its tile, 15-40% of the experts streamed their weights twice and the layer ran slower
    # at fewer tokens (moe-token-tile-spread). Every M to 1024 whose plan sorts decode tiles:
    # uniformly routed, <= 11% of the experts get more tokens than their tile holds (the
    # narrow rule's measured best, 12 an expert in 16-token tiles, is 10%)
    e, k, h, i = MODELS[model]
    sorted_points = 0
    for m in range(1, 1025):
        plan = choose(m, k, e, h, i, 132)
        if plan.prefill or plan.slot_tiles:
            continue
        sorted_points += 1
        lam = m * k / expected_active(m * k, e)
        assert poisson_tail(lam, plan.token_tile) <= 0.11, (m, plan.token_tile)
        # and none of one CTA an SM (64+ tokens): the prefill kernel takes these shapes there
        assert plan.token_tile <= 32, (m, plan.token_tile)
    assert sorted_points >= 20


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 1024, 4096])
def test_splits_fill_one_wave_with_two_k_blocks_a_split(model, m):
    e, k, h, i = MODELS[model]
    plan = choose(m, k, e, h, i, 132)
    for g, n, kdim in ((plan.gate_up, 2 * i, h), (plan.down, h, i)):
        assert g.ctas_per_sm == (2 if plan.token_tile <= 32 else 1) or (
            plan.slot_tiles and g.ctas_per_sm == 3)  # (moe-slot-three)
        assert 1 <= g.splits <= max(1, -(-kdim // 128) // 2)


def test_decode_sizes_split_k_where_the_experts_leave_sms_idle():
    # Qwen3-30B-A3B at M = 1: 8 experts x 12 row blocks = 96 CTAs for 264 slots -> 2 splits
    plan = choose(1, 8, 128, 2048, 768, 132)
    assert (plan.gate_up.splits, plan.down.splits) == (2, 2)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_one_token_runs_slot_tiles(model):
    e, k, h, i = MODELS[model]
    plan = choose(1, k, e, h, i, 132)
    assert plan.slot_tiles and plan.rule.startswith("moe-slot-tiles+") and plan.token_tile == 8
    # (a tile a pair: the CTAs are the pairs' row blocks, split as the sorted plan's would be;
    # the sorted tiles keep 4 weight stages in flight, the slot tiles the kernel's 2)
    sorted_plan = choose(1, k, e, h, i, 132, slot_tiles=False)
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
    plan = choose(m, k, e, h, i, 132)
    assert plan.slot_tiles and (plan.gate_up.ctas_per_sm, plan.down.ctas_per_sm) == (gate_up, down)
    assert ("moe-slot-three" in plan.rule.split("+")) == (3 in (gate_up, down))
    for g, n in ((plan.gate_up, 2 * i), (plan.down, h)):
        ctas = -(-n // 128) * m * k * g.splits
        assert (g.ctas_per_sm == 3) == (-(-ctas // 396) < -(-ctas // 264))


def test_forced_ctas_are_checked():
    e, k, h, i = MODELS["qwen3_30b_a3b"]
    with sm90_plan.forced(ctas=3, slot_tiles=True):  # small shapes: the kernel the rule takes
        forced = sm90_plan._apply_forced(choose(1, k, e, h, i, 132, True), h, i)
        assert (forced.gate_up.ctas_per_sm, forced.down.ctas_per_sm) == (3, 3)
    with sm90_plan.forced(ctas=3, slot_tiles=False), pytest.raises(ValueError, match="ctas=3"):
        sm90_plan._apply_forced(choose(64, k, e, h, i, 132, False), h, i)
    with sm90_plan.forced(ctas=2, token_tile=64), pytest.raises(
            ValueError, match=r"^ctas=2 runs slot tiles \(3\) or token tiles <= 32 \(2\), "
                              r"got token tile 64$"):
        sm90_plan._apply_forced(choose(64, k, e, h, i, 132, False), h, i)
    with sm90_plan.forced(ctas=3, prefill=True), pytest.raises(
            ValueError, match=r"got token tile 128, the prefill kernel$"):
        sm90_plan._apply_forced(choose(64, k, e, h, i, 132, False), h, i)
    with pytest.raises(ValueError, match=r"^ctas must be 1, 2 or 3, got 4$"):
        with sm90_plan.forced(ctas=4):
            pass
    with sm90_plan.forced(slot_tiles=True):  # forced otherwise: the rule's CTAs an SM stay
        plan = choose(4, k, e, h, i, 132, True)
        assert sm90_plan._apply_forced(plan, h, i).gate_up.ctas_per_sm == 3


@pytest.mark.parametrize("model, m, window", [
    ("deepseek_v3", 32, 4), ("qwen3_30b_a3b", 256, 4),  # 8- / 16-token tiles, two CTAs an SM
    ("mixtral_8x7b", 96, -1),                            # the prefill kernel: no ring window
    ("deepseek_v3", 1, -1)])                             # slot tiles: the kernel's own
def test_sorted_decode_tiles_keep_four_weight_stages_in_flight(model, m, window):
    e, k, h, i = MODELS[model]
    plan = choose(m, k, e, h, i, 132)
    assert (plan.gate_up.window, plan.down.window) == (window, window)
    assert ("moe-decode-window" in plan.rule) == (window == 4)
    with sm90_plan.forced(token_tile=64):  # one CTA an SM: the kernel's rule (the whole ring)
        forced = sm90_plan._apply_forced(choose(32, k, e, h, i, 132), h, i)
        assert (forced.gate_up.ctas_per_sm, forced.gate_up.window) == (1, -1)


@pytest.mark.parametrize("model, most", [("qwen3_30b_a3b", 5), ("qwen3_235b_a22b", 2),
                                         ("deepseek_v3", 2), ("mixtral_8x7b", 1)])
def test_slot_tiles_while_expected_rereads_stay_under_30_mb(model, most):
    # pairs beyond the active experts reread an expert's 3 * H * I weight bytes each
    e, k, h, i = MODELS[model]
    for m in range(1, 9):
        rereads = (m * k - expected_active(m * k, e)) * 3 * h * i
        assert choose(m, k, e, h, i, 132).slot_tiles == (m <= most)
        assert m == 1 or (rereads <= 30e6) == (m <= most)
    # forced on for several tokens: one tile each of the m * k pairs
    forced = choose(4, k, e, h, i, 132, slot_tiles=True)
    assert forced.slot_tiles and not forced.prefill and forced.token_tile == 8
    want = max(1, min(2 * 132 // (-(-h // 128) * 4 * k), -(-i // 128) // 2))
    # (moe-slot-kbs: <= 64 K blocks a split, Mixtral's 112 in two at least; moe-slot-three)
    splits = max(want, -(-i // 128 // 64))
    ctas = 3 if slot_three_takes(-(-h // 128) * 4 * k * splits, 132, -(-i // 128 // splits)) else 2
    assert forced.down == GroupedGemmPlan(splits, ctas)


# ------------------------------------------------------------------------------ GPU
def test_forced_pieces_are_checked_and_restored():
    with pytest.raises(ValueError, match=r"^token_tile must be one of \(8, 16, 32, 64, 128\), "
                                         r"got 24$"):
        with sm90_plan.forced(token_tile=24):
            pass
    with pytest.raises(ValueError, match=r"^splits must be >= 1, got 0$"):
        with sm90_plan.forced(splits=0):
            pass
    with sm90_plan.forced(token_tile=64, pdl=False):
        assert sm90_plan._forced["slot_tiles"] is False  # a forced tile: the sorted layer
        plan = sm90_plan._apply_forced(choose(2, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.token_tile, plan.pdl, plan.gate_up.ctas_per_sm, plan.rule) == (
            64, False, 1, "forced")
        assert not plan.fused_act  # (the decode kernel has no such epilogue)
    with pytest.raises(ValueError, match=r"^the prefill kernel takes 128-token tiles, got 64$"):
        with sm90_plan.forced(token_tile=64, prefill=True):
            pass
    with pytest.raises(ValueError, match=r"^slot tiles run 8-token tiles without the prefill "
                                         r"kernel, got token_tile=None, prefill=True$"):
        with sm90_plan.forced(prefill=True, slot_tiles=True):
            pass
    with pytest.raises(ValueError, match=r"^group_m must be >= 1, got 0$"):
        with sm90_plan.forced(group_m=0):
            pass
    with pytest.raises(ValueError, match=r"^window must be >= 0 \(0: the whole ring\), got -1$"):
        with sm90_plan.forced(window=-1):
            pass
    assert choose(1, 8, 128, 2048, 768, 132).gate_up.window == -1  # slot tiles: the kernel's
    with sm90_plan.forced(window=3):
        plan = sm90_plan._apply_forced(choose(2, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.gate_up.window, plan.down.window) == (3, 3)
    with sm90_plan.forced(tile_route=False):
        plan = sm90_plan._apply_forced(choose(16, 8, 128, 2048, 768, 132), 2048, 768)
        assert not plan.tile_route and not plan.slot_tiles
    with pytest.raises(ValueError, match=r"^token_rows=True needs tile_route \(gate_up finds "
                                         r"its tiles' tokens from the ids\)$"):
        with sm90_plan.forced(token_rows=True, tile_route=False):
            sm90_plan._apply_forced(choose(16, 8, 128, 2048, 768, 132), 2048, 768)
    with sm90_plan.forced(token_rows=False):
        plan = sm90_plan._apply_forced(choose(16, 8, 128, 2048, 768, 132), 2048, 768)
        assert plan.tile_route and not plan.token_rows
    plan = sm90_plan._apply_forced(choose(16, 8, 128, 2048, 768, 132), 2048, 768)
    assert plan.token_rows and plan.down_route  # (the rules', as for the plan)
    with sm90_plan.forced(down_route=False):
        plan = sm90_plan._apply_forced(choose(16, 8, 128, 2048, 768, 132), 2048, 768)
        assert plan.tile_route and not plan.down_route
    with sm90_plan.forced(prefill=True):  # (the rule's for the kernel forced)
        assert not sm90_plan._apply_forced(choose(16, 8, 128, 2048, 768, 132), 2048,
                                          768).down_route
    for piece in ("tile_route", "down_route"):
        for pieces, kernel in ((dict(prefill=True), "prefill kernel"),
                               (dict(slot_tiles=True), "slot tiles")):
            with pytest.raises(ValueError, match=rf"^{piece}=True runs the decode kernel's "
                                                 rf"sorted tiles, got the {kernel}$"):
                with sm90_plan.forced(**{piece: True}, **pieces):
                    plan = choose(16, 8, 128, 2048, 768, 132,
                                    sm90_plan._forced.get("slot_tiles"))
                    sm90_plan._apply_forced(plan, 2048, 768)
    with sm90_plan.forced(prefill=True):
        plan = sm90_plan._apply_forced(choose(2, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.prefill, plan.token_tile) == (True, 128)
        assert plan.gate_up.group_m == plan.down.group_m == 1  # (the decode plan's)
        with sm90_plan.forced(group_m=5):
            plan = sm90_plan._apply_forced(choose(2, 8, 128, 2048, 768, 132), 2048, 768)
            assert (plan.gate_up.group_m, plan.down.group_m) == (5, 5)
        assert plan.fused_act  # (the prefill kernel's epilogue, unless forced off)
        assert plan.gather_x_first  # (the prefill kernel's layers' gather)
        with sm90_plan.forced(fused_act=False):
            plan = sm90_plan._apply_forced(choose(2, 8, 128, 2048, 768, 132), 2048, 768)
            assert plan.prefill and not plan.fused_act
        with pytest.raises(ValueError, match=r"^the prefill kernel needs hidden and 2 \* "
                                             r"intermediate multiples of 128, got 2080, 768$"):
            sm90_plan._apply_forced(choose(1, 8, 128, 2080, 768, 132), 2080, 768)
    with pytest.raises(ValueError, match=r"^prefill_config must be one of \(13, 14\), "
                                         r"got 0$"):
        with sm90_plan.forced(prefill_config=0):
            pass
    with sm90_plan.forced(prefill=True, prefill_config=14):
        plan = sm90_plan._apply_forced(choose(2, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.gate_up.prefill_config, plan.down.prefill_config) == (14, 14)
        assert not plan.fused_act  # (a 192-column tile: no SiLU-and-mul epilogue)
    with pytest.raises(ValueError, match=r"^the SiLU-and-mul epilogue runs 128-column tiles, "
                                         r"got prefill_config=14 \(192 columns\)$"):
        with sm90_plan.forced(prefill=True, prefill_config=14, fused_act=True):
            sm90_plan._apply_forced(choose(2, 8, 128, 2048, 768, 132), 2048, 768)
    # a plan on the pairs' tile takes the default one forced, and with it the epilogue
    with sm90_plan.forced(prefill_config=13):
        plan = sm90_plan._apply_forced(choose(4096, 8, 128, 2048, 768, 132), 2048, 768)
        assert (plan.gate_up.prefill_config, plan.fused_act) == (13, True)
    with pytest.raises(ValueError, match=r"^the SiLU-and-mul epilogue is the prefill kernel's: "
                                         r"fused_act=True needs prefill, got the decode "
                                         r"kernel's plan$"):
        with sm90_plan.forced(fused_act=True):
            sm90_plan._apply_forced(choose(2, 8, 128, 2048, 768, 132), 2048, 768)
    assert sm90_plan._forced == {}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("m", [1, 2, 4, 16, 64, 256, 1024])
def test_sorted_decode_tiles_route_their_own_experts(model, m):
    # moe-tile-route: the decode kernel's sorted tiles, not the slot tiles (no routing) nor
    # the prefill kernel
    e, k, h, i = MODELS[model]
    plan = choose(m, k, e, h, i, 132)
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
    plan = choose(m, k, e, h, i, 132)
    want = plan.tile_route and h <= 2048 and plan.token_tile == 8
    assert plan.token_rows == want and ("moe-token-rows" in plan.rule) == want
    assert plan.token_rows == (model == "qwen3_30b_a3b" and 8 <= m <= 64)


@pytest.mark.parametrize("model, m, prefill", [
    # the decode token tile past 32: 27 tokens an expert (27 + sqrt 27 > 32) for hidden 2048,
    # 17 (twice 17 > 32) for hidden >= 4096
    ("qwen3_30b_a3b", 416, False), ("qwen3_30b_a3b", 432, True),  # 26 / 27 tokens an expert
    ("mixtral_8x7b", 64, False), ("mixtral_8x7b", 68, True),      # 16 / 17 (hidden 4096)
    ("deepseek_v3", 512, False), ("deepseek_v3", 544, True),      # 16 / 17 (hidden 7168)
    ("qwen3_235b_a22b", 256, False), ("qwen3_235b_a22b", 272, True),
    ("qwen3_30b_a3b", 1024, True), ("deepseek_v3", 2048, True)])
def test_prefill_kernel_where_the_decode_tile_would_pass_32_tokens(model, m, prefill):
    e, k, h, inter = MODELS[model]
    plan = choose(m, k, e, h, inter, 132)
    assert plan.prefill == prefill and ("moe-prefill" in plan.rule) == prefill
    assert plan.token_tile == 128 or not prefill
    # moe-prefill-fused-act: SiLU-and-mul + quantization in gate_up's epilogue, to hidden 4096
    # (on 128-column tiles: below 128 tokens an expert, test_prefill_pairs_from_128_tokens...)
    fused = prefill and h <= 4096
    assert plan.fused_act == fused and ("moe-prefill-fused-act" in plan.rule) == fused
    from fp8linear.backends.sm90 import moe as sm90_moe
    assert (sm90_moe.stages(plan).gate_up_silu_quant is not None) == fused
    # moe-gather-x-first: the prefill layer's gather quantizes x before its wait
    assert plan.gather_x_first == prefill and ("moe-gather-x-first" in plan.rule) == prefill
    assert sm90_moe.stages(plan).gather_quant.keywords["x_first"] == prefill
    if prefill:  # no K splits: the persistent kernel walks whole K
        assert plan.gate_up == plan.down == GroupedGemmPlan(1, 1)
    # hidden sizes off the 128 grid keep the decode kernel, on the tile the rule asks for
    off_grid = choose(m, k, e, h + 16, inter, 132)
    assert not off_grid.prefill and (off_grid.token_tile >= 64) == prefill


@pytest.mark.parametrize("model, m, band", [
    ("mixtral_8x7b", 512, 1), ("mixtral_8x7b", 1024, 4),  # 128 / 256 tokens an expert
    ("mixtral_8x7b", 4096, 4), ("qwen3_235b_a22b", 4096, 1),  # 12 MB of gate_up an expert
    ("deepseek_v3", 4096, 1), ("qwen3_30b_a3b", 4096, 1)])
def test_prefill_bands_for_experts_past_the_l2_with_two_tiles(model, m, band):
    e, k, h, inter = MODELS[model]
    plan = choose(m, k, e, h, inter, 132)
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
    plan = choose(m, k, e, h, inter, 132)
    want = GroupedGemmPlan(1, 1, plan.gate_up.group_m, 14 if pairs else 13)
    assert plan.prefill and plan.gate_up == plan.down == want
    assert ("moe-prefill-pairs" in plan.rule) == pairs
    # the SiLU-and-mul epilogue runs 128-column tiles only
    assert plan.fused_act == (not pairs and h <= 4096)


@pytest.mark.parametrize("m, k, parallel", [(31, 8, False), (32, 8, True), (127, 2, False),
                                            (128, 2, True)])
def test_parallel_routing_from_256_slots(m, k, parallel):
    plan = choose(m, k, 128, 2048, 768, 132)
    assert plan.parallel_route == parallel and ("moe-route-parallel" in plan.rule) == parallel
    from fp8linear.backends.sm90 import moe as sm90_moe
    from fp8linear.backends.triton import moe as triton_moe
    want = triton_moe.route_parallel if parallel else triton_moe.route
    route = sm90_moe.stages(plan).route  # (moe-tile-route: with the early launches)
    assert route.func is want and route.keywords == {"early_next": plan.tile_route}


def test_every_rule_a_plan_names_has_its_measurements_in_tuning_md():
    named = {rule for e, k, h, i in [*MODELS.values(), (16, 4, 1024, 256)]
             for m in (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
             for rule in choose(m, k, e, h, i, 132).rule.split("+")}
    assert {"moe-slot-tiles", "moe-slot-three", "moe-prefill", "moe-split-fill"} <= named
    assert undocumented(sorted(named)) == []
