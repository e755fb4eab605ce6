"""GPU correctness suite of the CUDA backends behind block_fp8_gemm / fp8_linear:
fp8linear/backends/sm90 and fp8linear/backends/triton, each forced through FP8LINEAR_BACKEND
(sm90 on compute capability 9.0, triton on every CUDA GPU). What an output is held to, and the
generated cases: gemm_checks.py. The sm90 kernels' own variants (every tile, decode plan and
quantization path forced): sm90/test_gemm.py.

- test_random_shapes: >= 200 generated shapes per backend, each through block_fp8_gemm into
  a NaN-poisoned output (scales row- and column-major: the same bits) and through fp8_linear
  from the 16/32-bit activations, against the fp64 reference.
- test_determinism: 20 runs of M in {1, 8, 32} on split-K shapes give identical bits.
- test_cuda_graph_replay: graph capture + replay equals eager, bit for bit, over several
  replays with new inputs.
"""
from __future__ import annotations

import pytest
import torch

import fp8linear
from fp8linear.backends.sm90 import plan as sm90_plan
from fp8linear.quant import BLOCK

from .gemm_checks import (ACC_TOL, BACKENDS, DEVICE, ROUND_TOL, assert_close, backend_used,
                          case_id, case_seed, check_case, fits, gen_cases, make_data,
                          poisoned, reference, select_backend)

_PARAMS = [(b, c) for b in BACKENDS for c in gen_cases(b)]


# -------------------------------------------------------------------- CPU self-checks
def test_generated_cases_cover_the_spec():
    """The generator's promise, checked without a GPU."""
    for b in BACKENDS:
        cases = gen_cases(b)
        assert len(cases) >= 200
        ms = [c["m"] for c in cases]
        assert min(ms) == 1 and max(ms) == 8192
        assert sum(m == 1 for m in ms) >= 5
        assert sum(m > 512 for m in ms) >= 40 and sum(65 <= m <= 512 for m in ms) >= 30
        assert sum(c["n"] % BLOCK != 0 for c in cases) >= 50
        assert sum(c["k"] % BLOCK != 0 for c in cases) >= 50
        assert sum(c["k"] < BLOCK for c in cases) >= 2
        assert any(c["per_row"] for c in cases) and any(not c["per_row"] for c in cases)
        assert {c["out"] for c in cases} == {"bf16", "fp16", "fp32"}
        assert {c["bias"] for c in cases} == {None, "out", "fp32"}
        assert all(fits(c["m"], c["n"], c["k"]) for c in cases)
        assert len({c["seed"] for c in cases}) == len(cases)
        aligned = [c["k"] % 16 == 0 and c["n"] % 8 == 0 for c in cases]
        if b == "sm90":
            assert all(aligned)
        else:
            assert sum(not a for a in aligned) >= 20
    assert gen_cases("sm90") == gen_cases("sm90")       # reproducible


def test_reference_helpers_on_cpu():
    """deq64 / reference agree with fp8linear's dequantization and reference GEMM."""
    c = {"m": 5, "n": 130, "k": 200, "per_row": False, "out": "bf16", "bias": "fp32",
         "seed": 1}
    for per_row in (False, True):
        c["per_row"] = per_row
        x, a, a_s, wq, ws, bias = make_data(c, device="cpu")
        ref, mag = reference(a, a_s, wq, ws, bias)
        want = (fp8linear.dequantize_activation(a, a_s).double()
                @ fp8linear.dequantize_weight(wq, ws).double().t() + bias.double())
        # fp8linear dequantizes in fp32 (products rounded to 24 bits): equal up to that
        assert bool(((ref - want).abs() <= 1e-6 * mag + 1e-12).all())
        assert bool((mag >= ref.abs() - 1e-9).all())
        out = fp8linear.block_fp8_gemm(a, a_s, wq, ws, out_dtype=torch.bfloat16, bias=bias)
        assert_close(out, ref, mag, "cpu reference backend", bias=bias)
        # a wrong scale in one 128-block of the weight must fail the check
        ws_bad = ws.clone()
        ws_bad[0, 0] *= 1.5
        bad = fp8linear.block_fp8_gemm(a, a_s, wq, ws_bad, out_dtype=torch.bfloat16, bias=bias)
        with pytest.raises(AssertionError, match="^planted error: "):
            assert_close(bad, ref, mag, "planted error", bias=bias)
        # and one element off by three times its tolerance, far too little for the norms:
        # the elementwise check
        tol = ROUND_TOL["bf16"] * (ref.abs() + bias.double().abs()) + ACC_TOL * mag
        i, j = divmod(int(tol.argmin()), c["n"])
        bad = out.clone()
        bad[i, j] = ref[i, j] + 3 * tol[i, j]
        with pytest.raises(AssertionError, match=rf"^planted element: 1 of 650 elements off by "
                                                 rf"more than rounding \+ accumulation; "
                                                 rf"first \[{i}, {j}\]"):
            assert_close(bad, ref, mag, "planted element", bias=bias)


