"""GPU tests of the sm90 backend's GEMM kernels in the variants the random shapes of
tests/backends/test_gemm_gpu.py do not reach on their own, each forced through
fp8linear.backends.sm90.plan.forced: every large-M tile, early weights, tile-order bands,
split tails, decode CTAs an SM, rows and K splits, the fused and the standalone quantization
(bit-exact against quantize_activation, NaN groups), concurrent streams, split-K counters made
inside a graph capture, and the kernel library's refusals. Checks: tests/backends/gemm_checks.py.
"""
from __future__ import annotations

import pytest
import torch

import fp8linear
from fp8linear.backends.sm90 import launch as sm90_launch
from fp8linear.backends.sm90 import plan as sm90_plan
from fp8linear.backends.sm90.tiles import DECODE_TILES, GEMM_TILES
from fp8linear.quant import cdiv, empty_scale_t, scale_view

from expect import raises_exactly

from ..gemm_checks import (DEVICE, DTYPES, FIXED, assert_close, case_id, case_seed,
                           check_case, gen_cases, make_data, poisoned, reference, select_backend)

def _sm90_only(cases: list[dict]) -> list[dict]:
    """The cases with 16-bit outputs (fp32 ones would go to the Triton path)."""
    return [dict(c, out=c["out"] if c["out"] != "fp32" else "bf16") for c in cases]


def _config_cases(config: int, count: int = 24) -> list[dict]:
    """Cases for one forced large-M configuration: M from 1 (a cluster's second CTA then lies
    wholly past M) to 8192, tails in N and K."""
    cases = _sm90_only(gen_cases("sm90", count=count + len(FIXED), seed=100 + config))
    return cases[len(FIXED) - 6:len(FIXED) - 6 + count]


@pytest.mark.gpu
@pytest.mark.parametrize("config", range(len(GEMM_TILES)))
def test_sm90_every_gemm_config(config, monkeypatch):
    """Every tile configuration of the large-M kernel (the rules pick only some per shape),
    forced through plan.forced(gemm_config=...), on random shapes and edge cases."""
    select_backend("sm90", monkeypatch)
    with sm90_plan.forced(gemm_config=config):
        for case in _config_cases(config):
            m, n, k = case["m"], case["n"], case["k"]
            assert sm90_plan.choose(m, n, k, 132) == sm90_plan.GemmPlan(config)
            check_case(case, f"sm90 config {config} {case_id(case)}", linear=False)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [None, 1, 64])  # the rule's count, one, the whole ring
@pytest.mark.parametrize("config", range(len(GEMM_TILES)))
def test_sm90_gemm_early_weights(config, stages, monkeypatch):
    """Every configuration with its first weight stages requested before griddepcontrol.wait
    (forced gemm_early_b=True; as many as the rule picks, one, or the whole ring),
    through block_fp8_gemm and fp8_linear (whose GEMM runs behind the quant kernel under
    PDL): the early loads land in the stages the K loop then reads, for tiles with fewer K
    blocks than stages too, and the ring's later stages stay in step."""
    select_backend("sm90", monkeypatch)
    with sm90_plan.forced(gemm_config=config, gemm_early_b=True, gemm_early_stages=stages):
        for i, case in enumerate(_config_cases(config, count=10)):
            check_case(case, f"sm90 config {config} early {case_id(case)}",
                        linear=i % 2 == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("config", [0, 3, 5, 7])
def test_sm90_gemm_tile_order_bands(config, group, monkeypatch):
    """The tile order's band of M units (forced gemm_group_m; the rule picks 4, 8 or 16):
    every tile is computed once, with ragged last bands (M units not a multiple of the band),
    for single CTAs and pairs sharing the weight tile, through both entry points."""
    select_backend("sm90", monkeypatch)
    with sm90_plan.forced(gemm_config=config, gemm_group_m=group):
        for i, case in enumerate(_config_cases(config, count=8)):
            check_case(case, f"sm90 config {config} band {group} {case_id(case)}",
                        linear=i % 2 == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c, t in enumerate(GEMM_TILES)
                                    if 128 % t.bn != 0 and t.bn != 192])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("out", ["bf16", "fp16"])
