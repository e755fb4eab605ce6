"""backends/triton/moe.py: the MoE stages' Triton kernels against their torch definitions
(fp8linear.moe_routing), on the CPU through Triton's interpreter and on the GPU."""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ (triton_interpreter)
import triton_interpreter  # noqa: E402

import fp8linear  # noqa: E402
from fp8linear import moe_routing as mr  # noqa: E402
from fp8linear.backends import reference  # noqa: E402
from fp8linear.moe import moe_reference  # noqa: E402
from fp8linear.quant import scale_view  # noqa: E402
from moe_cases import experts, topk_ids  # noqa: E402

# (M, top_k, experts, token tile, routing); 200 x 2 slots: pass 2 over several 128-slot steps
# (route_parallel: several chunks); 300 and 1024 experts: 32- and 16-slot steps; 300 x 4
# slots to 4 experts: one expert's rows across ten chunks (2304 sorted rows); 40 x 8 slots to
# 1024 experts: 20 chunks of 16, scanned 16 a step (two steps). The last field: the share of
# slots held by another rank (id -1, expert parallelism), all of them for the last case
CASES = [(1, 8, 128, 8, "random", 0), (5, 3, 6, 8, "random", 0),
         (16, 2, 8, 16, "one_expert", 0), (200, 2, 16, 32, "random", 0),
         (9, 4, 300, 8, "random", 0), (5, 8, 1024, 8, "random", 0),
         (300, 4, 8, 128, "one_expert", 0), (40, 8, 1024, 8, "random", 0),
         (200, 2, 16, 32, "random", 0.5), (40, 8, 128, 8, "random", 0.5),
         (3, 8, 128, 8, "random", 1)]


def check_stages(m, k, e, tile, routing, away, device):
    from fp8linear.backends.triton import moe as tm
    gen = torch.Generator().manual_seed(m * 17 + e)
    ids = topk_ids(m, k, e, gen, routing).to(torch.int32)
    ids = ids.masked_fill(torch.rand(m, k, generator=gen) < away, -1).to(device)
    got, want = tm.route(ids, e, tile), mr.route(ids, e, tile)
    for f in ("tile_expert", "row_token", "slot_row"):
        assert torch.equal(getattr(got, f), getattr(want, f)), (f, getattr(got, f))
    par = tm.route_parallel(ids, e, tile)
    for f in ("tile_expert", "row_token", "slot_row"):
        assert torch.equal(getattr(par, f), getattr(want, f)), (f, getattr(par, f))
    # the rows that hold a token (the kernels leave the others unwritten)
    used = want.row_token >= 0
    x = (torch.randn(m, 272, generator=gen) * 3).to(torch.bfloat16).to(device)
    q0, s0 = mr.gather_quant(x, want)
    small = got.rows <= 400 or device != "cpu"  # (the interpreter's time grows with rows)
    gate_up = (torch.randn(got.rows, 1536, generator=gen) * 2).to(torch.bfloat16).to(device)
    # the dense SiLU-and-mul op on that device (its Triton kernel on a GPU: the same bits as
    # the MoE one, where torch's silu may differ by a last bit; the reference on the CPU)
    hq0, hs_t = fp8linear.silu_mul_quant(gate_up)
    hs0 = scale_view(hs_t, gate_up.shape[0])
    # (wide: 16 (row, group) pairs a program, as from WIDE_MIN_PAIRS pairs)
    for groups, wide in ((None, False), (1, False), (4, False), (None, True))[:4 if small else 1]:
        with mock.patch.object(tm, "WIDE_MIN_PAIRS", 0) if wide else contextlib.nullcontext():
            q, s = tm.gather_quant(x, got, groups)
            assert torch.equal(q.view(torch.uint8)[used], q0.view(torch.uint8)[used]), groups
            assert torch.equal(s[used], s0[used]), groups
            if small:  # (6 groups a row: 4 a program wastes lanes)
                hq, hs = tm.silu_mul_quant(gate_up, got, groups)
                assert torch.equal(hq.view(torch.uint8)[used], hq0.view(torch.uint8)[used])
                assert torch.equal(hs[used], hs0[used]) and hs.shape == hs0.shape
    # x quantized before the wait (moe-gather-x-first): the same rows
    q, s = tm.gather_quant(x, got, x_first=True)
    assert torch.equal(q.view(torch.uint8)[used], q0.view(torch.uint8)[used])
    assert torch.equal(s[used], s0[used])
    y = torch.randn(got.rows, 200, generator=gen).to(device)
    w = torch.rand(m, k, generator=gen).to(device)
    out = torch.full((m, 200), float("nan"), device=device)
    assert tm.combine(y, got, w, out) is out
    ref = mr.combine(y, want, w, torch.empty(m, 200, device=device))
    # (fp32 rounding of the same sum in the same order; the kernel may fuse multiply-adds)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6), (out - ref).abs().max()
    # unsorted (Routing None): y's rows are the (token, slot) pairs in order (slot tiles)
    pairs = torch.randn(m * k, 200, generator=gen).to(device)
    out = torch.full((m, 200), float("nan"), device=device)
    assert tm.combine(pairs, None, w, out, ids) is out
    in_order = dataclasses.replace(want, slot_row=torch.arange(m * k, device=device).view(
        m, k).masked_fill(ids < 0, -1))
    ref = mr.combine(pairs, in_order, w, torch.empty(m, 200, device=device))
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6), (out - ref).abs().max()