# ------------------------------------------------------------------------- GPU tests
@pytest.mark.gpu
@pytest.mark.parametrize("backend,case", _PARAMS,
                         ids=[f"{b}-{case_id(c)}" for b, c in _PARAMS])
def test_random_shapes(backend, case, monkeypatch):
    select_backend(backend, monkeypatch)
    m, n, k = case["m"], case["n"], case["k"]
    assert backend_used(m, n, k) == backend
    check_case(case, f"{backend} {case_id(case)}")


DET_SHAPES = [(2112, 7168), (1024, 8192), (576, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("nk", DET_SHAPES, ids=[f"{n}x{k}" for n, k in DET_SHAPES])
@pytest.mark.parametrize("per_row", [False, True], ids=["blk", "row"])
def test_determinism(backend, m, nk, per_row, monkeypatch):
    select_backend(backend, monkeypatch)
    n, k = nk
    c = {"m": m, "n": n, "k": k, "per_row": per_row, "out": "bf16", "bias": "out",
         "seed": case_seed("det", m, n, k, per_row)}
    x, a, a_s, wq, ws, bias = make_data(c)
    ref, mag = reference(a, a_s, wq, ws, bias)
    # something else on the GPU between runs, so CTAs finish in different orders
    noise = torch.empty(1 << 24, device=DEVICE)
    first_g = first_l = None
    for run in range(20):
        if run % 2:
            noise.normal_()
        out = poisoned(m, n, torch.bfloat16)
        fp8linear.block_fp8_gemm(a, a_s, wq, ws, out=out, bias=bias)
        y = fp8linear.fp8_linear(x, wq, ws, bias)
        torch.cuda.synchronize()
        if first_g is None:
            assert_close(out, ref, mag, f"{backend} determinism M={m} {n}x{k}", bias=bias)
            first_g, first_l = out.view(torch.int16).clone(), y.view(torch.int16).clone()
            continue
        dg = int((out.view(torch.int16) != first_g).sum())
        dl = int((y.view(torch.int16) != first_l).sum())
        assert dg == 0, f"block_fp8_gemm run {run}: {dg} elements differ from run 0"
        assert dl == 0, f"fp8_linear run {run}: {dl} elements differ from run 0"


@pytest.mark.gpu
def test_determinism_covers_split_k(monkeypatch):
    """The determinism shapes are meant to exercise sm90's split-K reduction."""
    select_backend("sm90", monkeypatch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = {(m, n, k): sm90_plan.choose(m, n, k, sms)
             for m in (1, 8, 32) for n, k in DET_SHAPES}
    split = [p for p in plans.values() if p.kind == "decode" and p.splits > 1]
    assert split, f"no determinism case uses split-K: {plans}"


GRAPH_MS = [1, 16, 64, 200, 2048]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", GRAPH_MS)
def test_cuda_graph_replay(backend, m, monkeypatch):
    select_backend(backend, monkeypatch)
    n, k = (2112, 7168) if m <= 200 else (1032, 4112)
    c = {"m": m, "n": n, "k": k, "per_row": m % 2 == 1, "out": "bf16", "bias": "out",
         "seed": case_seed("graph", backend, m)}
    x, a, a_s, wq, ws, bias = make_data(c)
    out = poisoned(m, n, torch.bfloat16)

    def run():
        fp8linear.block_fp8_gemm(a, a_s, wq, ws, out=out, bias=bias)
        return fp8linear.fp8_linear(x, wq, ws, bias)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = run()
    for trial in range(3):
        c2 = dict(c, seed=case_seed("graph-trial", backend, m, trial))
        x2 = make_data(c2)[0]
        x.copy_(x2)
        a2, s2 = fp8linear.quantize_activation(x2)
        a.copy_(a2)
        a_s.copy_(s2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        want_out = fp8linear.block_fp8_gemm(a, a_s, wq, ws, bias=bias)
        want_y = fp8linear.fp8_linear(x, wq, ws, bias)
        torch.cuda.synchronize()
        if trial == 0:
            ref, mag = reference(a, a_s, wq, ws, bias)
            assert_close(out, ref, mag, f"{backend} graph M={m}", bias=bias)
        assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), \
            f"replay {trial}: block_fp8_gemm differs from eager"
        assert torch.equal(y.view(torch.int16), want_y.view(torch.int16)), \
            f"replay {trial}: fp8_linear differs from eager"
