"""fp8linear/kernels/sm90.py's glue on the CPU: what it hands the extension (tensors, layouts,
flags) for each plan, with a recording stand-in for the compiled module. The kernels
themselves are tested on the GPU (test_gemm_gpu.py); this keeps CI on the Python side of
every launch."""
from __future__ import annotations

import pytest
import torch

import fp8linear
from fp8linear.kernels import heuristics, sm90


class Recorder:
    """Stands in for the compiled extension: records each call's arguments."""

    def __init__(self):
        self.calls = []

    def gemm(self, a, a_scale_t, w, w_scale, per_row, bias, out, config, pdl):
        self.calls.append(("gemm", dict(a=a, a_scale_t=a_scale_t, per_row=per_row,
                                         config=config, pdl=pdl)))

    def quant(self, x, q, scale_t, pdl):
        self.calls.append(("quant", dict(x=x, q=q, scale_t=scale_t, pdl=pdl)))

    def decode(self, x, x_scale, w, w_scale, per_row, bias, out, ws, counters, config, rows,
               splits, ctas_per_sm, pdl, early_trigger, cluster):
        self.calls.append(("decode", dict(x=x, x_scale=x_scale, ws=ws, config=config,
                                          rows=rows, splits=splits, ctas=ctas_per_sm, pdl=pdl,
                                          early=early_trigger, cluster=cluster)))


