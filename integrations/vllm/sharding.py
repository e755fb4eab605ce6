"""Block-FP8 weights on one tensor-parallel rank: which scale layout, and the K re-blocking.

Pure torch, no vLLM: the plugin's linear method asks ``plan_shard`` once per layer at
construction and applies the result while loading.

A checkpoint's 128x128 scale blocks start on a 128 grid of the *unsharded* weight. A rank
whose slice does not start on that grid cannot take a contiguous slice of the block scales:
- split along N (column-parallel, merged gate/up, QKV): the weight's rows are sliced as they
  are and each row takes the scale of the block it came from: block scales are expanded to
  per-row scales [N, Kb] before sharding (exact; the kernels take per-row scales);
- split along K (row-parallel): the activation is quantized in 128-wide groups starting at
  the rank's first input channel, so the weight's K blocks must start there too. The rank's
  slice is dequantized with the checkpoint scales and requantized on a 128 grid at the
  shard's origin (``reblock_k_shard``): the one step that is not exact (README: "K-split
  re-blocking").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fp8linear import quantize_weight
from fp8linear.quant import BLOCK, cdiv, has_row_scales

# How a layer's weight is divided between ranks (derived from the vLLM layer class).
SPLIT_N = "n"          # ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear
SPLIT_K = "k"          # RowParallelLinear
REPLICATED = "none"    # ReplicatedLinear: every rank holds the whole weight
TP_SIZES_CHECKED = (1, 2, 4, 8, 16)


class UnsupportedShardError(ValueError):
    """A layer whose tensor-parallel shard layout the plugin cannot load (raised at
    construction, before any weight is read)."""


@dataclass(frozen=True)
class ShardPlan:
    row_scales: bool   # per-row scales [N_shard, Kb] instead of 128x128 blocks
    reblock_k: bool    # K slice not on the 128 grid: requantize it at the shard's origin

    def describe(self) -> str:
        if self.reblock_k:
            return "128x128 blocks, re-blocked at the rank's K origin"
        return "per-row scales" if self.row_scales else "128x128 blocks"


def _misaligned_n(partition_sizes: Sequence[int], tp_size: int) -> bool:
    # A rank's slice of logical matrix i starts at tp_rank * size_i (in the checkpoint) and
    # sits at sum(sizes[:i]) in the fused weight: both are on the grid iff every size is a
    # multiple of 128. Exception: with one rank nothing is sliced, and the last matrix may
    # end off the grid (its last block is partial, as in the checkpoint).
    sizes = list(partition_sizes)
    if tp_size == 1:
        sizes = sizes[:-1]
    return any(s % BLOCK for s in sizes)


def plan_shard(split: str, partition_sizes: Sequence[int], input_size_per_partition: int,
               tp_size: int, loader_known: bool, prefix: str,
               full_output_sizes: Optional[Sequence[int]] = None,
               input_size: Optional[int] = None) -> ShardPlan:
    """Scale layout for one layer on one rank.

    ``partition_sizes``: this rank's rows of each logical matrix (vLLM's
    output_partition_sizes). ``loader_known``: the layer loads weights through one of the
    vLLM loaders whose slicing this module understands; a layer that needs per-row scales or
    K re-blocking but loads through another loader fails here, naming what would work.
    """
    row_scales = split in (SPLIT_N, REPLICATED) and _misaligned_n(
        partition_sizes, tp_size if split == SPLIT_N else 1)
    reblock_k = split == SPLIT_K and tp_size > 1 and input_size_per_partition % BLOCK != 0
    if (row_scales or reblock_k) and not loader_known:
        raise UnsupportedShardError(_unsupported_message(
            prefix, split, partition_sizes, input_size_per_partition, tp_size,
            full_output_sizes, input_size))
    return ShardPlan(row_scales=row_scales, reblock_k=reblock_k)


def aligned_tp_sizes(split: str, full_output_sizes: Sequence[int],
                     input_size: Optional[int]) -> list[int]:
    """TP sizes at which every rank's slice of this layer starts on the 128 grid."""
    ok = []
    for t in TP_SIZES_CHECKED:
        if split == SPLIT_K:
            if input_size is not None and input_size % t == 0 and (
                    t == 1 or (input_size // t) % BLOCK == 0):
                ok.append(t)
        elif split == SPLIT_N:
            if all(s % t == 0 for s in full_output_sizes) and not _misaligned_n(
                    [s // t for s in full_output_sizes], t):
                ok.append(t)
        elif not _misaligned_n(full_output_sizes, 1):
            ok.append(t)
    return ok


def _unsupported_message(prefix, split, partition_sizes, k_part, tp_size, full_sizes, k_full):
    if split == SPLIT_K:
        what = f"its {k_part} input channels per rank (TP={tp_size})"
        full = [k_full] if k_full else []
    else:
        what = (f"its output rows per rank {list(partition_sizes)} (TP={tp_size})")
        full = list(full_sizes or [])
    works = aligned_tp_sizes(split, full_sizes or partition_sizes, k_full) if full else []
    hint = (f"TP sizes whose shards are multiples of 128 here: {works}" if works else
            "no TP size puts this layer's shards on the 128 grid")
    return (f"fp8_blockgemm: layer '{prefix}' cannot be loaded: {what} are not multiples of "
            f"128, and its layer class loads weights through a loader the plugin does not "
            f"know how to re-slice (per-row scales / K re-blocking are implemented for "
            f"Column/MergedColumn/QKV/RowParallelLinear). {hint}.")


# --------------------------------------------------------------------------- per-row
def expand_block_rows(scale: torch.Tensor, full_rows: int, name: str) -> torch.Tensor:
    """Checkpoint scales of one logical matrix -> per-row [full_rows, Kb] (exact).

    Accepts 128x128 block scales [ceil(rows/128), Kb] or scales already per row.
    """
    if scale.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D block scale tensor, got shape "
                         f"{tuple(scale.shape)}")
    if scale.shape[0] == full_rows:
        return scale
    if scale.shape[0] != cdiv(full_rows, BLOCK):
        raise ValueError(
            f"{name}: scale has {scale.shape[0]} rows but the weight has {full_rows} rows: "
            f"expected {cdiv(full_rows, BLOCK)} (128x128 blocks) or {full_rows} (per row)")
    return scale.repeat_interleave(BLOCK, dim=0)[:full_rows]


# --------------------------------------------------------------------------- K re-blocking
def reblock_k_shard(w_fp8: torch.Tensor, full_scale: torch.Tensor, k_origin: int,
                    name: str = "weight"):
    """Requantize a rank's K slice on a 128 grid that starts at its first column.

    w_fp8 [N, Ks]: columns k_origin .. k_origin+Ks of the checkpoint weight;
    full_scale: the unsharded layer's scales, [ceil(N/128), Kb_full] or per row [N, Kb_full].
    Returns (fp8 [N, Ks], fp32 block scales [ceil(N/128), ceil(Ks/128)]).

    Done in 128-row slabs so the fp32 copies stay small (the load-time peak is one slab, not
    a float copy of the layer). Dequantized values are products of the checkpoint's fp8
    values and scales; requantizing them with the new block's amax rounds each to the new
    scale's fp8 grid: at most half an fp8 step (2^-4 relative) per element, and none where
    the new block's amax equals the old one's.
    """
    n, ks = w_fp8.shape
    kb_full = full_scale.shape[1]
    if cdiv(k_origin + ks, BLOCK) > kb_full:
        raise ValueError(f"{name}: columns {k_origin}..{k_origin + ks} lie outside the "
                         f"{kb_full * BLOCK} columns the scales cover")
    per_row = has_row_scales(full_scale, n)
    col_block = torch.arange(k_origin, k_origin + ks, device=w_fp8.device) // BLOCK
    out = torch.empty_like(w_fp8)
    scales = torch.empty(cdiv(n, BLOCK), cdiv(ks, BLOCK), dtype=torch.float32,
                         device=w_fp8.device)
    for rb in range(cdiv(n, BLOCK)):
        rows = slice(rb * BLOCK, min(n, (rb + 1) * BLOCK))
        s = full_scale[rows] if per_row else full_scale[rb:rb + 1]
        w = w_fp8[rows].float() * s.float()[:, col_block]
        out[rows], scales[rb:rb + 1] = quantize_weight(w)
    return out, scales
