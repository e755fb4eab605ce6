"""fp8linear/backends/sm90/backend.py's glue on the CPU: what it hands the kernel library
(tensors, layouts, flags) for each launch (launch.decide), with a recording stand-in for
library.Library. The kernels themselves are tested on the GPU (tests/backends/test_gemm_gpu.py,
sm90/test_gemm.py); this keeps CI on the Python side of every launch."""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import fp8linear
from fp8linear import knobs
from fp8linear.backends.sm90 import backend as sm90
from fp8linear.backends.sm90 import launch, library, plan
from fp8linear.backends.sm90.tiles import GEMM_TILES


class Recorder:
    """Stands in for library.Library: records each call's arguments."""

    def __init__(self):
        self.calls = []

    def gemm(self, a, a_scale_t, w, w_scale, per_row, bias, out, config, pdl, quant_pdl,
             early_b, group_m, ws_floats, tiles):
        self.calls.append(("gemm", dict(a=a, a_scale_t=a_scale_t, w=w, w_scale=w_scale,
                                         per_row=per_row, bias=bias, out=out,
                                         config=config, pdl=pdl, quant_pdl=quant_pdl,
                                         early_b=early_b, group_m=group_m, ws_floats=ws_floats,
                                         tiles=tiles)))

    def decode(self, x, x_scale, w, w_scale, per_row, bias, out, ws_floats, tiles, config,
               rows, splits, ctas_per_sm, pdl, early_trigger, quant_first):
        self.calls.append(("decode", dict(x=x, x_scale=x_scale, w=w, w_scale=w_scale,
                                          per_row=per_row, bias=bias, out=out,
                                          ws_floats=ws_floats, tiles=tiles,
                                          config=config, rows=rows, splits=splits,
                                          ctas=ctas_per_sm, pdl=pdl, early=early_trigger,
                                          quant_first=quant_first)))