def test_sm90_tiles_straddling_scale_blocks(config, per_row, out, monkeypatch):
    """128x96 / 128x160 tiles straddle 128-row weight-scale blocks at every 32-column offset,
    64x48 tiles at 16 and 32: each tile's K loop is specialised for its boundary (16, 32, 64,
    96 or none), and the output goes out in 64B-swizzled 32-column boxes (one unswizzled
    48-column box). N spans more than four tiles (every boundary
    case), is a multiple of neither the tile nor 128 and gives an odd tile count (a pair's
    second CTA then lies past N); K has a partial last block."""
    select_backend("sm90", monkeypatch)
    bn = GEMM_TILES[config].bn
    n = 6 * bn + 40                                    # 7 tiles, the last one partial
    m, k = 300, 1040
    c = {"m": m, "n": n, "k": k, "per_row": per_row, "out": out, "bias": "out",
         "seed": case_seed("straddle", config, per_row, out)}
    x, a, a_s, wq, ws, bias = make_data(c)
    ref, mag = reference(a, a_s, wq, ws, bias)
    dt = DTYPES[out]
    got = poisoned(m, n, dt)
    with sm90_plan.forced(gemm_config=config):
        fp8linear.block_fp8_gemm(a, a_s, wq, ws, out_dtype=dt, out=got, bias=bias)
        torch.cuda.synchronize()
        assert sm90_plan.choose(m, n, k, 132) == sm90_plan.GemmPlan(config)
    assert_close(got, ref, mag, f"config {config} N={n} per_row={per_row} {out}", bias=bias)


def _same_bits_each_run(runs, a, a_s, wq, ws, bias, ref, mag, what):
    """block_fp8_gemm `runs` times into NaN-poisoned outputs: the first right, every other run
    the same bits. -> the first output's bits (int16)."""
    m, n = a.shape[0], wq.shape[0]
    first = None
    for run in range(runs):
        out = poisoned(m, n, torch.bfloat16)
        fp8linear.block_fp8_gemm(a, a_s, wq, ws, out=out, bias=bias)
        torch.cuda.synchronize()
        if first is None:
            assert_close(out, ref, mag, what, bias=bias)
            first = out.view(torch.int16).clone()
        else:
            assert int((out.view(torch.int16) != first).sum()) == 0, f"{what}: run {run} differs"
    return first


_SPLIT_TAIL = [c for c, t in enumerate(GEMM_TILES) if t.split_tail]


