"""The MoE layer's stages around the grouped GEMMs as Triton kernels, one launch each:
fp8linear.moe_routing's ``route``, the gather + quantization of the sorted rows, and
``combine`` (its torch versions define the results; tests check these against them).

- ``route``: one program. Pass 1 counts each expert's slots, pass 2 walks the slots in order,
  up to 128 at a time, and gives each the next row of its expert (its rank among the chunk's slots
  of that expert plus the rows earlier chunks took): the sorted order is by expert, then
  slot, whatever the GPU. Then each tile's expert, from the experts' padded row ranges.
- ``route_parallel``: the same rows in three launches whose work does not grow serially with
  the slots: one program a chunk of slots counts its chunk's experts; one program scans the
  chunks' counts (each chunk's first row per expert); one program a chunk places its slots.
- ``gather_quant``: each token quantized once (quant_group, the quant kernel's bit-exact
  numerics) and stored to its top-k sorted rows (slot_row).
- ``silu_mul_quant``: swiglu_quant.py's numerics over the sorted rows of the slots.
  These two leave the rows that hold no token unwritten: padding rows, whose GEMM outputs
  no one reads (every row is computed on its own), and the rows of unused tiles (tile_expert
  -1: the routing's bound exceeds the tiles used by up to one an expert), which the GEMMs
  skip. At 128-token tiles half the rows of a used tile may be padding.
- ``combine``: out[t] = sum over slots j, in order, of w[t, j] * y[slot_row[t, j]], in fp32.

Slots of expert id -1 (held by another rank: expert parallelism) take no row: the routing
leaves them out (slot_row -1), the gather and SiLU-and-mul skip them, the combine adds
nothing for them.

Every launch is a PDL launch where the GPU has them (norm_quant.py's protocol: wait for the
kernel before, then let the next one launch after the last load), so that each one's launch
overlaps the tail of the kernel before it: the layer is a chain of six dependent launches.
``early_next`` (moe-tile-route: gate_up finds its tiles' experts from the ids, reading nothing
of the routing before its own wait): the routing's first launch lets the next one launch
right after its wait (so the kernel that wrote the ids is done), and the later ones, through
the gather, at their start, so that gate_up streams its weights while they run; SiLU-and-mul
likewise lets down launch at its start (moe-down-route: down finds its tiles' experts from
the ids too). ``x_first`` (moe-gather-x-first, the prefill kernel's layers): the gather reads
and quantizes its tokens before its wait, so that only its stores wait for the routing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...moe_routing import Routing, max_tiles
from ...quant import AMAX_EPS, BLOCK, FP8_DTYPE, FP8_MAX, cdiv, empty_scale_t, scale_view
from . import swiglu_quant
from .norm_quant import pdl_acquire, pdl_available, pdl_release
from .quant import needs_round_first, quant_group

# slots a step of the routing program compares with every expert: a [slots, experts] tile
# of at most 16K elements (registers), 128 slots for 128 experts, 16 for 1024
ROUTE_TILE_ELEMENTS = 16384
# experts a program of the parallel routing's scan (their chunks' counts walked in parallel)
SCAN_EXPERTS = 16


@triton.jit
def _enter(USE_GDC: tl.constexpr, NEXT_FIRST: tl.constexpr):
    """pdl_acquire; NEXT_FIRST: the next launch let go first (it waits for us itself)."""
    if USE_GDC and NEXT_FIRST:
        tl.extra.cuda.gdc_launch_dependents()
    pdl_acquire(USE_GDC, False)


@triton.jit
def _store_tile_experts(ends, experts, tile_expert_ptr, E: tl.constexpr, TILE: tl.constexpr,
                        T_BEGIN, T_END, BLOCK_T: tl.constexpr):
    """Tiles [T_BEGIN, T_END): tile t's expert, the first whose padded rows (ending at
    ends[e]) end after the tile's first row; -1 past the last expert's rows."""
    for t0 in range(T_BEGIN, T_END, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        past = (ends[None, :] <= (t * TILE)[:, None]) & (experts[None, :] < E)
        e = tl.sum(past.to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + t, tl.where(e < E, e, -1), mask=t < T_END)


@triton.jit
def _chunk_hits(ids_ptr, b, S, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """Chunk b's slots, their expert ids (-1 past S) and their [BLOCK_S, BLOCK_E] one-hot
    experts."""
    slot = b * BLOCK_S + tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + slot, mask=slot < S, other=-1).to(tl.int32)
    return slot, ids, (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)


@triton.jit
def _place_chunk(ids_ptr, b, first, row_token_ptr, slot_row_ptr, S, TOP_K,
                 BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """Chunk b's slots placed: a slot's row = ``first`` (its expert's first row for this
    chunk) + its rank among the chunk's slots of that expert. Returns the chunk's slots per
    expert."""
    slot, ids, hit = _chunk_hits(ids_ptr, b, S, BLOCK_E, BLOCK_S)
    before = tl.cumsum(hit, axis=0) - hit                 # same expert, earlier in the chunk
    row = tl.sum((before + first[None, :]) * hit, axis=1)
    # (id -1: held elsewhere, no row; from the ids, not a sum over the one-hot rows: the
    # sum cost the one-program routing 2.3 us at 8 slots)
    placed = ids >= 0
    tl.store(slot_row_ptr + slot, tl.where(placed, row, -1).to(tl.int64), mask=slot < S)
    tl.store(row_token_ptr + row, (slot // TOP_K).to(tl.int64), mask=(slot < S) & placed)
    return tl.sum(hit, axis=0)


@triton.jit
def _fill_padding(row_token_ptr, r_begin, r_end, ROWS, BLOCK_S: tl.constexpr):
    """Sorted rows [r_begin, min(r_end, ROWS)) marked padding (-1)."""
    lanes = tl.arange(0, BLOCK_S)
    for r0 in range(r_begin, r_end, BLOCK_S):
        tl.store(row_token_ptr + r0 + lanes, tl.full([BLOCK_S], -1, tl.int64),
                 mask=r0 + lanes < ROWS)


@triton.jit
def _route_kernel(ids_ptr, tile_expert_ptr, row_token_ptr, slot_row_ptr, S, TOP_K,
                  E: tl.constexpr, BLOCK_E: tl.constexpr, TILE: tl.constexpr, TILES,
                  BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, USE_GDC: tl.constexpr,
                  EARLY_NEXT: tl.constexpr):
    pdl_acquire(USE_GDC, EARLY_NEXT)
    experts = tl.arange(0, BLOCK_E)
    chunks = tl.cdiv(S, BLOCK_S)
    # pass 1: slots per expert
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b in range(0, chunks):
        _, _, hit = _chunk_hits(ids_ptr, b, S, BLOCK_E, BLOCK_S)
        counts += tl.sum(hit, axis=0)
    padded = (counts + TILE - 1) // TILE * TILE
    ends = tl.cumsum(padded, axis=0)
    cursor = ends - padded  # the next free row of each expert
    # every sorted row starts as padding; slots then claim theirs (after the barrier)
    _fill_padding(row_token_ptr, 0, TILES * TILE, TILES * TILE, BLOCK_S)
    tl.debug_barrier()
    # pass 2: in slot order, a slot's row = its expert's cursor + its rank in this chunk
    for b in range(0, chunks):
        cursor += _place_chunk(ids_ptr, b, cursor, row_token_ptr, slot_row_ptr, S, TOP_K,
                               BLOCK_E, BLOCK_S)
    pdl_release(USE_GDC, EARLY_NEXT)
    _store_tile_experts(ends, experts, tile_expert_ptr, E, TILE, 0, TILES, BLOCK_T)


@triton.jit
def _route_count_kernel(ids_ptr, counts_ptr, row_token_ptr, S, ROWS, FILL,
                        BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, USE_GDC: tl.constexpr,
                        EARLY_NEXT: tl.constexpr):
    b = tl.program_id(0)
    pdl_acquire(USE_GDC, EARLY_NEXT)
    _, _, hit = _chunk_hits(ids_ptr, b, S, BLOCK_E, BLOCK_S)
    pdl_release(USE_GDC, EARLY_NEXT)
    tl.store(counts_ptr + b * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(hit, axis=0))
    # every sorted row starts as padding (this chunk's share of them; placed in a later launch)
    _fill_padding(row_token_ptr, b * FILL, (b + 1) * FILL, ROWS, BLOCK_S)


@triton.jit
def _route_scan_kernel(counts_ptr, first_ptr, totals_ptr, CHUNKS, BLOCK_E: tl.constexpr,
                       BLOCK_EC: tl.constexpr, BLOCK_B: tl.constexpr, USE_GDC: tl.constexpr,
                       EARLY_NEXT: tl.constexpr):
    """BLOCK_EC experts a program: each chunk's count of earlier chunks' slots of the expert
    (first) and the expert's slots (totals). Experts are independent, so the scan runs in
    parallel over them (one program over all of them was the routing's longest launch)."""
    _enter(USE_GDC, EARLY_NEXT)
    experts = tl.program_id(0) * BLOCK_EC + tl.arange(0, BLOCK_EC)
    total = tl.zeros([BLOCK_EC], dtype=tl.int32)
    for b0 in range(0, CHUNKS, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        at = b[:, None] * BLOCK_E + experts[None, :]
        c = tl.load(counts_ptr + at, mask=b[:, None] < CHUNKS, other=0)
        tl.store(first_ptr + at, tl.cumsum(c, axis=0) - c + total[None, :],
                 mask=b[:, None] < CHUNKS)
        total += tl.sum(c, axis=0)
    pdl_release(USE_GDC, EARLY_NEXT)
    tl.store(totals_ptr + experts, total)


@triton.jit
def _route_place_kernel(ids_ptr, first_ptr, totals_ptr, tile_expert_ptr, row_token_ptr,
                        slot_row_ptr, S, TOP_K, E: tl.constexpr, BLOCK_E: tl.constexpr,
                        TILE: tl.constexpr, TILES, TILES_PER,
                        BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, USE_GDC: tl.constexpr,
                        EARLY_NEXT: tl.constexpr):
    """Chunk b placed: the experts' first rows from their totals (every program sums the
    few totals itself: no further launch), plus earlier chunks' slots; and the chunk's
    share of tile_expert."""
    b = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    _enter(USE_GDC, EARLY_NEXT)
    total = tl.load(totals_ptr + experts)
    first = tl.load(first_ptr + b * BLOCK_E + experts)
    pdl_release(USE_GDC, EARLY_NEXT)
    padded = (total + TILE - 1) // TILE * TILE
    ends = tl.cumsum(padded, axis=0)
    _place_chunk(ids_ptr, b, first + ends - padded, row_token_ptr, slot_row_ptr, S, TOP_K,
                 BLOCK_E, BLOCK_S)
    _store_tile_experts(ends, experts, tile_expert_ptr, E, TILE, b * TILES_PER,
                        tl.minimum((b + 1) * TILES_PER, TILES), BLOCK_T)


def route_parallel(topk_ids: torch.Tensor, num_experts: int, token_tile: int,
                   early_next: bool = False) -> Routing:
    """moe_routing.route in three launches (count, scan, place), for many slots."""
    r, slots, block_e, block_s, warps = _routing(topk_ids, num_experts, token_tile)
    pdl = pdl_available(topk_ids.device)
    chunks = cdiv(slots, block_s)
    dev = topk_ids.device
    counts = torch.empty(chunks, block_e, dtype=torch.int32, device=dev)
    first = torch.empty_like(counts)
    totals = torch.empty(block_e, dtype=torch.int32, device=dev)
    _route_count_kernel[(chunks,)](topk_ids, counts, r.row_token, slots, r.rows,
                                   cdiv(cdiv(r.rows, chunks), block_s) * block_s, block_e,
                                   block_s, pdl, early_next, num_warps=warps, launch_pdl=pdl)
    block_ec = min(block_e, SCAN_EXPERTS)
    block_b = max(1, min(triton.next_power_of_2(chunks), ROUTE_TILE_ELEMENTS // block_ec))
    _route_scan_kernel[(block_e // block_ec,)](counts, first, totals, chunks, block_e, block_ec,
                                                block_b, pdl, early_next, num_warps=4,
                                                launch_pdl=pdl)
    tiles = r.tile_expert.shape[0]
    _route_place_kernel[(chunks,)](topk_ids, first, totals, r.tile_expert, r.row_token,
                                   r.slot_row, slots, topk_ids.shape[1], num_experts, block_e,
                                   token_tile, tiles, cdiv(tiles, chunks), block_s, 32, pdl,
                                   early_next, num_warps=warps, launch_pdl=pdl)
    return r


def route(topk_ids: torch.Tensor, num_experts: int, token_tile: int,
          early_next: bool = False) -> Routing:
    """moe_routing.route in one launch (topk_ids contiguous int32/int64 [M, k])."""
    r, slots, block_e, block_s, warps = _routing(topk_ids, num_experts, token_tile)
    pdl = pdl_available(topk_ids.device)
    _route_kernel[(1,)](topk_ids, r.tile_expert, r.row_token, r.slot_row, slots,
                        topk_ids.shape[1], num_experts, block_e, token_tile,
                        r.tile_expert.shape[0], block_s, 32, pdl, early_next,
                        num_warps=warps, launch_pdl=pdl)
    return r


def _routing(topk_ids: torch.Tensor, num_experts: int, token_tile: int):
    """(the Routing's empty tensors, slots, expert block, slots a step, warps) of a routing
    launch: a step compares [slots, experts] of at most ROUTE_TILE_ELEMENTS."""
    m, k = topk_ids.shape
    tiles = max_tiles(m * k, num_experts, token_tile)
    dev = topk_ids.device
    r = Routing(token_tile, torch.empty(tiles, dtype=torch.int32, device=dev),
                torch.empty(tiles * token_tile, dtype=torch.int64, device=dev),
                torch.empty(m, k, dtype=torch.int64, device=dev), topk_ids)
    block_e = triton.next_power_of_2(num_experts)
    block_s = max(16, min(128, ROUTE_TILE_ELEMENTS // block_e))
    return r, m * k, block_e, block_s, 8 if block_e >= 256 else 4


@triton.jit
def _gather_quant_kernel(x_ptr, slot_row_ptr, q_ptr, s_ptr, s_ld, M,
                         K: tl.constexpr, TOP_K: tl.constexpr, CG: tl.constexpr,
                         GR: tl.constexpr, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr,
                         ROUND_FIRST: tl.constexpr, USE_GDC: tl.constexpr,
                         EARLY_NEXT: tl.constexpr, X_FIRST: tl.constexpr):
    # GR (token, group) pairs a program: GR // CG tokens of CG groups, flattened to [GR, 128];
    # each pair quantized once and stored to its token's TOP_K sorted rows
    j = tl.arange(0, GR)
    t = (tl.program_id(0) * (GR // CG) + j // CG).to(tl.int64)
    g = tl.program_id(1) * CG + j % CG
    live = (t < M) & (g * 128 < K)
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = live[:, None] & (cols < K)
    if not X_FIRST:
        _enter(USE_GDC, EARLY_NEXT)
    x = tl.load(x_ptr + t[:, None] * K + cols, mask=mask, other=0.0).to(tl.float32)
    if not X_FIRST:
        pdl_release(USE_GDC, EARLY_NEXT)
    q, s = quant_group(x, FP8_MAX_C, EPS, ROUND_FIRST)
    if X_FIRST:  # (x_first: only the stores wait for the routing; the next launch after them)
        _enter(USE_GDC, EARLY_NEXT)
    for k in tl.static_range(TOP_K):
        row = tl.load(slot_row_ptr + t * TOP_K + k, mask=live, other=-1)
        tl.store(q_ptr + row[:, None] * K + cols, q, mask=mask & (row >= 0)[:, None])
        tl.store(s_ptr + g.to(tl.int64) * s_ld + row, s, mask=live & (row >= 0))
    if X_FIRST:
        pdl_release(USE_GDC, EARLY_NEXT)


def gather_quant(x: torch.Tensor, r: Routing, groups: int | None = None,
                 early_next: bool = False, x_first: bool = False):
    """(fp8 [R, K], scale [R, Kb] as a view of the token-minor [Kb, ld]) of the sorted rows:
    each token quantized once and stored to its top-k rows. Rows that hold no token (padding,
    unused tiles) are not written: the grouped GEMMs compute every row on its own, and the
    combine reads the token rows only. ``groups``: 128-channel groups a program (tests,
    benchmarks). ``x_first`` (moe-gather-x-first): x is read and quantized before the wait
    for the kernel before, as x was written before the routing's first launch (which waits
    for the kernels before it before it lets the next one launch)."""
    m, k = x.shape
    kb = cdiv(k, BLOCK)
    q, scale_t, scale = sorted_buffers(r, k, x.device)
    cg, gr = pair_split(kb, m, groups)
    pdl = pdl_available(x.device)
    _gather_quant_kernel[(cdiv(m, gr // cg), cdiv(kb, cg))](
        x, r.slot_row, q, scale_t, scale_t.shape[1], m, k, r.slot_row.shape[1], cg, gr,
        FP8_MAX, AMAX_EPS, needs_round_first(x.device), pdl, early_next, x_first, num_warps=4,
        launch_pdl=pdl)
    return q, scale


def sorted_buffers(r: Routing, k: int, device):
    """For the sorted rows: fp8 [R, k], its token-minor scales [ceil(k / 128), R rounded up
    to 4] (the GEMMs' 16-byte aligned scale rows, which the kernels write) and those scales
    as the [R, ceil(k / 128)] view the GEMMs read."""
    scale_t = empty_scale_t(r.rows, cdiv(k, BLOCK), device)
    return (torch.empty(r.rows, k, dtype=FP8_DTYPE, device=device), scale_t,
            scale_view(scale_t, r.rows))


# The gather and SiLU-and-mul programs take (row, 128-channel group) pairs: from 4096 pairs
# 16 a program (2048 values, 16 a thread of 4 warps), at most 16 groups of a row; below, one
# row's 4 groups, for more programs at decode sizes. With one row a program, SiLU-and-mul
# over the sorted rows was program-bound (Qwen3-30B-A3B M = 1024: 57 us for 25 MB).
WIDE_MIN_PAIRS = 4096
WIDE_PAIRS = 16


def pair_split(groups: int, rows: int, forced: int | None = None) -> tuple[int, int]:
    """(groups a program of a row, a power of 2 that wastes no lanes where one divides
    ``groups``; (row, group) pairs a program); ``forced``: the former (tests, benchmarks)."""
    wide = rows * groups >= WIDE_MIN_PAIRS
    cg = forced or next(c for c in ((16, 8, 4, 2, 1) if wide else (4, 2, 1))
                        if c <= groups and (groups % c == 0 or c == 1))
    return cg, max(cg, WIDE_PAIRS) if wide else cg


@triton.jit
def _silu_mul_quant_kernel(x_ptr, slot_row_ptr, q_ptr, s_ptr, s_ld, SLOTS, D: tl.constexpr,
                           CG: tl.constexpr, GR: tl.constexpr, FP8_MAX_C: tl.constexpr,
                           EPS: tl.constexpr, ROUND_FIRST: tl.constexpr,
                           USE_GDC: tl.constexpr, EARLY_NEXT: tl.constexpr):
    # GR (slot, group) pairs a program: the sorted rows of GR // CG slots, CG groups each
    j = tl.arange(0, GR)
    slot = tl.program_id(0) * (GR // CG) + j // CG
    g = tl.program_id(1) * CG + j % CG
    live = (slot < SLOTS) & (g * 128 < D)
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    _enter(USE_GDC, EARLY_NEXT)
    row = tl.load(slot_row_ptr + slot, mask=live, other=-1)
    live = live & (row >= 0)  # (a slot held elsewhere has no row)
    mask = live[:, None] & (cols < D)
    a = tl.load(x_ptr + row[:, None] * (2 * D) + cols, mask=mask, other=0.0)
    b = tl.load(x_ptr + row[:, None] * (2 * D) + D + cols, mask=mask, other=0.0)
    pdl_release(USE_GDC, EARLY_NEXT)
    q, s = quant_group(swiglu_quant.silu_mul(a, b).to(tl.float32), FP8_MAX_C, EPS, ROUND_FIRST)
    tl.store(q_ptr + row[:, None] * D + cols, q, mask=mask)
    tl.store(s_ptr + g.to(tl.int64) * s_ld + row, s, mask=live)


def silu_mul_quant(gate_up: torch.Tensor, r: Routing, groups: int | None = None,
                   early_next: bool = False):
    """SiLU-and-mul + quantization of the sorted rows that hold a token (slot_row; the
    numerics of fp8linear.swiglu_quant): (fp8 [R, I], scale [R, Ib] as a view of the
    token-minor [Ib, ld]); the other rows are not written. ``groups``: as gather_quant's;
    ``early_next``: the next launch let go at the start (it reads nothing of ours before its
    wait: moe-down-route)."""
    d = gate_up.shape[1] // 2
    q, scale_t, scale = sorted_buffers(r, d, gate_up.device)
    slots = r.slot_row.numel()
    cg, gr = pair_split(cdiv(d, BLOCK), slots, groups)
    pdl = pdl_available(gate_up.device)
    _silu_mul_quant_kernel[(cdiv(slots, gr // cg), cdiv(cdiv(d, BLOCK), cg))](
        gate_up, r.slot_row, q, scale_t, scale_t.shape[1], slots, d, cg, gr, FP8_MAX, AMAX_EPS,
        needs_round_first(gate_up.device), pdl, early_next, num_warps=4, launch_pdl=pdl)
    return q, scale


@triton.jit
def _combine_kernel(y_ptr, slot_row_ptr, w_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr,
                    BLOCK_H: tl.constexpr, SORTED: tl.constexpr, USE_GDC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    pdl_acquire(USE_GDC, False)
    for j in tl.static_range(TOP_K):  # slot 0 first: the same sum every run
        # sorted: the slot's row, -1 for none; unsorted: the rows are the pairs in order, as
        # the slot tiles write them, and the pointer holds the pairs' expert ids (-1: none)
        at = tl.load(slot_row_ptr + t * TOP_K + j)
        row = tl.maximum(at, 0) if SORTED else t * TOP_K + j
        # a slot held elsewhere adds nothing: its row unread (a masked load; selecting the
        # loaded row away cost 0.7-0.8 us a launch), its weight selected away
        here = at >= 0
        w = tl.where(here, tl.load(w_ptr + t * TOP_K + j).to(tl.float32), 0.0)
        # (the mask broadcast by hand: Triton's interpreter refuses a scalar one, and a
        # vector & scalar one's dtype)
        here_h = tl.full([BLOCK_H], 0, at.dtype) + at >= 0
        acc += w * tl.load(y_ptr + row * H + cols, mask=mask & here_h, other=0.0).to(tl.float32)
    pdl_release(USE_GDC, False)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, r: Routing | None, topk_weights: torch.Tensor,
            out: torch.Tensor, topk_ids: torch.Tensor | None = None) -> torch.Tensor:
    """moe_routing.combine into out (contiguous [M, H]); r None: y's rows are the (token,
    slot) pairs in order ([M * k, H], as the slot tiles write them), topk_ids theirs (pairs
    of id -1, held elsewhere, add nothing)."""
    m, k = topk_weights.shape
    h = y.shape[1]
    block_h = min(1024, triton.next_power_of_2(h))
    pdl = pdl_available(y.device)
    _combine_kernel[(m, cdiv(h, block_h))](y, topk_ids if r is None else r.slot_row,
                                           topk_weights, out, h, k, block_h, r is not None,
                                           pdl, num_warps=4, launch_pdl=pdl)
    return out
