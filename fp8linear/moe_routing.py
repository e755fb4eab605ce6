"""The stages of a block-FP8 MoE layer around its two grouped GEMMs, for any backend.

The (token, slot) pairs are sorted by expert into token tiles of ``token_tile`` rows, one
expert a tile (``route``); each grouped GEMM then runs every tile against its expert's
weights in one launch. Order inside an expert: by token, then slot (stable), so a layer's
result never depends on the run. Everything here is fixed-shape tensor work with no host
sync (CUDA graphs, torch.compile): the sizes are bounds that depend only on M, top-k, E and
the tile.

    x -> gather by row_token, quantize -> grouped GEMM (w13) -> SiLU-and-mul + quantize
      -> grouped GEMM (w2) -> out[t] = sum_j topk_weights[t, j] * y[slot_row[t, j]] (fp32)

A slot of expert id -1 (its expert held by another rank: expert parallelism) takes no row
(slot_row -1) and adds nothing to its token's sum.

The torch functions here define each stage; a backend brings its own (``Stages``):
backends/triton/moe.py has them as one kernel each, and a backend may fold SiLU-and-mul +
quantization into gate_up's GEMM (``gate_up_silu_quant``: the sm90 prefill kernel), or the
gather + quantization (``gate_up_reads_tokens``: the sm90 decode kernel reading its rows'
tokens).

The numerics are moe.py's (``moe_reference``): each row is computed on its own, so sorting
and padding change no result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .quant import cdiv, quantize_activation, silu_mul_reference


@dataclass(frozen=True)
class Routing:
    """Where each (token, slot) goes in the expert-sorted rows."""
    token_tile: int
    tile_expert: torch.Tensor  # int32 [max_tiles]: the expert of each tile, -1: unused
    row_token: torch.Tensor    # int64 [max_tiles * token_tile]: source token, -1: padding
    slot_row: torch.Tensor     # int64 [M, top_k]: the sorted row of each (token, slot), -1: none
    ids: torch.Tensor          # [M, top_k]: the expert ids sorted (a grouped GEMM may find its
                               # tiles' experts from them: backends/sm90/moe_plan.py moe-tile-route)

    @property
    def rows(self) -> int:
        return self.row_token.shape[0]


def max_tiles(slots: int, num_experts: int, token_tile: int) -> int:
    """Tiles the sorted rows may need: each active expert pads its rows to whole tiles, so at
    most cdiv(slots, tile) full ones plus one partial tile per active expert."""
    return cdiv(slots, token_tile) + min(num_experts, slots)


def route(topk_ids: torch.Tensor, num_experts: int, token_tile: int) -> Routing:
    """Sorts the (token, slot) pairs of ``topk_ids`` [M, k] by expert into padded tiles; slots
    of id -1 (an expert held elsewhere) take no row (slot_row -1)."""
    m, k = topk_ids.shape
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    slots = ids.numel()
    key = torch.where(ids >= 0, ids, num_experts)      # (-1: after every expert)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))  # (integer adds: exact in any order)
    padded = cdiv_t(counts, token_tile) * token_tile
    padded[num_experts] = 0
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)            # slots by expert, then by slot index
    sorted_key = key[order]
    first = torch.cumsum(counts, 0) - counts           # each expert's first slot in `order`
    rank = torch.arange(slots, device=dev) - first[sorted_key]
    row = torch.where(sorted_key < num_experts, (ends - padded)[sorted_key] + rank, -1)
    slot_row = torch.empty(slots, dtype=torch.long, device=dev).scatter_(0, order, row)
    tiles = max_tiles(slots, num_experts, token_tile)
    row_token = torch.full((tiles * token_tile + 1,), -1, dtype=torch.long, device=dev)
    row_token.scatter_(0, torch.where(row >= 0, row, tiles * token_tile), order // k)
    row_token = row_token[:-1]  # (the last entry took the slots without a row)
    # tile t starts at row t * tile: its expert is the first whose padded rows end after that
    starts = torch.arange(tiles, device=dev) * token_tile
    expert = torch.searchsorted(ends[:num_experts], starts, right=True)
    tile_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return Routing(token_tile, tile_expert, row_token, slot_row.view(m, k), topk_ids)


def cdiv_t(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + (b - 1)) // b


def combine(y: torch.Tensor, r: Routing, topk_weights: torch.Tensor,
            out: torch.Tensor) -> torch.Tensor:
    """out [M, H] = sum over slots, slot 0 first, of topk_weight * y[row], in fp32, rounded
    once to out's dtype (slots without a row add nothing); returns out."""
    m, k = r.slot_row.shape
    here = r.slot_row >= 0
    ys = y.index_select(0, r.slot_row.reshape(-1).clamp(min=0)).view(m, k, -1).float()
    ys = ys.masked_fill(~here[:, :, None], 0.0)
    w = topk_weights.float().masked_fill(~here, 0.0)
    acc = ys[:, 0] * w[:, :1]
    for j in range(1, k):  # fixed order: the result is the same run to run
        acc = acc + ys[:, j] * w[:, j:j + 1]  # (moe_reference's roundings; addcmul fuses)
    return out.copy_(acc)