@pytest.mark.gpu
@pytest.mark.parametrize("config", _SPLIT_TAIL)
@pytest.mark.parametrize("m,n,k", [
    (300, 1000, 4096),    # 18 tiles of 128x192 in 7 parts each (32 K blocks: 5 or 4 a part)
    (1024, 2112, 7168),   # 88 tiles, one part each: whole tiles on 88 CTAs
    (2048, 2112, 7168),   # 176 tiles: 132 whole, then 44 in 3 parts on the same 132 CTAs
    (5, 136, 272),        # one tile in 3 parts of one K block
    (700, 392, 1040),     # 18 tiles in 7 parts of 9 K blocks (2 or 1), a partial last block
    (4224, 4096, 384),    # 33 x 22 = 726 tiles: 5 whole waves, a tail of 66 in 2 parts
])
@pytest.mark.parametrize("per_row", [False, True])
def test_sm90_split_tail_parts_sum_deterministically(config, m, n, k, per_row, monkeypatch):
    """Split tail: the tiles of a ragged last wave are split along K over the idle SMs; the
    parts are summed from the workspace by the last to arrive, in part order: right, and the
    same bits in 20 runs whoever arrives last; the tile counters are left at zero (fp8_linear
    on the same stream reuses them)."""
    select_backend("sm90", monkeypatch)
    c = {"m": m, "n": n, "k": k, "per_row": per_row, "out": "bf16", "bias": "out",
         "seed": case_seed("split_tail", m, n, k, per_row)}
    x, a, a_s, wq, ws, bias = make_data(c)
    ref, mag = reference(a, a_s, wq, ws, bias)
    with sm90_plan.forced(gemm_config=config):
        _same_bits_each_run(20, a, a_s, wq, ws, bias, ref, mag,
                            f"split tail M={m} N={n} K={k} per_row={per_row}")
        # fp8_linear (the quant kernel, then the split-tail GEMM under PDL) on the same stream
        got = fp8linear.fp8_linear(x, wq, ws, bias=bias)
        torch.cuda.synchronize()
    assert_close(got, ref, mag, f"split tail fp8_linear M={m} N={n} K={k}", bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("config", _SPLIT_TAIL)
def test_sm90_split_tail_without_workspace_is_an_error(config):
    """The kernel library refuses a split-tail launch without its workspace and counters (the
    Python side always passes them) instead of letting the kernel write through null."""
    from fp8linear.backends.sm90 import library
    *_, wq, ws, _ = make_data({"m": 300, "n": 1000, "k": 4096, "per_row": False,
                               "out": "bf16", "bias": None, "seed": 7})
    x = torch.randn(300, 4096, device=DEVICE).to(torch.bfloat16)
    out = poisoned(300, 1000, torch.bfloat16)
    with raises_exactly(RuntimeError, "fp8linear gemm: split tail: no workspace"):
        library.load().gemm(x, None, wq, ws, False, None, out, config, False, False, 0, 1, 0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", range(len(GEMM_TILES)))
@pytest.mark.parametrize("extra", [8, 7])    # 7: the moved block's first row rounded up to x4
def test_sm90_last_m_block_moved_in_bounds(config, extra, monkeypatch):
    """When M is not a multiple of the tile's rows, the last M block is moved up to end at row
    M (gemm_kernel.cuh tile_row0), so two CTAs write the rows their blocks share: both must
    write the same bits, equal to an in-bounds run over the first rows alone, and every run
    the same (a race between unequal values would show as run-to-run differences)."""
    select_backend("sm90", monkeypatch)
    bm = GEMM_TILES[config].bm
    m, n, k = 2 * bm + bm // 2 + extra, 392, 640      # last block moved up by ~3/8 of a tile
    c = {"m": m, "n": n, "k": k, "per_row": False, "out": "bf16", "bias": "out",
         "seed": case_seed("moved", config, m)}
    x, a, a_s, wq, ws, bias = make_data(c)
    ref, mag = reference(a, a_s, wq, ws, bias)
    with sm90_plan.forced(gemm_config=config):
        first = _same_bits_each_run(5, a, a_s, wq, ws, bias, ref, mag,
                                    f"config {config} M={m}")
        if GEMM_TILES[config].split_tail:
            return  # (a split tail never moves a block; M sets its split of K, and so its bits)
        top = 2 * bm                                      # whole blocks only: nothing moved
        part = poisoned(top, n, torch.bfloat16)
        fp8linear.block_fp8_gemm(a[:top], a_s[:top].contiguous(), wq, ws, out=part, bias=bias)
        torch.cuda.synchronize()
    diff = int((part.view(torch.int16) != first[:top]).sum())
    assert diff == 0, f"config {config}: {diff} elements of the shared rows differ"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 12688, 128), (8, 264, 256), (40, 264, 256),
                                   (300, 12688, 128)])
