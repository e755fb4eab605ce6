"""Everything an sm90 launch needs besides its tensors, decided once per problem size.

``decide`` returns a ``Launch``: the plan (``plan.choose``) and the launch's other choices
(fused quantization, PDL triggers, early weight stages, tile order, workspace). Cached: the
rules and knob reads cost ~5 us a call on the device machine's CPU, which eager calls feel.
Each choice below has an id; docs/tuning.md gives its measurements.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ... import knobs
from ...quant import BLOCK, cdiv
from .plan import T16, DecodePlan, Plan, choose, current, on_change
from .tiles import GEMM_TILES, SMEM_PER_CTA


@dataclass(frozen=True)
class Launch:
    plan: Plan
    fused: bool           # decode: the kernel quantizes the activations itself
    tiles: int            # decode, split tail: output tiles (their counters)
    ws_floats: int        # decode, split tail: the fp32 partials' workspace (0: none)
    pdl: bool             # our kernels under programmatic dependent launch
    early: bool           # decode: the next kernel may launch as soon as ours starts
    gemm_pdl: bool        # large M: launched under PDL
    gemm_early_b: int     # large M: first weight stages requested before the PDL wait
    gemm_group_m: int     # large M: tile order's band of M units


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_launches: dict = {}
# Prefill sees many token counts (up to max_num_batched_tokens per weight shape): a bounded
# cache, emptied when full (an entry costs ~10 us to rebuild).
_MAX_LAUNCHES = 8192


def _forget() -> None:
    _launches.clear()


knobs.on_reload(_forget)
on_change(_forget)


def decide(m: int, n: int, k: int, x_dtype, index: int, linear: bool) -> Launch:
    """linear: fp8_linear's launch (bf16/fp16/fp32 x; its large-M GEMM runs behind our quant
    kernel), else block_fp8_gemm's (fp8 x)."""
    key = (m, n, k, x_dtype, index, linear)
    got = _launches.get(key)
    if got is not None:
        return got
    sms = num_sms(index)
    plan = choose(m, n, k, sms, after_quant=linear)
    fused, tiles, ws_floats, early = False, 0, 0, False
    if isinstance(plan, DecodePlan):
        fused = linear and x_dtype != torch.float32 and fuse_quant(m, k, plan)
        tiles = cdiv(n, plan.rows) * cdiv(m, plan.token_tile)
        if plan.splits > 1:
            # (a split's partial tile spans the CTA's 64 or 128 rows, however many it owns)
            ws_floats = plan.splits * tiles * plan.token_tile * (64 if plan.rows == 64 else 128)
        early = decode_early_trigger(plan, tiles, sms)
    elif plan.tile.split_tail:
        # a partial tile a CTA, at most one CTA an SM (csrc/sm90/gemm_kernel.cuh kSplitTail)
        tiles = cdiv(m, plan.tile.bm) * cdiv(n, plan.tile.bn)
        ws_floats = sms * plan.tile.bm * plan.tile.bn
    pdl = knobs.get(knobs.PDL) != "0"
    g_pdl = gemm_pdl(pdl)
    is_gemm = not isinstance(plan, DecodePlan)
    early_b = gemm_early_weights(m, k, plan.config, linear) if g_pdl and is_gemm else 0
    group_m = gemm_group_m(m, k) if is_gemm else 0
    got = Launch(plan, fused, tiles, ws_floats, pdl, early, g_pdl, early_b, group_m)
    if knobs.CACHE_VALUES:  # (tests switch knobs between calls: no cache then)
        if len(_launches) >= _MAX_LAUNCHES:
            _launches.clear()
        _launches[key] = got
    return got


FUSE_QUANT_MAX_M = T16
FUSE_QUANT_MAX_GROUPS = 128


def fuse_quant(m: int, k: int, plan: Plan) -> bool:
    """fuse-quant: the decode kernel quantizes bf16/fp16 activations itself up to 16 tokens
    where a CTA's slice is <= 128 groups of 128 and <= a quarter of its shared memory."""
    v = current().fuse_quant
    if plan.kind != "decode" or m > FUSE_QUANT_MAX_M or v is False:
        return False
    kbs = cdiv(cdiv(k, BLOCK), plan.splits)  # K blocks a CTA
    if kbs * plan.token_tile * BLOCK > SMEM_PER_CTA[plan.ctas_per_sm] // 4:
        return False
    return v is True or m * kbs <= FUSE_QUANT_MAX_GROUPS


def decode_early_trigger(plan: DecodePlan, tiles: int, sms: int) -> bool:
    """decode-early-trigger: the next kernel may launch (PDL) as soon as ours starts, where
    our grid has a split reduction at two CTAs an SM, or takes more than a wave."""
    v = current().decode_early_trigger
    if v is not None:
        return v
    return (plan.splits > 1 and plan.ctas_per_sm == 2) or tiles * plan.splits > sms


def gemm_pdl(pdl: bool) -> bool:
    """gemm-pdl: the large-M kernel under PDL (its prologue overlaps the previous kernel)."""
    return pdl and current().gemm_pdl is not False


EARLY_B_MAX_M = 256
EARLY_B_SHORT_K_MAX_M = 128   # K loops of < 8 blocks: up to here only
EARLY_STAGES_LEAN = 8
EARLY_STAGES_FULL = 4
EARLY_B_AFTER_QUANT_MAX_M = 128
EARLY_STAGES_AFTER_QUANT = 4


def gemm_early_weights(m: int, k: int, config: int, after_quant: bool) -> int:
    """gemm-early-weights: first weight stages the large-M kernel requests before its PDL
    wait (0: none): 8 lean / 4 full-register up to 256 tokens (128 over < 8 K blocks);
    behind our quant kernel 4, up to 128 tokens."""
    o = current()
    tile = GEMM_TILES[config]
    stages = o.gemm_early_stages
    if stages is None:
        if after_quant:
            stages = EARLY_STAGES_AFTER_QUANT
        else:
            stages = EARLY_STAGES_LEAN if tile.lean else EARLY_STAGES_FULL
    stages = min(stages, tile.stages)
    if o.gemm_early_b is not None:
        return stages if o.gemm_early_b else 0
    if after_quant:
        max_m = EARLY_B_AFTER_QUANT_MAX_M
    else:
        max_m = EARLY_B_MAX_M if cdiv(k, BLOCK) >= 8 else EARLY_B_SHORT_K_MAX_M
    return stages if m <= max_m else 0


GROUP_M = 8
GROUP_M_LONG = 4           # from 4096 tokens over >= 64 K blocks
GROUP_M_LONG_MIN_M = 4096
GROUP_M_LONG_MIN_KB = 64
GROUP_M_SHORT = 16         # from 2048 tokens over < 64 K blocks
GROUP_M_SHORT_MIN_M = 2048


def gemm_group_m(m: int, k: int) -> int:
    """gemm-group-m: the tile order's band of M units: 8; 4 from 4096 tokens over >= 64 K
    blocks; 16 from 2048 tokens over fewer."""
    if current().gemm_group_m is not None:
        return current().gemm_group_m
    num_kb = cdiv(k, BLOCK)
    if m >= GROUP_M_LONG_MIN_M and num_kb >= GROUP_M_LONG_MIN_KB:
        return GROUP_M_LONG
    if m >= GROUP_M_SHORT_MIN_M and num_kb < GROUP_M_LONG_MIN_KB:
        return GROUP_M_SHORT
    return GROUP_M
