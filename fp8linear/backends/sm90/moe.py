"""The Hopper MoE layer: the grouped expert GEMMs with the Triton kernels of the stages
between (backends/triton/moe.py), in fp8linear.moe_routing's pipeline, as moe_plan.py plans
them. Two grouped GEMMs: few tokens an expert run the decode kernel over every active
expert's weights in one launch (csrc/sm90/moe.cu); 128-token tiles run the persistent large-M
kernel over the experts' tiles (csrc/sm90/gemm.cu: launch_moe_prefill), gate_up's with
SiLU-and-mul and the quantization of h in its epilogue (no SiLU-and-mul launch). One token,
or a few (slot tiles), skip the sorting: three launches, the decode kernel a (token, slot) pair
a tile reading its token's row itself (gate_up), then its pair's gate_up row with SiLU-and-mul
(down), then the combine (in down's epilogue it measured no faster: the last CTA's serial
sum costs what the launch did).
"""
from __future__ import annotations

import functools

import torch

from ...moe_routing import Routing, Stages, sorted_moe
from ...quant import BLOCK, cdiv
from ..triton import moe as triton_moe
from . import library
from .moe_plan import ROWS, GroupedGemmPlan, MoePlan, for_call
from .tiles import DECODE_TILES


def supported(hidden: int, inter: int, block_scales: bool) -> bool:
    # TMA rows of 16 bytes (K % 16, N % 8), SiLU-and-mul + quant's whole 128-channel groups,
    # and 128x128 weight scales (moe.cu reads no per-row scales)
    return hidden % 16 == 0 and inter % BLOCK == 0 and block_scales


def _grouped_gemm(plan: MoePlan):
    if plan.prefill:
        def prefill(a, a_scale, w, w_scale, r: Routing, out, which: int):
            g = plan.gate_up if which == 0 else plan.down
            library.load().grouped_prefill(a, a_scale, w, w_scale, out, r.tile_expert,
                                           r.row_token, g.group_m, plan.pdl,
                                           config=g.prefill_config)
        return prefill

    def decode(a, a_scale, w, w_scale, r: Routing, out, which: int):
        # the decode kernel over the routing's tiles: each GEMM's first wave finds its tiles'
        # experts from the ids (moe-tile-route, moe-down-route), and gate_up, given x's tokens
        # (a_scale None: moe-token-rows), reads its rows' tokens itself
        g = plan.gate_up if which == 0 else plan.down
        tiles = cdiv(w.shape[1], ROWS) * r.tile_expert.shape[0]
        ids = r.ids if (plan.tile_route if which == 0 else plan.down_route) else None
        library.load().grouped(a, a_scale, w, w_scale, out, r.tile_expert,
                               _partials(g, tiles, r.token_tile), tiles, plan.config, g.splits,
                               g.ctas_per_sm, plan.pdl, g.window, ids,
                               r.row_token if a_scale is None else None)
    return decode


def _partials(g: GroupedGemmPlan, tiles: int, token_tile: int) -> int:
    """fp32 floats of the split-K partials of a grouped decode GEMM (one [tile x 128] partial
    a split of each tile; none unsplit)."""
    return g.splits * tiles * token_tile * ROWS if g.splits > 1 else 0


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fused_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, out):
    m, hidden = x.shape
    experts, two_i, _ = w13.shape
    plan = for_call(m, topk_ids.shape[1], experts, hidden, two_i // 2, _sms(x.device.index))
    if plan.slot_tiles:
        return _slot_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, plan, out)
    return sorted_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
                      plan.token_tile, stages(plan), out)


def _slot_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, plan: MoePlan, out):
    """The layer over slot tiles (moe-slot-tiles): gate_up over the tokens' rows, down over
    SiLU-and-mul of the pairs' gate_up rows, the combine; the pairs' rows in order, unsorted
    (the pairs of id -1 held elsewhere: rows left unwritten by both GEMMs, skipped by the
    combine)."""
    slots = topk_ids.numel()
    lib = library.load()

    def gemm(a, w, w_scale, y, g: GroupedGemmPlan, down: bool):
        tiles = cdiv(w.shape[1], ROWS) * slots
        # (gate_up waits for the kernel that wrote topk_ids before it reads them; down's
        # kernel before it, gate_up, did)
        lib.grouped_slots(a, w, w_scale, y, topk_ids, _partials(g, tiles, DECODE_TILES[0]),
                          tiles, g.splits, g.ctas_per_sm, plan.pdl, silu_in=down,
                          ids_ready=down, window=g.window)
    gate_up = torch.empty(slots, w13.shape[1], dtype=x.dtype, device=x.device)
    gemm(x, w13, w13_scale, gate_up, plan.gate_up, False)
    y = torch.empty(slots, x.shape[1], dtype=x.dtype, device=x.device)
    gemm(gate_up, w2, w2_scale, y, plan.down, True)
    return triton_moe.combine(y, None, topk_weights, out, topk_ids)


def _gate_up_silu_quant(plan: MoePlan):
    def run(a, a_scale, w13, w13_scale, r: Routing, dtype):
        q, _, scale = triton_moe.sorted_buffers(r, w13.shape[1] // 2, a.device)
        g = plan.gate_up
        library.load().grouped_prefill(a, a_scale, w13, w13_scale, q, r.tile_expert,
                                       r.row_token, g.group_m, plan.pdl, scale, dtype,
                                       g.prefill_config)
        return q, scale
    return run


@functools.lru_cache(maxsize=None)
def stages(plan: MoePlan) -> Stages:
    route = triton_moe.route_parallel if plan.parallel_route else triton_moe.route
    # (moe-tile-route: gate_up reads no routing output before its wait)
    early = {"early_next": True} if plan.tile_route else {}
    return Stages(functools.partial(route, **early),
                  functools.partial(triton_moe.gather_quant, **early,
                                    x_first=plan.gather_x_first), _grouped_gemm(plan),
                  functools.partial(triton_moe.silu_mul_quant, early_next=plan.down_route),
                  triton_moe.combine,
                  _gate_up_silu_quant(plan) if plan.fused_act else None, plan.token_rows)


