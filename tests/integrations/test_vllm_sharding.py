"""integrations/vllm/sharding.py: scale layout per rank, per-row expansion, K re-blocking.

The module imports torch and fp8linear only, so its tests run without vLLM (they live outside
tests/integrations/vllm, whose tests need vLLM installed)."""
from __future__ import annotations

import pytest
import torch

from fp8linear import quantize_weight
from fp8linear.quant import dequantize_weight
from fp8linear_vllm.sharding import (REPLICATED, SPLIT_K, SPLIT_N, UnsupportedShardError,
                                     aligned_tp_sizes, expand_block_rows, plan_shard,
                                     reblock_k_shard)


def _w(n, k, seed=0, spread=1.5):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    gain = torch.exp(torch.empty(n, 1).uniform_(-spread, spread, generator=g))
    return w * gain


@pytest.mark.parametrize("split,sizes,k,tp,rows,reblock", [
    (SPLIT_N, [256, 128, 128], 256, 1, False, False),   # aligned QKV
    (SPLIT_N, [256, 64, 64], 256, 1, True, False),      # 64-row k/v heads
    (SPLIT_N, [384, 320], 256, 1, False, False),        # only the last ends off the grid
    (SPLIT_N, [192, 192], 256, 2, True, False),         # gate/up 384 over 2 ranks
    (SPLIT_N, [128, 128], 256, 2, False, False),
    (SPLIT_N, [160], 256, 2, True, False),              # column 320 over 2 ranks
    (SPLIT_N, [320], 256, 1, False, False),             # unsplit, partial last block
    (SPLIT_K, [256], 192, 2, False, True),              # down_proj 384 over 2 ranks
    (SPLIT_K, [256], 128, 2, False, False),
    (SPLIT_K, [256], 300, 1, False, False),             # unsplit K, partial last block
    (REPLICATED, [200], 300, 4, False, False),
])
def test_plan(split, sizes, k, tp, rows, reblock):
    plan = plan_shard(split, sizes, k, tp, loader_known=True, prefix="x")
    assert (plan.row_scales, plan.reblock_k) == (rows, reblock)


def test_unknown_loader_fails_only_when_misaligned():
    plan = plan_shard(SPLIT_N, [128, 128], 256, 2, loader_known=False, prefix="a.b")
    assert not plan.row_scales
    with pytest.raises(UnsupportedShardError) as e:
        plan_shard(SPLIT_N, [192, 192], 256, 2, loader_known=False, prefix="m.up",
                   full_output_sizes=[384, 384], input_size=256)
    msg = str(e.value)
    assert "'m.up'" in msg and "[192, 192]" in msg and "TP=2" in msg
    assert "multiples of 128 here: [1]" in msg
    with pytest.raises(UnsupportedShardError, match=r"192 input channels per rank \(TP=2\).*"
                                                    r"\[1, 3\]|\[1\]"):
        plan_shard(SPLIT_K, [256], 192, 2, loader_known=False, prefix="m.down",
                   input_size=384)


def test_aligned_tp_sizes():
    assert aligned_tp_sizes(SPLIT_N, [1024, 256, 256], None) == [1, 2]
    assert aligned_tp_sizes(SPLIT_K, None, 2048) == [1, 2, 4, 8, 16]
    assert aligned_tp_sizes(SPLIT_K, None, 384) == [1]
    assert aligned_tp_sizes(SPLIT_N, [192, 192], None) == []


def test_expand_block_rows_is_exact_and_checks_shapes():
    s = torch.rand(3, 2) + 0.5
    rows = expand_block_rows(s, 300, "w")
    assert rows.shape == (300, 2)
    assert torch.equal(rows[0], s[0]) and torch.equal(rows[127], s[0])
    assert torch.equal(rows[128], s[1]) and torch.equal(rows[299], s[2])
    assert expand_block_rows(rows, 300, "w") is rows           # already per row
    with pytest.raises(ValueError, match="w: scale has 4 rows but the weight has 300 rows"):
        expand_block_rows(torch.ones(4, 2), 300, "w")


def test_per_row_dequantization_equals_block():
    q, s = quantize_weight(_w(320, 256))
    assert torch.equal(dequantize_weight(q, s), dequantize_weight(q, expand_block_rows(s, 320, "w")))


@pytest.mark.parametrize("origin,ks", [(0, 128), (128, 256), (0, 192), (192, 192), (64, 100)])
def test_reblock_k_shard(origin, ks):
    n, k = 300, 384
    q, s = quantize_weight(_w(n, k, seed=origin + ks))
    before = dequantize_weight(q, s)[:, origin:origin + ks]
    q2, s2 = reblock_k_shard(q[:, origin:origin + ks].contiguous(), s, origin)
    assert q2.shape == (n, ks) and s2.shape == (3, -(-ks // 128))
    after = dequantize_weight(q2, s2)
    if origin % 128 == 0 and (ks % 128 == 0 or origin + ks == k):
        assert torch.equal(after, before)        # blocks line up: nothing changes
    # at most half an e4m3 step at the new block's scale (subnormals: 2^-10 of the scale)
    new_scale = dequantize_weight(torch.ones(n, ks).to(q.dtype), s2)
    bound = torch.maximum(before.abs() * 2 ** -4, new_scale * 2 ** -10)
    assert ((after - before).abs() <= bound * (1 + 1e-6)).all()
    # and it is the definition: requantizing the dequantized slice
    want_q, want_s = quantize_weight(before)
    assert torch.equal(q2.float(), want_q.float()) and torch.equal(s2, want_s)


def test_reblock_rejects_columns_outside_the_scales():
    q, s = quantize_weight(_w(128, 256))
    with pytest.raises(ValueError, match="outside"):
        reblock_k_shard(q[:, :200].contiguous(), s, 128)