def check_pipeline(device):
    # the whole sorted layer on the Triton stages and the reference grouped GEMM
    from fp8linear.backends.triton import moe as tm
    gen = torch.Generator().manual_seed(4)
    m, k, e, h, inter = 7, 2, 8, 256, 128
    x = torch.randn(m, h, generator=gen).to(torch.bfloat16)
    w13, s13 = experts(e, 2 * inter, h, gen)
    w2, s2 = experts(e, h, inter, gen)
    ids = topk_ids(m, k, e, gen, "random")
    wts = torch.softmax(torch.randn(m, k, generator=gen), 1)
    stages = mr.Stages(tm.route, tm.gather_quant, reference.grouped_gemm, tm.silu_mul_quant,
                       tm.combine)
    # all slots here, then a third held elsewhere (-1; their weights NaN: unread)
    for ids, wts in ((ids, wts), (ids.masked_fill(torch.arange(m * k).view(m, k) % 3 == 1, -1),
                                  wts.masked_fill(torch.arange(m * k).view(m, k) % 3 == 1,
                                                  float("nan")))):
        args = [t.to(device) for t in (x, w13, s13, w2, s2, wts, ids)]
        got = mr.sorted_moe(*args, 8, stages).cpu()
        want = moe_reference(x, w13, s13, w2, s2, wts, ids)
        assert torch.isfinite(got).all()
        assert (got.float() - want.float()).abs().max() <= 2 ** -8 * want.float().abs().max()


@pytest.mark.skipif(triton_interpreter.interpreting(), reason="already interpreting")
def test_triton_moe_stages_interpreted():
    triton_interpreter.run(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_triton_moe_stages_gpu(case):
    check_stages(*case, device="cuda")


@pytest.mark.gpu
def test_triton_moe_pipeline_gpu():
    check_pipeline("cuda")


if __name__ == "__main__":
    triton_interpreter.start()
    for case in CASES:
        check_stages(*case, device="cpu")
    check_pipeline("cpu")
    triton_interpreter.passed(len(CASES) + 1)


def test_programs_take_whole_groups_and_widen_from_4096_pairs():
    from fp8linear.backends.triton import moe as tm
    # (groups a program, pairs a program): below 4096 (row, group) pairs one row's groups,
    # at most 4, dividing the row's groups; from there 16 pairs, up to 16 groups of a row
    assert tm.pair_split(16, 1) == (4, 4)            # a decode token of hidden 2048
    assert tm.pair_split(6, 8) == (2, 2)             # Qwen3-30B-A3B's intermediate, 8 slots
    assert tm.pair_split(3, 100) == (1, 1)           # 3 groups: no power of 2 divides them
    assert tm.pair_split(16, 256) == (16, 16)        # 4096 pairs: a token's 16 groups
    assert tm.pair_split(6, 8192) == (2, 16)         # 8 rows of 2 groups a program
    assert tm.pair_split(112, 2048) == (16, 16)      # Mixtral's intermediate
    assert tm.pair_split(6, 8192, forced=4) == (4, 16)