@pytest.fixture
def ext(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(sm90.build, "load", lambda: rec)
    monkeypatch.setattr(sm90, "_num_sms", lambda index: 132)
    for knob in ("FP8LINEAR_PDL", "FP8LINEAR_SM90_GEMM_PDL", "FP8LINEAR_SM90_DECODE_CLUSTER",
                 "FP8LINEAR_SM90_FUSE_QUANT", "FP8LINEAR_SM90_GEMM_CONFIG", "FP8LINEAR_SM90_DECODE_MAX_M",
                 "FP8LINEAR_SM90_DECODE_CTAS", "FP8LINEAR_SM90_DECODE_ROWS",
                 "FP8LINEAR_SM90_DECODE_SPLITS", "FP8LINEAR_SM90_DECODE_EARLY_TRIGGER"):
        monkeypatch.delenv(knob, raising=False)
    return rec


def _operands(m, n, k):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w, ws = fp8linear.quantize_weight(torch.randn(n, k, generator=g))
    a, a_s = fp8linear.quantize_activation(x)
    return x, a, a_s, w, ws


def _out(m, n):
    return torch.empty(m, n, dtype=torch.bfloat16)


def test_gemm_reads_column_major_scales_in_place(ext):
    m, n, k = 600, 4096, 4096
    _, a, a_s, w, ws = _operands(m, n, k)
    col = torch.empty(a_s.shape[1], 600)[:, :m].copy_(a_s.t()).t()   # strides (1, 600)
    sm90.gemm(a, col, w, ws, None, _out(m, n))
    (kind, c), = ext.calls
    assert kind == "gemm" and c["config"] == heuristics.sm90_plan(m, n, k, 132)[1]
    # the [Kb, M] view of the caller's own storage: no copy
    assert c["a_scale_t"].data_ptr() == col.data_ptr() and c["a_scale_t"].stride() == (600, 1)


@pytest.mark.parametrize("m", [600, 601])
def test_gemm_copies_row_major_scales_into_tma_rows(ext, m):
    n, k = 4096, 4096
    _, a, a_s, w, ws = _operands(m, n, k)
    sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    (_, c), = ext.calls
    st = c["a_scale_t"]
    ld = -(-m // 4) * 4                      # 16-byte rows
    assert st.shape == (k // 128, ld) and st.is_contiguous()
    assert torch.equal(st[:, :m], a_s.t())


def test_linear_large_m_quantizes_then_gemm_on_the_quant_kernels_layout(ext):
    m, n, k = 64, 28672, 4096
    x, _, _, w, ws = _operands(m, n, k)
    sm90.linear(x, w, ws, None, _out(m, n))
    (k1, q), (k2, g) = ext.calls
    assert (k1, k2) == ("quant", "gemm")
    assert g["a"] is q["q"] and g["a_scale_t"] is q["scale_t"]
    assert q["scale_t"].shape == (k // 128, 64)
    assert g["config"] == heuristics.sm90_plan(m, n, k, 132)[1]
    # the GEMM under PDL: its launch and prologue overlap the quant kernel
    assert q["pdl"] is True and g["pdl"] is True


@pytest.mark.parametrize("knob", ["FP8LINEAR_PDL", "FP8LINEAR_SM90_GEMM_PDL"])
def test_gemm_pdl_knobs(ext, monkeypatch, knob):
    m, n, k = 600, 4096, 4096
    _, a, a_s, w, ws = _operands(m, n, k)
    monkeypatch.setenv(knob, "0")
    sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    assert ext.calls[-1][0] == "gemm" and ext.calls[-1][1]["pdl"] is False
    monkeypatch.setenv(knob, "1")
    sm90.gemm(a, a_s, w, ws, None, _out(m, n))
    assert ext.calls[-1][1]["pdl"] is True


def test_linear_fused_decode_passes_raw_activations(ext):
    m, n, k = 1, 4096, 4096        # 64-row tiles, two splits, two CTAs an SM: fused, cluster
    x, _, _, w, ws = _operands(m, n, k)
    sm90.linear(x, w, ws, None, _out(m, n))
    (kind, d), = ext.calls
    assert kind == "decode" and d["x"] is x and d["x_scale"] is None
    assert (d["rows"], d["splits"], d["ctas"], d["cluster"]) == (64, 2, 2, True)
    assert d["pdl"] is True and d["early"] is True
    assert d["ws"].numel() == 0    # the cluster reduces in shared memory: no workspace


def test_decode_workspace_when_not_clustered(ext, monkeypatch):
    m, n, k = 1, 2112, 7168        # 33 tiles of 64 rows x four splits: the workspace reduction
    x, _, _, w, ws = _operands(m, n, k)
    sm90.linear(x, w, ws, None, _out(m, n))
    (_, d), = ext.calls
    assert d["cluster"] is False and (d["splits"], d["rows"]) == (4, 64)
    assert d["ws"].numel() == 4 * 33 * 8 * 64       # [splits][tiles][BT][rows] fp32
    ext.calls.clear()
    monkeypatch.setenv("FP8LINEAR_SM90_DECODE_EARLY_TRIGGER", "0")
    sm90.linear(x, w, ws, None, _out(m, n))
    assert ext.calls[-1][1]["early"] is False
    monkeypatch.setenv("FP8LINEAR_PDL", "0")
    sm90.linear(x, w, ws, None, _out(m, n))
    assert ext.calls[-1][1]["pdl"] is False


def test_linear_unfused_decode_reads_scales_by_stride(ext):
    m, n, k = 20, 2112, 7168       # 32-token tiles over 56 K blocks: quant kernel + decode
    x, _, _, w, ws = _operands(m, n, k)
    plan = heuristics.sm90_plan(m, n, k, 132)
    assert plan[0] == "decode" and not heuristics.sm90_fuse_quant(m, k, plan)
    sm90.linear(x, w, ws, None, _out(m, n))
    (k1, q), (k2, d) = ext.calls
    assert (k1, k2) == ("quant", "decode")
    assert q["pdl"] is True and d["pdl"] is True   # both under PDL: the quant kernel may start
    assert d["x"] is q["q"]                        # during the previous decode GEMM
    # token-major view of the quant kernel's [Kb, ld] scales
    assert d["x_scale"].shape == (m, k // 128) and d["x_scale"].stride() == (1, 20)
    assert d["x_scale"].data_ptr() == q["scale_t"].data_ptr()
