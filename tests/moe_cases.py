"""MoE test data, one definition for the MoE tests: quantized experts and routings."""
from __future__ import annotations

import torch

import fp64_reference as R
from fp8linear import quantize_weight


def experts(num: int, n: int, k: int, gen: torch.Generator, per_row: bool = False):
    """``num`` random [n, k] weights in block FP8: (fp8 [num, n, k], fp32 scales [num, ...]),
    128x128 block scales, or per row (``per_row``)."""
    ws, ss = [], []
    for _ in range(num):
        w, s = quantize_weight(R.random_matrix(n, k, gen, spread=1.0) * 0.05)
        if per_row:
            s = s.repeat_interleave(128, 0)[:n].contiguous()
        ws.append(w)
        ss.append(s)
    return torch.stack(ws), torch.stack(ss)


# an expert's token count either side of the 64-row halves of its 128-row tiles (the prefill
# kernel skips a tile's second half when it holds padding only), one token, none
EDGE_COUNTS = (64, 65, 63, 128, 129, 192, 1, 0)


def topk_ids(m: int, k: int, e: int, gen: torch.Generator, routing: str) -> torch.Tensor:
    """int64 [m, k], k distinct experts a token. routing: "random" (uniform over the e
    experts), "one_expert" (every token to experts 3 .. 3 + k - 1: expert 3 takes them all),
    "few" (k of the first 3 experts: most experts get no token), "edges" (k = 1, e = 8,
    m = sum(EDGE_COUNTS): expert j takes EDGE_COUNTS[j] tokens, in random order)."""
    if routing == "one_expert":
        return (torch.arange(k) + 3).repeat(m, 1)
    if routing == "edges":
        assert (m, k, e) == (sum(EDGE_COUNTS), 1, len(EDGE_COUNTS))
        ids = torch.repeat_interleave(torch.arange(e), torch.tensor(EDGE_COUNTS))
        return ids[torch.randperm(m, generator=gen)][:, None]
    pool = 3 if routing == "few" else e
    return torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(m)])


def layer(gen: torch.Generator, m: int, e: int, k: int, h: int, inter: int,
          routing: str = "random", dtype=torch.bfloat16):
    """A random MoE layer's inputs: (x [m, h], w13, w13_scale, w2, w2_scale, topk_weights,
    topk_ids), on the CPU."""
    x = R.random_matrix(m, h, gen, spread=1.0).to(dtype)
    w13, s13 = experts(e, 2 * inter, h, gen)
    w2, s2 = experts(e, h, inter, gen)
    ids = topk_ids(m, k, e, gen, routing)
    return x, w13, s13, w2, s2, torch.softmax(torch.randn(m, k, generator=gen), 1), ids