def test_sm90_fp32_bias_added_in_fp32(m, n, k, monkeypatch):
    """An fp32 bias with a 16-bit output over one or two K blocks, so that the bias is a large
    share of each output: rounding it to bf16 before the add (2^-9 of its magnitude) would
    break the tolerance. Fused decode (M=1), split-K decode (8), 64x64 tiles (40), large-M."""
    select_backend("sm90", monkeypatch)
    for seed in range(3):
        c = {"m": m, "n": n, "k": k, "per_row": seed == 1, "out": "bf16", "bias": "fp32",
             "seed": 900 + seed}
        check_case(c, f"fp32 bias m={m} seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_sm90_bias_view_at_odd_offset(m, bias_dtype, monkeypatch):
    """A bias that is a view one element into its storage (not 8-byte aligned): the kernels
    read bias pairs, so the sm90 backend passes an aligned copy instead of the view."""
    select_backend("sm90", monkeypatch)
    c = {"m": m, "n": 264, "k": 256, "per_row": False, "out": "bf16", "bias": None, "seed": 7}
    _, a, a_s, wq, ws, _ = make_data(c)
    bias = torch.randn(c["n"] + 1, device=DEVICE).to(bias_dtype)[1:]
    assert bias.data_ptr() % 8 != 0
    ref, mag = reference(a, a_s, wq, ws, bias)
    out = poisoned(m, c["n"], torch.bfloat16)
    fp8linear.block_fp8_gemm(a, a_s, wq, ws, out_dtype=torch.bfloat16, out=out, bias=bias)
    torch.cuda.synchronize()
    assert_close(out, ref, mag, f"odd-offset {bias_dtype} bias m={m}", bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("ctas", [1, 2])
def test_sm90_decode_ctas_per_sm(ctas, monkeypatch):
    """Both decode kernel variants (one CTA an SM with the whole register file, or two with
    half the shared memory each), forced through plan.forced(decode_ctas=...), M 1..32, the
    split reduction through the workspace."""
    select_backend("sm90", monkeypatch)
    with sm90_plan.forced(decode_ctas=ctas):
        # (K <= 8192: longer K ranges per CTA keep one CTA an SM, see _decode_ctas_per_sm; and
        # 17-32 tokens over short K take 64x64 tiles of the large-M kernel)
        # (CTAs owning fewer rows than 64 / 128 run one an SM)
        cases = [c for c in _sm90_only(gen_cases("sm90", count=400, seed=200))
                 if c["m"] <= 32 and c["k"] <= 8192
                 and (p := sm90_plan.choose(c["m"], c["n"], c["k"], 132)).kind == "decode"
                 and p.rows in (64, 128)][:30]
        assert cases
        for case in cases:
            m, n, k = case["m"], case["n"], case["k"]
            p = sm90_plan.choose(m, n, k, 132)
            assert p.kind == "decode" and p.ctas_per_sm == ctas, p
            check_case(case, f"sm90 decode ctas={ctas} {case_id(case)}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,ctas,splits", [
    (64, 1, None), (64, 2, None), (64, 2, 1), (64, 1, 3), (64, 2, 2), (128, 2, 3),
    (80, 1, None), (112, 1, 2), (80, 1, 2), (96, 1, 3), (72, 1, None), (120, 1, 3)])
def test_sm90_decode_rows_and_splits(rows, ctas, splits, monkeypatch):
    """Decode CTAs of 64 weight rows (the two math warpgroups take alternate K blocks and add
    their partials in shared memory), 128-row CTAs owning 72..120 rows (the rest of their
    ring rows are stale and never stored; rows straddle two 128-row scale blocks) and
    forced split counts, with the reduction through the workspace, and the early PDL trigger;
    M 1..32 (K ranges of one block included: warpgroup 1 then adds nothing)."""
    select_backend("sm90", monkeypatch)
    with sm90_plan.forced(decode_rows=rows, decode_ctas=ctas, decode_splits=splits,
                          decode_early_trigger=splits is not None, decode_max_m=32):
        cases = [c for c in _sm90_only(gen_cases("sm90", count=400, seed=500 + rows + ctas))
                 if c["m"] <= 32 and c["k"] <= 8192
                 and sm90_plan.choose(c["m"], c["n"], c["k"], 132).kind == "decode"][:16]
        assert cases
        for case in cases:
            p = sm90_plan.choose(case["m"], case["n"], case["k"], 132)
            assert p.rows == rows, p
            assert splits is None or p.splits in (splits, cdiv(case["k"], 128)), p
            check_case(case, f"sm90 decode {p} {case_id(case)}")


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [False, True])
def test_sm90_decode_fused_quantization(fuse, monkeypatch):
    """fp8_linear at M <= 16 with the activation quantization inside the decode kernel
    wherever the slice fits (forced fuse_quant=True: also M = 9-16 and long K ranges),
    or never (False: the separate quant kernel); bf16 and fp16 inputs, tails in K."""
    select_backend("sm90", monkeypatch)
    cases = [c for c in _sm90_only(gen_cases("sm90", count=600, seed=400))
             if c["m"] <= 16][:24]
    fused = 0
    with sm90_plan.forced(fuse_quant=fuse):
        for case in cases:
            m, n, k = case["m"], case["n"], case["k"]
            p = sm90_plan.choose(m, n, k, 132)
            fused += sm90_launch.fuse_quant(m, k, p)
            check_case(case, f"sm90 fuse={fuse} {case_id(case)}")
    assert (fused > 0) == fuse, fused


def _ext_quant(ext, x):
    """The sm90 quant kernel on x [M, K]: fp8 [M, K] and the scales [M, Kb] (a view of the
    kernel's [Kb, M] rows)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=DEVICE)
    st = empty_scale_t(m, cdiv(k, 128), DEVICE)
    ext.quant(x, q, st, False)
    torch.cuda.synchronize()
    return q, scale_view(st, m)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_sm90_quant_kernel_bit_exact(dtype, monkeypatch):
    """The sm90 quant kernel (one reciprocal a group and a corrected product instead of a
    division per element) gives exactly quantize_activation's fp8 bits and scales: values
    over many orders of magnitude, signed zeros, tails in K (NaN inputs: the next test); both
    of the kernel's shapes (narrow below 1024 tokens, wide from 1024)."""
    select_backend("sm90", monkeypatch)
    from fp8linear.backends.sm90 import library
    ext = library.load()
    g = torch.Generator(device=DEVICE).manual_seed(case_seed("quant-bits", dtype))
    for m, k in ((1, 128), (7, 4096), (33, 7168 + 16), (64, 1552), (257, 2064), (1100, 1040)):
        x = torch.randn(m, k, generator=g, device=DEVICE)
        x = x * torch.exp(2.0 * torch.randn(m, k, generator=g, device=DEVICE))  # < fp16 max
        x[m // 2] *= 1e-6                     # tiny groups: quotients near fp8's subnormals
        x[:, ::97] = -0.0
        x = x.to(DTYPES[dtype])
        want_q, want_s = fp8linear.quantize_activation(x)
        q, s = _ext_quant(ext, x)
        assert torch.equal(s.contiguous().view(torch.int32),
                           want_s.view(torch.int32)), f"scales m={m} k={k} {dtype}"
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), \
            f"fp8 values m={m} k={k} {dtype}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_sm90_quantization_nan_makes_its_group_nan(dtype, monkeypatch):
    """As quantize_activation (torch's amax propagates NaN): a NaN makes its own 128-channel
    group's scale and fp8 values NaN and leaves every other group's bits alone, in the quant
    kernel and in the decode kernel's fused quantization (fp8_linear then gives NaN in that
    token's outputs only, as block_fp8_gemm on the reference's quantization does)."""
    select_backend("sm90", monkeypatch)
    from fp8linear.backends.sm90 import library
    ext = library.load()
    g = torch.Generator(device=DEVICE).manual_seed(case_seed("quant-nan", dtype))
    m, k = 6, 4096 + 16
    x = torch.randn(m, k, generator=g, device=DEVICE)
    x[1, 140] = float("nan")                    # one group of token 1
    x[4, 4096 + 3] = float("nan")               # the partial last group of token 4
    x[4, 7] = float("inf")                      # inf is not NaN: that group's own rules
    x = x.to(DTYPES[dtype])
    want_q, want_s = fp8linear.quantize_activation(x)
    kb = want_s.shape[1]
    q, s = _ext_quant(ext, x)
    nan_groups = torch.zeros(m, kb, dtype=torch.bool, device=DEVICE)
    nan_groups[1, 1] = nan_groups[4, kb - 1] = True
    assert torch.equal(torch.isnan(s), nan_groups) and torch.equal(torch.isnan(want_s), nan_groups)
    assert torch.isnan(q.float()[1, 128:256]).all() and torch.isnan(q.float()[4, 4096:]).all()
    # elsewhere the reference's bits; the inf group: scale inf, x / inf = +-0, inf / inf NaN
    assert torch.isinf(s[4, 0]) and torch.isinf(want_s[4, 0])
    assert torch.equal(torch.isnan(q.float()), torch.isnan(want_q.float()))
    keep = ~nan_groups.repeat_interleave(128, dim=1)[:, :k] & ~torch.isnan(want_q.float())
    assert torch.equal(q.view(torch.uint8)[keep], want_q.view(torch.uint8)[keep])
    assert torch.equal(s.contiguous().view(torch.int32)[~nan_groups],
                       want_s.view(torch.int32)[~nan_groups])
    if dtype == "fp32":  # (the decode kernel quantizes 16-bit activations only)
        return
    n = 2112
    c = dict(m=m, n=n, k=k, out=dtype, per_row=False, bias=None,
             seed=case_seed("quant-nan-w", dtype))
    _, _, _, wq, ws, _ = make_data(c)
    with sm90_plan.forced(fuse_quant=True):
        p = sm90_plan.choose(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        assert sm90_launch.fuse_quant(m, k, p), p
        y = fp8linear.fp8_linear(x, wq, ws)
        want = fp8linear.block_fp8_gemm(want_q, want_s, wq, ws, out_dtype=x.dtype)
        torch.cuda.synchronize()
    bad_rows = torch.tensor([False, True, False, False, True, False], device=DEVICE)
    assert torch.isnan(y[bad_rows]).all() and not torch.isnan(y[~bad_rows]).any()
    assert torch.equal(y[~bad_rows].view(torch.int16), want[~bad_rows].view(torch.int16)), p


@pytest.mark.gpu
def test_sm90_fused_quantization_bit_exact(monkeypatch):
    """fp8_linear with the quantization fused into the decode kernel equals, bit for bit,
    block_fp8_gemm on quantize_activation's output (the same plan, so the same sums): the
    fused quantization is exactly the reference's, at every token count and K range it
    serves, bf16 and fp16 inputs."""
    select_backend("sm90", monkeypatch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fused = 0
    with sm90_plan.forced(fuse_quant=True):
        for i, (m, n, k, dt) in enumerate(((1, 2112, 7168, "bf16"), (4, 4096, 4096, "fp16"),
                                           (8, 6144, 4096, "bf16"), (13, 1024, 2064, "bf16"),
                                           (16, 4096, 7168, "fp16"), (3, 576, 7168, "bf16"))):
            c = dict(m=m, n=n, k=k, out=dt, per_row=i % 2 == 1, bias=None,
                     seed=case_seed("fused-bits", m, n, k))
            x, a, a_s, wq, ws, _ = make_data(c)
            p = sm90_plan.choose(m, n, k, sms)
            fused += sm90_launch.fuse_quant(m, k, p)
            y = fp8linear.fp8_linear(x, wq, ws)
            want = fp8linear.block_fp8_gemm(a, a_s, wq, ws, out_dtype=x.dtype)
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), want.view(torch.int16)), f"{p} {c}"
    assert fused >= 4, fused


@pytest.mark.gpu
def test_sm90_decode_kernel_up_to_256_tokens(monkeypatch):
    """Forced decode_max_m=256 runs the split-K decode kernel at 33..256 tokens with
    64- and 128-token tiles (one or two per weight-row tile), both weight-scale
    granularities (by default the large-M kernel takes M > 32)."""
    select_backend("sm90", monkeypatch)
    cases = [c for c in _sm90_only(gen_cases("sm90", count=600, seed=300))
             if 32 < c["m"] <= 256][:20]
    assert any(c["m"] <= 64 for c in cases) and any(c["m"] > 128 for c in cases)
    with sm90_plan.forced(decode_max_m=256):
        for case in cases:
            m, n, k = case["m"], case["n"], case["k"]
            p = sm90_plan.choose(m, n, k, 132)
            assert p.kind == "decode"
            assert p.config == (3 if m <= 64 else len(DECODE_TILES) - 1), p
            check_case(case, f"sm90 decode m={case['m']} {case_id(case)}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(100, 256), (128, 200), (12, 24), (1000, 1000)])
def test_sm90_rejects_unaligned(n, k, monkeypatch):
    select_backend("sm90", monkeypatch)
    c = {"m": 4, "n": n, "k": k, "per_row": False, "out": "bf16", "bias": None,
         "seed": case_seed("unaligned", n, k)}
    x, a, a_s, wq, ws, _ = make_data(c)
    torch.cuda.synchronize()
    out = poisoned(4, n, torch.bfloat16)
    msg = (f"the sm90 backend needs K % 16 == 0 and N % 8 == 0 (TMA needs 16-byte row "
           f"strides); got N={n}, K={k}. Unset FP8LINEAR_BACKEND to use the Triton path.")
    with raises_exactly(ValueError, msg):
        fp8linear.block_fp8_gemm(a, a_s, wq, ws, out=out)
    with raises_exactly(ValueError, msg):
        fp8linear.block_fp8_gemm(a, a_s, wq, ws)
    with raises_exactly(ValueError, msg):
        fp8linear.fp8_linear(x, wq, ws)
    torch.cuda.synchronize()
    assert bool(out.isnan().all()), "a rejected call wrote to its output"
    # not forced, the same shape takes the Triton path and is right
    monkeypatch.delenv("FP8LINEAR_BACKEND")
    ref, mag = reference(a, a_s, wq, ws, None)
    res = fp8linear.block_fp8_gemm(a, a_s, wq, ws, out=out)
    torch.cuda.synchronize()
    assert_close(res, ref, mag, f"default dispatch {n}x{k}")


@pytest.mark.gpu
def test_sm90_extension_rejects_bad_rows_and_oversized_quant(monkeypatch):
    """Launch arguments the plans never produce are refused by the kernel library with a
    message, before any launch: decode CTAs owning 72..120 rows at two an SM, a row count off
    the allowed set, and a quantization too large for the quant kernel's int indices (checked
    on stride-0 views, so nothing that size is allocated)."""
    select_backend("sm90", monkeypatch)
    from fp8linear.backends.sm90 import library
    ext = library.load()
    m, n, k = 1, 1024, 256
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    wq, ws = fp8linear.quantize_weight(torch.randn(n, k, device=DEVICE))
    out = poisoned(m, n, torch.bfloat16)
    with raises_exactly(RuntimeError,
                        "fp8linear decode: decode CTAs owning 72..120 rows run one an SM"):
        ext.decode(x, None, wq, ws, False, None, out, 0, 13, 0, 80, 1, 2, False, False, False)
    with raises_exactly(RuntimeError, "fp8linear decode: rows must be 64 (token tiles <= 64), "
                                      "128, or a multiple of 8 in 72..120"):
        ext.decode(x, None, wq, ws, False, None, out, 0, 11, 0, 100, 1, 1, False, False, False)
    torch.cuda.synchronize()
    assert bool(out.isnan().all()), "a rejected launch wrote to its output"
    big_m, big_k = 1 << 20, 8192           # 2^26 groups of 128 channels: 32 lanes each > 2^31
    xe = torch.empty(1, big_k, device=DEVICE, dtype=torch.bfloat16).expand(big_m, big_k)
    qe = torch.empty(1, big_k, device=DEVICE, dtype=torch.uint8).expand(big_m, big_k)
    se = torch.empty(big_k // 128, 1, device=DEVICE).expand(big_k // 128, big_m)
    with raises_exactly(RuntimeError,
                        "fp8linear quant: too many tokens x channels for one launch"):
        ext.quant(xe, qe, se, False)


@pytest.mark.gpu
def test_sm90_decode_rejects_fp32_for_fused_quantization(monkeypatch):
    """The decode kernel quantizes bf16/fp16 activations itself; fp32 ones must go through
    the quant kernel first (quant_first), and the kernel library says so rather than launching."""
    select_backend("sm90", monkeypatch)
    from fp8linear.backends.sm90 import library
    m, n, k = 1, 128, 256
    x = torch.randn(m, k, device=DEVICE)
    wq, ws = fp8linear.quantize_weight(torch.randn(n, k, device=DEVICE))
    out = poisoned(m, n, torch.bfloat16)
    with raises_exactly(RuntimeError,
                        "fp8linear decode: fused quantization takes bf16/fp16 activations"):
        library.load().decode(x, None, wq, ws, False, None, out, 0, 1, 0, 128, 1, 1, False,
                            False, False)
    torch.cuda.synchronize()
    assert bool(out.isnan().all()), "a rejected launch wrote to its output"


@pytest.mark.gpu
def test_sm90_decode_concurrent_streams(monkeypatch):
    """Split-K decode GEMMs of the same shape on two streams at once: each stream counts its
    tiles' arrivals on its own counters (shared ones would let one stream's CTAs finish the
    other's tiles early); every result bit-identical to a lone run."""
    select_backend("sm90", monkeypatch)
    m, n, k = 1, 2112, 7168
    p = sm90_plan.choose(m, n, k, 132)
    assert p.kind == "decode" and p.splits > 1, p
    data = []
    for i in range(2):
        c = {"m": m, "n": n, "k": k, "per_row": False, "out": "bf16", "bias": None,
             "seed": case_seed("streams", i)}
        x, a, a_s, wq, ws, _ = make_data(c)
        alone = poisoned(m, n, torch.bfloat16)
        fp8linear.block_fp8_gemm(a, a_s, wq, ws, out=alone)
        torch.cuda.synchronize()
        ref, mag = reference(a, a_s, wq, ws, None)
        assert_close(alone, ref, mag, f"stream case {i}")
        data.append((a, a_s, wq, ws, alone))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[poisoned(m, n, torch.bfloat16) for _ in range(40)] for _ in range(2)]
    torch.cuda.synchronize()
    for it in range(40):
        for i, st in enumerate(streams):
            a, a_s, wq, ws, _ = data[i]
            with torch.cuda.stream(st):
                fp8linear.block_fp8_gemm(a, a_s, wq, ws, out=outs[i][it])
    torch.cuda.synchronize()
    for i in range(2):
        bad = [it for it in range(40) if not torch.equal(outs[i][it], data[i][4])]
        assert not bad, f"stream {i}: launches {bad} differ from the lone run"


@pytest.mark.gpu
def test_sm90_counters_made_during_a_capture_start_zeroed(monkeypatch):
    """A stream's first split-K decode call inside a CUDA graph capture makes its reduction
    counters; an eager call on that stream before any replay must still find them zero (an
    at::zeros there only records its fill in the graph: the counts would start from whatever
    the memory held and the output stay unwritten, here NaN)."""
    select_backend("sm90", monkeypatch)
    c = {"m": 1, "n": 2112, "k": 7168, "per_row": False, "out": "bf16", "bias": None,
         "seed": case_seed("capture-counters")}
    x, a, a_s, wq, ws, bias = make_data(c)
    p = sm90_plan.choose(1, 2112, 7168, torch.cuda.get_device_properties(0).multi_processor_count)
    assert p.kind == "decode" and p.splits > 1, f"not a split-K plan: {p}"
    fp8linear.block_fp8_gemm(a, a_s, wq, ws)  # (kernel attributes set outside any capture)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()  # first used by our kernels inside the capture below
    # The capture allocates from a pool whose cached block holds -1s (a fresh segment may
    # happen to be zero): counters made there without a fill start at -1. A small tensor
    # kept alive in the same segment stops the capture's empty_cache from releasing it.
    pool = torch.cuda.MemPool()
    with torch.cuda.stream(s), torch.cuda.use_mem_pool(pool):
        anchor = torch.zeros(128, dtype=torch.int32, device=DEVICE)
        dirty = torch.full((1 << 18,), -1, dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()
    del dirty
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id, stream=s):
        fp8linear.block_fp8_gemm(a, a_s, wq, ws)
    ref, mag = reference(a, a_s, wq, ws, None)
    # every call checked: from stale counts the first finds no last CTA (NaN), and a second
    # may then be 'completed' by its first CTA from the first call's partials
    for i in range(2):
        with torch.cuda.stream(s):
            out = poisoned(1, 2112, torch.bfloat16)
            fp8linear.block_fp8_gemm(a, a_s, wq, ws, out=out)
        torch.cuda.synchronize()
        assert_close(out, ref, mag, f"eager call {i} on the capture stream before a replay")
    g.replay()
    torch.cuda.synchronize()
    del anchor