@pytest.fixture
def lib(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(library, "load", lambda: rec)
    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    monkeypatch.delenv("FP8LINEAR_PDL", raising=False)
    assert plan.current() == plan.NONE      # nothing forced: the rules decide
    return rec


@pytest.mark.parametrize("method", ["gemm", "decode"])
def test_recorder_takes_what_the_library_takes(method):
    # the stand-in must not drift from the real methods the backend calls
    assert list(inspect.signature(getattr(Recorder, method)).parameters) == \
        list(inspect.signature(getattr(library.Library, method)).parameters)


def _operands(m, n, k):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w, ws = fp8linear.quantize_weight(torch.randn(n, k, generator=g))
    a, a_s = fp8linear.quantize_activation(x)
    return x, a, a_s, w, ws


def _out(m, n):
    return torch.empty(m, n, dtype=torch.bfloat16)


def test_gemm_reads_column_major_scales_in_place(lib):
    m, n, k = 600, 4096, 4096
    _, a, a_s, w, ws = _operands(m, n, k)
    col = torch.empty(a_s.shape[1], 600)[:, :m].copy_(a_s.t()).t()   # strides (1, 600)
    sm90.gemm(a, col, w, ws, None, _out(m, n))
    (kind, c), = lib.calls
    assert kind == "gemm" and c["config"] == plan.choose(m, n, k, 132).config
    # the [Kb, M] view of the caller's own storage: no copy
    assert c["a_scale_t"].data_ptr() == col.data_ptr() and c["a_scale_t"].stride() == (600, 1)


@pytest.mark.parametrize("m", [600, 601])
def test_gemm_copies_row_major_scales_into_tma_rows(lib, m):
    n, k = 4096, 4096
    _, a, a_s, w, ws = _operands(m, n, k)
    sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    (_, c), = lib.calls
    st = c["a_scale_t"]
    ld = -(-m // 4) * 4                      # 16-byte rows
    assert st.shape == (k // 128, ld) and st.is_contiguous()
    assert torch.equal(st[:, :m], a_s.t())


def test_linear_large_m_hands_raw_activations_to_the_library(lib):
    """Large M: the library quantizes x (its own scratch) and runs the GEMM, both under
    PDL, so the GEMM's launch and prologue overlap the quant kernel."""
    m, n, k = 200, 28672, 4096
    x, _, _, w, ws = _operands(m, n, k)
    sm90.linear(x, w, ws, None, _out(m, n))
    (kind, g), = lib.calls
    assert kind == "gemm" and g["a"] is x and g["a_scale_t"] is None
    assert g["config"] == plan.choose(m, n, k, 132, after_quant=True).config
    assert g["pdl"] is True and g["quant_pdl"] is True
    assert g["early_b"] == 0            # behind our quant kernel past 128 tokens: no early loads


@pytest.mark.parametrize("m,n,early", [
    (64, 28672, 4),         # 64x128 tiles (full registers) at decode sizes
    (64, 4096, 8),          # lean 64x32 tiles: more, smaller stages
    (200, 4096, 4),         # 129-256 tokens over >= 8 K blocks too
    (600, 4096, 0),         # past the decode sizes
])
def test_gemm_early_weights_follow_the_rule(lib, m, n, early):
    k = 4096
    _, a, a_s, w, ws = _operands(m, n, k)
    sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    (_, c), = lib.calls
    assert c["early_b"] == early
    assert early == launch.gemm_early_weights(m, k, c["config"], False)


@pytest.mark.parametrize("m,k,group", [(4096, 8192, 4), (4096, 4096, 16), (600, 8192, 8)])
def test_gemm_tile_order_band_follows_the_rule(lib, m, k, group):
    n = 256
    _, a, a_s, w, ws = _operands(m, n, k)
    sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    (_, c), = lib.calls
    assert c["group_m"] == group == launch.gemm_group_m(m, k)
    with plan.forced(gemm_group_m=2):
        sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    assert lib.calls[-1][1]["group_m"] == 2


def test_gemm_early_weights_need_pdl(lib):
    # the early loads only mean something under PDL: with it off they are off too
    m, n, k = 64, 28672, 4096
    _, a, a_s, w, ws = _operands(m, n, k)
    with plan.forced(gemm_pdl=False):
        sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    assert lib.calls[-1][1]["pdl"] is False and lib.calls[-1][1]["early_b"] == 0


def _pdl_env(monkeypatch, on):
    monkeypatch.setenv("FP8LINEAR_PDL", "1" if on else "0")
    return contextlib.nullcontext()


def _pdl_forced(monkeypatch, on):
    return plan.forced(gemm_pdl=on)


@pytest.mark.parametrize("switch", [_pdl_env, _pdl_forced], ids=["FP8LINEAR_PDL", "forced"])
def test_gemm_pdl_switches(lib, monkeypatch, switch):
    m, n, k = 600, 4096, 4096
    _, a, a_s, w, ws = _operands(m, n, k)
    with switch(monkeypatch, False):
        sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    assert lib.calls[-1][0] == "gemm" and lib.calls[-1][1]["pdl"] is False
    with switch(monkeypatch, True):
        sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    assert lib.calls[-1][1]["pdl"] is True


def test_split_tail_gemm_gets_a_workspace(lib):
    """A split-tail configuration gets one fp32 tile a CTA of workspace and a counter a tile;
    whole-tile configurations get none."""
    m, n, k = 1024, 2112, 7168
    _, a, a_s, w, ws = _operands(m, n, k)
    sk = next(c for c, t in enumerate(GEMM_TILES) if t.split_tail)
    bm, bn = GEMM_TILES[sk].bm, GEMM_TILES[sk].bn
    with plan.forced(gemm_config=sk):
        sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    d = lib.calls[-1][1]
    assert d["config"] == sk and d["ws_floats"] == 132 * bm * bn
    assert d["tiles"] == (m // bm) * -(-n // bn)    # 8 x 11 tiles of 128x192
    with plan.forced(gemm_config=3):   # the same tile, whole tiles
        sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    d = lib.calls[-1][1]
    assert d["config"] == 3 and d["ws_floats"] == 0 and d["tiles"] == 0


def test_linear_fused_decode_passes_raw_activations(lib):
    m, n, k = 1, 4096, 4096        # 64-row tiles, two splits, two CTAs an SM: fused
    x, _, _, w, ws = _operands(m, n, k)
    sm90.linear(x, w, ws, None, _out(m, n))
    (kind, d), = lib.calls
    assert kind == "decode" and d["x"] is x and d["x_scale"] is None
    assert d["quant_first"] is False   # the kernel quantizes x itself
    assert (d["rows"], d["splits"], d["ctas"]) == (64, 2, 2)
    assert d["pdl"] is True and d["early"] is True
    assert d["ws_floats"] == 2 * 64 * 8 * 64        # [splits][tiles][BT][rows] fp32


def test_decode_split_reduction_workspace(lib, monkeypatch):
    m, n, k = 1, 2112, 7168        # 33 tiles of 64 rows x four splits: the workspace reduction
    x, _, _, w, ws = _operands(m, n, k)
    sm90.linear(x, w, ws, None, _out(m, n))
    (_, d), = lib.calls
    assert (d["splits"], d["rows"]) == (4, 64)
    assert d["ws_floats"] == 4 * 33 * 8 * 64        # [splits][tiles][BT][rows] fp32
    assert d["tiles"] == 33                         # one reduction counter each
    assert d["early"] is True
    lib.calls.clear()
    with plan.forced(decode_early_trigger=False):
        sm90.linear(x, w, ws, None, _out(m, n))
        assert lib.calls[-1][1]["early"] is False
        monkeypatch.setenv("FP8LINEAR_PDL", "0")
        sm90.linear(x, w, ws, None, _out(m, n))
        assert lib.calls[-1][1]["pdl"] is False


def test_linear_unfused_decode_quantizes_first(lib):
    m, n, k = 20, 2112, 7168       # 32-token tiles over 56 K blocks: quant kernel + decode
    x, _, _, w, ws = _operands(m, n, k)
    p = plan.choose(m, n, k, 132)
    assert p.kind == "decode" and not launch.fuse_quant(m, k, p)
    sm90.linear(x, w, ws, None, _out(m, n))
    (kind, d), = lib.calls
    # the library runs the quant kernel first, both under PDL (the quant kernel may start
    # during the previous decode GEMM)
    assert kind == "decode" and d["x"] is x and d["x_scale"] is None
    assert d["quant_first"] is True and d["pdl"] is True


def test_launch_decided_once_per_shape(lib, monkeypatch):
    """The plan, fusion and knob reads are made once per (M, N, K, dtype, device) while knobs
    are cached (the eager hot path then does a dict lookup), and again after knobs.reload()
    or when plan.forced() changes the overrides."""
    monkeypatch.setattr(knobs, "CACHE_VALUES", True)
    monkeypatch.setattr(launch, "_launches", {})
    knobs.reload()
    calls = []
    real = plan.choose
    monkeypatch.setattr(launch, "choose", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    m, n, k = 1, 4096, 4096
    x, _, _, w, ws = _operands(m, n, k)
    try:
        for _ in range(3):
            sm90.linear(x, w, ws, None, _out(m, n))
        assert len(calls) == 1 and len(lib.calls) == 3
        sm90.linear(x[:, :2048].contiguous(), w[:, :2048].contiguous(),
                    ws[:, :16].contiguous(), None, _out(m, n))          # another K
        assert len(calls) == 2
        monkeypatch.setenv("FP8LINEAR_PDL", "0")   # a knob change is seen after knobs.reload()
        sm90.linear(x, w, ws, None, _out(m, n))
        assert lib.calls[-1][1]["pdl"] is True and len(calls) == 2
        knobs.reload()
        sm90.linear(x, w, ws, None, _out(m, n))
        assert lib.calls[-1][1]["pdl"] is False and len(calls) == 3
        sm90.linear(x, w, ws, None, _out(m, n))
        assert len(calls) == 3
        with plan.forced(decode_early_trigger=False):   # forcing decides again, in and out
            sm90.linear(x, w, ws, None, _out(m, n))
            assert lib.calls[-1][1]["early"] is False and len(calls) == 4
        sm90.linear(x, w, ws, None, _out(m, n))
        assert lib.calls[-1][1]["early"] is True and len(calls) == 5
    finally:
        knobs.reload()


def test_launch_cache_is_bounded(lib, monkeypatch):
    monkeypatch.setattr(knobs, "CACHE_VALUES", True)
    monkeypatch.setattr(launch, "_launches", {})
    monkeypatch.setattr(launch, "_MAX_LAUNCHES", 3)
    try:
        for m in range(1, 6):
            x, _, _, w, ws = _operands(m, 256, 256)
            sm90.linear(x, w, ws, None, _out(m, 256))
        assert 1 <= len(launch._launches) <= 3 and len(lib.calls) == 5
    finally:
        knobs.reload()


# ----------------------------------------------------------------------------- bias
# (op, M): the large-M GEMM and the decode kernel, each through block_fp8_gemm and fp8_linear
KERNELS = [("gemm", 600), ("gemm", 1), ("linear", 600), ("linear", 1)]


N, K = 512, 512     # (small: quick to make; M = 1 still decodes, 600 runs the large-M GEMM)


def _call(op, m, n, k, bias, out_dtype=torch.bfloat16):
    x, a, a_s, w, ws = _operands(m, n, k)
    out = torch.empty(m, n, dtype=out_dtype)
    if op == "gemm":
        sm90.gemm(a, a_s, w, ws, bias, out)
    else:
        sm90.linear(x.to(out_dtype), w, ws, bias, out)
    return out


@pytest.mark.parametrize("op,m", KERNELS)
@pytest.mark.parametrize("bias_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16),
                                                  (torch.float32, torch.float16)])
def test_bias_in_the_output_dtype_or_fp32_goes_as_is(lib, op, m, bias_dtype, out_dtype):
    # the library reads a bias in the output's dtype, or fp32 (its flag): no copy
    bias = torch.randn(N).to(bias_dtype)
    out = _call(op, m, N, K, bias, out_dtype)
    (kind, c), = lib.calls
    assert kind == ("decode" if m == 1 else "gemm")
    assert c["bias"] is bias and c["out"] is out


@pytest.mark.parametrize("op,m", KERNELS)
@pytest.mark.parametrize("bias_dtype,out_dtype", [(torch.bfloat16, torch.float16),
                                                  (torch.float16, torch.bfloat16),
                                                  (torch.float64, torch.bfloat16)])
def test_bias_in_another_dtype_goes_as_fp32(lib, op, m, bias_dtype, out_dtype):
    # never rounded to the output dtype first: fp32 holds a bf16/fp16 bias exactly
    bias = (torch.randn(N) * 3).to(bias_dtype)
    _call(op, m, N, K, bias, out_dtype)
    (_, c), = lib.calls
    assert c["bias"].dtype == torch.float32 and c["bias"].data_ptr() % 8 == 0
    assert torch.equal(c["bias"], bias.float())


@pytest.mark.parametrize("op,m", KERNELS)
def test_bias_at_an_odd_offset_is_copied(lib, op, m):
    # the kernels read the bias in pairs: an 8-byte aligned copy of a view at an odd offset
    full = torch.randn(N + 4).to(torch.bfloat16)
    bias = full[1:N + 1]
    assert bias.data_ptr() % 8 != 0
    _call(op, m, N, K, bias)
    (_, c), = lib.calls
    got = c["bias"]
    assert got.data_ptr() % 8 == 0 and got.dtype == torch.bfloat16 and torch.equal(got, bias)
    aligned = full[4:]       # 8 bytes in: handed over as it is
    _call(op, m, N, K, aligned)
    assert lib.calls[-1][1]["bias"] is aligned


@pytest.mark.parametrize("op,m", KERNELS)
def test_no_bias_stays_none(lib, op, m):
    _call(op, m, N, K, None)
    assert lib.calls[-1][1]["bias"] is None


# ------------------------------------------------------------------- the Triton fallback
@pytest.fixture
def triton_stand_in(monkeypatch):
    """The Triton backend's gemm / linear (fp8linear.backends.triton.gemm), recording."""
    from fp8linear.backends.triton import gemm as triton_gemm
    calls = []
    monkeypatch.setattr(triton_gemm, "gemm", lambda *args: calls.append(("gemm", args)))
    monkeypatch.setattr(triton_gemm, "linear", lambda *args: calls.append(("linear", args)))
    return calls


def _misaligned(t, by=1):
    """t's values in a view whose data pointer is ``by`` elements past a 16-byte boundary."""
    buf = torch.empty(t.numel() + by, dtype=t.dtype)
    v = buf[by:].view(t.shape)
    v.copy_(t)
    return v


@pytest.mark.parametrize("op,m", KERNELS)
def test_fp32_outputs_go_to_triton(lib, triton_stand_in, op, m):
    # the CUDA epilogue writes 16-bit outputs only
    n, k = N, K
    x, a, a_s, w, ws = _operands(m, n, k)
    bias = torch.randn(n)
    out = torch.empty(m, n)
    if op == "gemm":
        sm90.gemm(a, a_s, w, ws, bias, out)
        want = (a, a_s, w, ws, bias, out)
    else:
        sm90.linear(x, w, ws, bias, out)
        want = (x, w, ws, bias, out)
    assert lib.calls == []
    (kind, args), = triton_stand_in
    assert kind == op and len(args) == len(want)
    assert all(g is e for g, e in zip(args, want))     # the caller's tensors, untouched


@pytest.mark.parametrize("op,m", KERNELS)
@pytest.mark.parametrize("which", ["activations", "weight", "out"])
def test_views_off_16_byte_boundaries_go_to_triton(lib, triton_stand_in, op, m, which):
    # TMA descriptors need 16-byte aligned base addresses
    n, k = N, K
    x, a, a_s, w, ws = _operands(m, n, k)
    out = _out(m, n)
    if which == "activations":
        a, x = _misaligned(a), _misaligned(x)
    elif which == "weight":
        w = _misaligned(w)
    else:
        out = _misaligned(out)
    if op == "gemm":
        sm90.gemm(a, a_s, w, ws, None, out)
    else:
        sm90.linear(x, w, ws, None, out)
    assert lib.calls == []
    (kind, args), = triton_stand_in
    assert kind == op and args[-1] is out


@pytest.mark.parametrize("op,m", KERNELS)
def test_aligned_16_bit_outputs_stay_on_sm90(lib, triton_stand_in, op, m):
    _call(op, m, N, K, None)
    assert len(lib.calls) == 1 and triton_stand_in == []


def test_dispatch_log_names_each_decision_once(lib, triton_stand_in, monkeypatch, capsys):
    monkeypatch.setattr(sm90, "_LOG_DISPATCH", True)
    monkeypatch.setattr(sm90, "_logged", set())
    m, n, k = 600, N, K
    x, a, a_s, w, ws = _operands(m, n, k)
    for _ in range(2):
        sm90.gemm(a, a_s, w, ws, None, _out(m, n))
        sm90.gemm(a, a_s, w, ws, None, torch.empty(m, n))
    p = plan.choose(m, n, k, 132)
    assert capsys.readouterr().err.splitlines() == [
        f"fp8linear dispatch: block_fp8_gemm x(600, 512) torch.float8_e4m3fn w(512, 512) -> "
        f"torch.bfloat16: sm90 {p} ({p.rule})",
        "fp8linear dispatch: block_fp8_gemm x(600, 512) torch.float8_e4m3fn w(512, 512) -> "
        "torch.float32: triton (fp32 output or unaligned pointer)"]