def gather_quant(x: torch.Tensor, r: Routing):
    """The sorted rows' activations quantized: (fp8 [R, K], scale [R, Kb]); padding rows are
    zeros with scale 0."""
    pad = (r.row_token < 0)[:, None]
    xs = x.index_select(0, r.row_token.clamp(min=0)).masked_fill(pad, 0)
    q, scale = quantize_activation(xs)
    return q, scale.masked_fill(pad, 0)


def silu_mul_quant_rows(gate_up: torch.Tensor, r: Routing):
    """SiLU-and-mul + quantization of the sorted rows (the numerics of quant.py, which
    swiglu_quant's kernels keep): (fp8 [R, I], scale [R, Ib])."""
    return quantize_activation(silu_mul_reference(gate_up))


@dataclass(frozen=True)
class Stages:
    """A backend's implementations of the stages (the torch ones here:
    backends/reference.py's moe_stages). The rows of a stage's output that hold no token
    (row_token -1) may hold anything: each row is computed on its own and the combine reads
    the token rows only (the torch stages write zeros there)."""
    route: Callable          # (topk_ids, num_experts, token_tile) -> Routing
    gather_quant: Callable   # (x, Routing) -> (fp8 [R, K], scale [R, Kb], any strides)
    grouped_gemm: Callable   # (a, a_scale, w [E, N, K], w_scale, Routing, out, which) -> None
    silu_mul_quant: Callable  # (gate_up, Routing) -> (fp8 [R, I], scale [R, Ib], any strides)
    combine: Callable        # (y, Routing, topk_weights, out [M, H]) -> out
    # gate_up's GEMM with silu_mul_quant in its epilogue, in place of the two (None: the two):
    # (a, a_scale, w13, w13_scale, Routing, dtype of x) -> silu_mul_quant's (fp8, scale)
    gate_up_silu_quant: Callable | None = None
    # gate_up's GEMM (grouped_gemm's which 0, or gate_up_silu_quant) reads the tokens' rows of
    # x itself and quantizes them (a = x, a_scale None), in place of the gather
    gate_up_reads_tokens: bool = False


def sorted_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, token_tile: int,
               stages: Stages, out: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer through expert-sorted rows into ``out`` (new if None; inputs validated
    by the caller); the grouped GEMMs write x's dtype: gate_up (``which`` 0) and down (1)."""
    m, h = x.shape
    num_experts, two_i, _ = w13.shape
    r = stages.route(topk_ids, num_experts, token_tile)
    a, a_scale = (x, None) if stages.gate_up_reads_tokens else stages.gather_quant(x, r)
    if stages.gate_up_silu_quant is not None:
        hq, h_scale = stages.gate_up_silu_quant(a, a_scale, w13, w13_scale, r, x.dtype)
    else:
        gate_up = torch.empty(r.rows, two_i, dtype=x.dtype, device=x.device)
        stages.grouped_gemm(a, a_scale, w13, w13_scale, r, gate_up, 0)
        hq, h_scale = stages.silu_mul_quant(gate_up, r)
    y = torch.empty(r.rows, h, dtype=x.dtype, device=x.device)
    stages.grouped_gemm(hq, h_scale, w2, w2_scale, r, y, 1)
    return stages.combine(y, r, topk_weights, torch.empty_like(x) if out is None else out)
