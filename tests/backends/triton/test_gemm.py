"""The Triton backend's GEMM and quantization kernels (fp8linear/backends/triton/gemm.py,
quant.py; its tile rules on the CPU: test_plan.py).

GPU tests (marked ``gpu``) run the compiled kernels: FP8LINEAR_BACKEND=triton forces this
backend on Hopper too, FP8LINEAR_TRITON_MODE=weight_only forces the Ampere mode on any GPU.
Every result is compared with the fp64 reference on the dequantized inputs (relative
Frobenius error <= 2e-3), outputs are NaN-poisoned first.

``test_interpreter`` runs the same kernels on the CPU (TRITON_INTERPRET=1) in a subprocess
that executes this file as a script (tests/triton_interpreter.py); see ``_interpreter_main``.
triton is in the dev extra: without it this file fails to import, it does not skip.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

# tests/: fp64_reference, triton_interpreter (also when this file runs as the interpreter
# script)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fp64_reference as ref  # noqa: E402
import triton_interpreter  # noqa: E402

import triton  # noqa: E402  (the dev extra's: a missing triton fails here, never skips)

import fp8linear  # noqa: E402
from fp8linear.backends.triton import gemm as tg  # noqa: E402
from fp8linear.backends.triton import plan as tp  # noqa: E402
from fp8linear.backends.triton import quant as tq  # noqa: E402
from fp8linear.quant import expand_weight_scale  # noqa: E402

TOL = 2e-3
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------- helpers
def _native_ok():
    if not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:
        return tg._default_mode(0) == "native"
    return torch.cuda.get_device_capability(0) >= (8, 9)


needs_native = pytest.mark.skipif(
    torch.cuda.is_available() and not _native_ok(),
    reason="native fp8 mode needs fp8 tensor cores (sm_89+); weight-only tests cover this GPU")


def rand_matrix(m, k, gen, device, spread=2.0):
    """Normal values with magnitudes varying by up to e^(+-spread) between 32x32 tiles (so
    blocks get different scales); never exactly zero."""
    tiles = torch.exp((torch.rand(-(-m // 32), -(-k // 32), generator=gen, device=device) * 2
                       - 1) * spread)
    mag = tiles.repeat_interleave(32, 0).repeat_interleave(32, 1)[:m, :k]
    x = torch.randn(m, k, generator=gen, device=device) * mag
    return torch.where(x == 0, torch.full_like(x, 1e-3), x)


def make_case(m, n, k, seed, device, per_row=False, bias_dtype=None):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = rand_matrix(m, k, gen, device)
    w, w_s = fp8linear.quantize_weight(rand_matrix(n, k, gen, device))
    if per_row:
        # genuinely per-row: every row its own scale, not a block scale repeated
        w_s = (expand_weight_scale(w_s, n)
               * (1 + torch.rand(n, w_s.shape[1], generator=gen, device=device))).contiguous()
    bias = None
    if bias_dtype is not None:
        bias = (torch.randn(n, generator=gen, device=device) * 3).to(bias_dtype)
    return x, w, w_s, bias


def poisoned(m, n, dtype, device):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def ref_weight_only(x, w, w_s, bias):
    """Weight-only mode's definition: x (as given) @ dequantize_weight(w)^T, in fp64."""
    y = x.double() @ ref.dequant(w, w_s).t()
    return y + bias.double() if bias is not None else y


def ref_linear(mode, x, w, w_s, bias):
    """fp8_linear's definition in Triton mode ``mode``: native quantizes x first."""
    if mode == "native":
        a, a_s = fp8linear.quantize_activation(x)
        return ref.gemm(a, a_s, w, w_s, bias)
    return ref_weight_only(x, w, w_s, bias)


def check(got, want, what):
    assert not torch.isnan(got).any(), f"{what}: NaN left in the output"
    err = ref.rel_err(got, want)
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL}"


def rand_dim(rng, hi):
    # N, K never multiples of 128; mostly multiples of 16 as in real models (which also
    # bounds the number of kernel specialisations the test compiles)
    while True:
        v = 16 * rng.randint(1, hi // 16) if rng.random() < 0.85 else rng.randint(1, hi)
        if v % 128:
            return v


def rand_m(rng):
    r = rng.random()
    if r < 0.45:
        return rng.randint(1, 16)
    if r < 0.7:
        return rng.randint(17, 128)
    if r < 0.92:
        return rng.randint(129, 1024)
    return rng.randint(1025, 8192)


# (per-row weight scales, bias dtype, out dtype): four families instead of every product,
# so that the 220 shapes compile a bounded number of kernel variants
FAMILIES = [(False, None, "bf16"), (True, "bf16", "bf16"), (False, "fp32", "fp16"),
            (True, None, "fp32")]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("FP8LINEAR_BACKEND", "triton")
    monkeypatch.delenv("FP8LINEAR_TRITON_MODE", raising=False)
    return monkeypatch


# ------------------------------------------------------------------------- GPU tests
@pytest.mark.gpu
@needs_native
def test_gemm_random_shapes(triton_backend):
    triton_backend.setenv("FP8LINEAR_TRITON_MODE", "native")
    rng = random.Random(1234)
    dev = torch.device("cuda")
    for i in range(220):
        m, n, k = rand_m(rng), rand_dim(rng, 1536), rand_dim(rng, 2048)
        per_row, bias_dt, out_dt = FAMILIES[i % len(FAMILIES)]
        x, w, w_s, bias = make_case(m, n, k, seed=i, device=dev, per_row=per_row,
                                    bias_dtype=DT.get(bias_dt))
        a, a_s = fp8linear.quantize_activation(x)
        out = poisoned(m, n, DT[out_dt], dev)
        ret = fp8linear.block_fp8_gemm(a, a_s, w, w_s, out_dtype=DT[out_dt], out=out, bias=bias)
        assert ret is out
        check(out, ref.gemm(a, a_s, w, w_s, bias), f"gemm #{i} m={m} n={n} k={k} "
              f"per_row={per_row} bias={bias_dt} out={out_dt}")


@pytest.mark.gpu
@needs_native
def test_linear_random_shapes(triton_backend):
    """fp8_linear: fused quantization (M <= 32) and the separate quant kernel (larger M)."""
    triton_backend.setenv("FP8LINEAR_TRITON_MODE", "native")
    rng = random.Random(99)
    dev = torch.device("cuda")
    for i in range(40):
        m = rng.choice([1, 2, 7, 16, 31, 32, 33, 100, 640, 3000])
        n, k = rand_dim(rng, 1536), rand_dim(rng, 2048)
        per_row, bias_dt, x_dt = FAMILIES[i % len(FAMILIES)]
        x, w, w_s, bias = make_case(m, n, k, seed=1000 + i, device=dev, per_row=per_row,
                                    bias_dtype=DT.get(bias_dt))
        x = x.to(DT[x_dt])
        lead = (m,) if i % 3 else (1, m)      # leading dims are flattened by fp8_linear
        y = fp8linear.fp8_linear(x.view(*lead, k), w, w_s, bias)
        assert y.shape == (*lead, n) and y.dtype == x.dtype
        a, a_s = fp8linear.quantize_activation(x)
        check(y.view(m, n), ref.gemm(a, a_s, w, w_s, bias),
              f"linear #{i} m={m} n={n} k={k} x={x_dt} per_row={per_row}")


@pytest.mark.gpu
@needs_native
@pytest.mark.parametrize("round_first", [False, True])
def test_fused_quant_matches_separate(monkeypatch, round_first):
    """The quantization inside the small-M GEMM equals fp8linear.quantize_activation bit for
    bit: with the same tile config, fused and unfused GEMMs give identical fp32 outputs.
    round_first=True runs the explicit-rounding path that sm_89 / ROCm use."""
    monkeypatch.setenv("FP8LINEAR_TRITON_MODE", "native")
    monkeypatch.setattr(tq, "needs_round_first", lambda device: round_first)
    dev = torch.device("cuda")
    for i, (m, n, k) in enumerate([(1, 256, 4096), (16, 1000, 2200), (32, 96, 130)]):
        x, w, w_s, bias = make_case(m, n, k, seed=77 + i, device=dev)
        cfg = tp.choose(m, n, k, 2, False, tp.device_info("cuda", dev.index or 0))
        fused = poisoned(m, n, torch.float32, dev)
        tg.linear(x, w, w_s, bias, fused, config=cfg)
        a, a_s = fp8linear.quantize_activation(x)
        sep = poisoned(m, n, torch.float32, dev)
        tg.gemm(a, a_s, w, w_s, bias, sep, config=cfg)
        assert torch.equal(fused, sep), f"m={m} n={n} k={k}"


@pytest.mark.gpu
@needs_native
@pytest.mark.parametrize("round_first", [False, True])
def test_quant_kernel_bit_exact(round_first):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    for m, k in [(1, 1), (1, 128), (3, 100), (7, 129), (64, 1000), (1500, 4096), (2, 7168)]:
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x = rand_matrix(m, k, gen, dev, spread=6.0).to(dt)
            if k >= 256:
                x[0, 128:256] = 0           # an all-zero group: scale = eps / 448
            q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
            s = torch.empty(m, -(-k // 128), dtype=torch.float32, device=dev)
            tq.launch_quant(x, q, s, round_first=round_first)
            q_ref, s_ref = fp8linear.quantize_activation(x)
            assert torch.equal(s, s_ref), f"scales m={m} k={k} {dt}"
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), \
                f"values m={m} k={k} {dt}: {(q.view(torch.uint8) != q_ref.view(torch.uint8)).sum()} differ"


@pytest.mark.gpu
@needs_native
def test_quant_kernel_nan_propagates():
    # like the reference: a NaN makes its own 128-group NaN, other groups are untouched
    dev = torch.device("cuda")
    x = torch.randn(2, 300, device=dev)
    x[1, 140] = float("nan")
    q, s = tq.quantize_activation(x)
    q_ref, s_ref = fp8linear.quantize_activation(x)
    assert torch.isnan(s[1, 1]) and torch.isnan(q[1, 128:256].float()).all()
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[1, 128:256] = False
    assert torch.equal(q.view(torch.uint8)[keep], q_ref.view(torch.uint8)[keep])


@pytest.mark.gpu
def test_weight_only_random_shapes(triton_backend):
    triton_backend.setenv("FP8LINEAR_TRITON_MODE", "weight_only")
    rng = random.Random(4321)
    dev = torch.device("cuda")
    for i in range(50):
        m, n, k = rand_m(rng), rand_dim(rng, 1536), rand_dim(rng, 2048)
        per_row, bias_dt, dt = FAMILIES[i % len(FAMILIES)]
        x, w, w_s, bias = make_case(m, n, k, seed=5000 + i, device=dev, per_row=per_row,
                                    bias_dtype=DT.get(bias_dt))
        x = x.to(DT[dt])
        what = f"#{i} m={m} n={n} k={k} x={dt} per_row={per_row} bias={bias_dt}"
        y = fp8linear.fp8_linear(x, w, w_s, bias)
        check(y, ref_weight_only(x, w, w_s, bias), "weight-only linear " + what)
        if i % 2 == 0:   # gemm() with pre-quantized activations decodes them too
            a, a_s = fp8linear.quantize_activation(x)
            out = poisoned(m, n, DT[dt], dev)
            fp8linear.block_fp8_gemm(a, a_s, w, w_s, out_dtype=DT[dt], out=out, bias=bias)
            check(out, ref.gemm(a, a_s, w, w_s, bias), "weight-only gemm " + what)


# every tile shape the rules can produce, split-K on and off, the deepest split
C = tp.TritonConfig
FORCED = [C(16, 64, 4, 3, 1), C(16, 64, 4, 2, 16), C(32, 64, 4, 3, 3), C(64, 64, 4, 3, 1),
          C(64, 128, 4, 3, 2), C(128, 128, 8, 3, 1), C(128, 64, 8, 3, 3)]
FORCED_SHAPES = [(1, 200, 1100, False), (45, 130, 640, True), (300, 384, 2000, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["native", "weight_only"])
def test_forced_configs(monkeypatch, mode):
    """Each config on its own shape (rotating), so every kernel variant is exercised
    independently of the rules that pick them."""
    if mode == "native" and not _native_ok():
        pytest.skip("native fp8 mode needs sm_89+")
    monkeypatch.setenv("FP8LINEAR_TRITON_MODE", mode)
    dev = torch.device("cuda")
    for j, cfg in enumerate(FORCED):
        m, n, k, per_row = FORCED_SHAPES[j % len(FORCED_SHAPES)]
        x, w, w_s, bias = make_case(m, n, k, seed=j, device=dev, per_row=per_row,
                                    bias_dtype=torch.bfloat16 if j % 2 else None)
        a, a_s = fp8linear.quantize_activation(x)
        out = poisoned(m, n, torch.bfloat16, dev)
        tg.gemm(a, a_s, w, w_s, bias, out, config=cfg)
        check(out, ref.gemm(a, a_s, w, w_s, bias), f"gemm {cfg} m={m} n={n} k={k}")
        out = poisoned(m, n, torch.bfloat16, dev)
        xb = x.to(torch.bfloat16)
        tg.linear(xb, w, w_s, bias, out, config=cfg)
        check(out, ref_linear(mode, xb, w, w_s, bias), f"linear {cfg} m={m} n={n} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["native", "weight_only"])
def test_real_shapes(monkeypatch, mode):
    if mode == "native" and not _native_ok():
        pytest.skip("native fp8 mode needs sm_89+")
    monkeypatch.setenv("FP8LINEAR_TRITON_MODE", mode)
    dev = torch.device("cuda")
    for n, k in [(4096, 4096), (28672, 4096), (7168, 2048)]:
        for m in (1, 16, 128, 4096):
            x, w, w_s, _ = make_case(m, n, k, seed=m + n, device=dev)
            x = x.to(torch.bfloat16)
            out = poisoned(m, n, torch.bfloat16, dev)
            tg.linear(x, w, w_s, None, out)
            check(out, ref_linear(mode, x, w, w_s, None), f"{mode} m={m} n={n} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["native", "weight_only"])
def test_deterministic(monkeypatch, mode):
    """20 runs give identical bits, split-K included (ordered reduction, no atomics)."""
    if mode == "native" and not _native_ok():
        pytest.skip("native fp8 mode needs sm_89+")
    monkeypatch.setenv("FP8LINEAR_TRITON_MODE", mode)
    dev = torch.device("cuda")
    for m, n, k in [(1, 4096, 4096), (16, 1024, 7168), (64, 2048, 4096), (2048, 1024, 1024)]:
        x, w, w_s, bias = make_case(m, n, k, seed=3, device=dev, bias_dtype=torch.bfloat16)
        x = x.to(torch.bfloat16)
        a, a_s = fp8linear.quantize_activation(x)
        if m <= 16:
            assert tg._plan("cuda", dev.index or 0, m, n, k, 1, mode == "weight_only").split > 1
        first_l = first_g = None
        for _ in range(20):
            yl = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            tg.linear(x, w, w_s, bias, yl)
            yg = torch.empty(m, n, dtype=torch.float32, device=dev)
            tg.gemm(a, a_s, w, w_s, bias, yg)
            if first_l is None:
                first_l, first_g = yl, yg
            assert torch.equal(yl.view(torch.int16), first_l.view(torch.int16)), (m, n, k)
            assert torch.equal(yg.view(torch.int32), first_g.view(torch.int32)), (m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["native", "weight_only"])
def test_cuda_graph_capture(triton_backend, mode):
    if mode == "native" and not _native_ok():
        pytest.skip("native fp8 mode needs sm_89+")
    triton_backend.setenv("FP8LINEAR_TRITON_MODE", mode)
    dev = torch.device("cuda")
    n, k = 1024, 4096
    _, w, w_s, bias = make_case(1, n, k, seed=11, device=dev, bias_dtype=torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(12)
    # M=1 and 4: fused quant + split-K; M=200: separate quant kernel, one pass
    for m in (1, 4, 200):
        static_x = rand_matrix(m, k, gen, dev).to(torch.bfloat16)
        static_a, static_as = fp8linear.quantize_activation(static_x)
        static_out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)

        def step():
            y = fp8linear.fp8_linear(static_x, w, w_s, bias)
            fp8linear.block_fp8_gemm(static_a, static_as, w, w_s, out=static_out, bias=bias)
            return y

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):           # compile and warm up outside the capture
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = step()
        for trial in range(3):
            x_new = rand_matrix(m, k, gen, dev).to(torch.bfloat16)
            static_x.copy_(x_new)
            a_new, as_new = fp8linear.quantize_activation(x_new)
            static_a.copy_(a_new)
            static_as.copy_(as_new)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, fp8linear.fp8_linear(x_new, w, w_s, bias)), (m, trial)
            assert torch.equal(static_out,
                               fp8linear.block_fp8_gemm(a_new, as_new, w, w_s, bias=bias))


# ------------------------------------------------------------------------- CPU tests
def test_mode_env_is_validated(monkeypatch):
    monkeypatch.setenv("FP8LINEAR_TRITON_MODE", "fp4")
    with pytest.raises(ValueError, match=r"^FP8LINEAR_TRITON_MODE='fp4': expected one of "
                                         r"native, weight_only$"):
        tg.mode(torch.device("cpu"))
    monkeypatch.setenv("FP8LINEAR_TRITON_MODE", "weight_only")
    assert tg.mode(torch.device("cpu")) == "weight_only"


@pytest.mark.parametrize("dev", [tp.TritonDevice(132, 227 * 1024, False, (9, 0)),   # H100
                                 tp.TritonDevice(128, 99 * 1024, False, (8, 9)),    # RTX 4090
                                 tp.TritonDevice(108, 163 * 1024, False, (8, 0))])  # A100
def test_plan_rules(dev):
    rng = random.Random(0)
    for _ in range(500):
        m, n, k = rng.randint(1, 9000), rng.randint(1, 30000), rng.randint(1, 20000)
        for weight_only, a_bytes in ((False, 1), (False, 2), (True, 2), (True, 4)):
            cfg = tp.choose(m, n, k, a_bytes, weight_only, dev)
            assert cfg.bn in (64, 128, 256) and cfg.bm in (16, 32, 64, 128) and cfg.stages >= 2
            stage = cfg.bm * 128 * a_bytes + 128 * cfg.bn
            assert (cfg.stages - 1) * stage <= dev.smem, cfg      # pipelined buffers fit
            tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
            if cfg.split > 1:
                assert tiles < dev.sms, "split-K only when the tiles leave SMs idle"
                # fp32 workspace round trip stays under a quarter of the weight bytes
                assert 2 * cfg.split * m * n * 4 <= n * k / 4, (m, n, k, cfg)
                assert -(-k // 128) >= 4 * cfg.split, "at least 4 K-blocks per split"
    # the plan's splits are all non-empty and cover K
    for m, n, k in [(1, 4096, 4096), (1, 256, 7168), (3, 100, 1000), (16, 512, 129)]:
        p = tg._plan("cpu", 0, m, n, k, 1, False)
        kb = -(-k // 128)
        assert (p.split - 1) * p.kb_per_split < kb <= p.split * p.kb_per_split
        assert p.grid == (-(-m // p.cfg.bm) * -(-n // p.cfg.bn), p.split)
    assert tg._plan("cpu", 0, 1, 4096, 4096, 1, False).split > 1       # decode splits K
    assert tg._plan("cpu", 0, 4096, 4096, 4096, 1, False).split == 1   # prefill does not


# (target, A kind, weight as bits, activation type, out type, BM, BN, warps, stages)
_TARGETS = [
    ("cuda", 80, tg.A_FLOAT, True, "*bf16", "*bf16", 128, 128, 8, 3),      # Ampere linear
    ("cuda", 80, tg.A_FLOAT, True, "*fp32", "*fp32", 16, 64, 4, 3),
    ("cuda", 86, tg.A_FP8_BITS, True, "*u8", "*fp16", 64, 64, 4, 3),       # Ampere gemm
    ("cuda", 89, tg.A_FP8, False, "*fp8e4nv", "*bf16", 128, 128, 8, 3),   # Ada
    ("cuda", 89, tg.A_QUANT, False, "*bf16", "*bf16", 16, 64, 4, 4),
    ("cuda", 90, tg.A_FP8, False, "*fp8e4nv", "*bf16", 128, 128, 8, 4),   # Hopper
    ("cuda", 90, tg.A_QUANT, False, "*fp16", "*fp16", 32, 64, 4, 6),
    ("cuda", 90, tg.A_FP8, False, "*fp8e4nv", "*bf16", 16, 256, 8, 3),    # wide decode tile
    ("cuda", 100, tg.A_FP8, False, "*fp8e4nv", "*bf16", 128, 128, 8, 4),  # Blackwell
    ("hip", "gfx942", tg.A_FLOAT, True, "*bf16", "*bf16", 64, 64, 4, 2),   # MI300
    ("hip", "gfx950", tg.A_FP8, False, "*fp8e4nv", "*bf16", 128, 128, 8, 2),
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreting")
@pytest.mark.parametrize("target", _TARGETS, ids=lambda t: f"{t[0]}-{t[1]}-kind{t[2]}")
def test_compiles_for_target(target):
    """Ahead-of-time compile for GPUs this project cannot run (Ada, Blackwell, Ampere, ROCm):
    catches unsupported ops per architecture (e.g. fp8 types below sm_89) without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, a_kind, w_bits, a_ty, out_ty, bm, bn, warps, stages = target
    sig = {"a_ptr": a_ty, "as_ptr": "*fp32", "w_ptr": "*u8" if w_bits else "*fp8e4nv",
           "ws_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": out_ty, "part_ptr": "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "KB": "i32", "KB_PER_SPLIT": "i32"}
    const = dict(A_KIND=a_kind, W_BITS=w_bits, SCALE_ROWS=128, HAS_BIAS=True, SPLIT=False,
                 EVEN_K=False, BM=bm, BN=bn, GROUP_M=8,
                 DOT_PREC="ieee" if backend == "hip" else "tf32x3", UNSCALE=256.0,
                 FP8_MAX_C=448.0, EPS=1e-10, ROUND_FIRST=a_kind == tg.A_QUANT)
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)}
    warp = 64 if backend == "hip" else 32
    ck = triton.compile(ASTSource(tg._gemm_kernel, sig, constexprs=const, attrs=attrs),
                        target=GPUTarget(backend, arch, warp),
                        options={"num_warps": warps, "num_stages": stages})
    binary = ck.asm.get("cubin") or ck.asm.get("hsaco")
    assert binary, f"no binary produced for {backend} {arch}"
    assert ck.metadata.shared <= (227 if arch in (90, 100) else 99) * 1024 or backend == "hip"


@pytest.mark.skipif(triton_interpreter.interpreting(), reason="already interpreting")
def test_interpreter():
    """The quant and GEMM kernels on the CPU through Triton's interpreter (a subprocess:
    TRITON_INTERPRET must be set before the kernels are defined)."""
    triton_interpreter.run(__file__)


# ------------------------------------------------- the interpreter run (this file as a script)
def _interpreter_main():
    triton_interpreter.start()   # (knobs read afresh: the loop switches FP8LINEAR_TRITON_MODE)
    cpu = torch.device("cpu")
    n_checks = 0

    # activation quantization: bit-exact against quant.py, both rounding paths, every input
    # dtype
    gen = torch.Generator().manual_seed(0)
    for (m, k), dt in zip([(1, 1), (3, 100), (5, 300), (2, 1100), (4, 256)],
                          ["fp32", "bf16", "fp16", "fp32", "bf16"]):
        x = rand_matrix(m, k, gen, cpu, spread=6.0).to(DT[dt])
        if k >= 256:
            x[0, 128:256] = 0
        q_ref, s_ref = fp8linear.quantize_activation(x)
        for round_first in (False, True):
            q = torch.empty_like(q_ref)
            s = torch.empty_like(s_ref)
            tq.launch_quant(x, q, s, round_first=round_first)
            what = (m, k, dt, round_first)
            assert torch.equal(s, s_ref), what
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), what
            n_checks += 1

    cases = [  # m, n, k, per_row, bias, out, forced config
        (3, 130, 260, False, None, "bf16", None),
        (1, 200, 1100, True, "bf16", "fp32", None),                  # split-K by the rules
        (40, 70, 300, True, "fp32", "fp16", None),                   # M > 32: quant kernel
        (2, 256, 1100, False, "fp32", "fp32", tp.TritonConfig(16, 64, 4, 2, 3)),
        (17, 100, 129, True, "bf16", "fp32", tp.TritonConfig(32, 64, 4, 2, 2)),
        (130, 64, 200, False, None, "bf16", tp.TritonConfig(128, 64, 8, 2, 1)),
        # 256-column tiles over 128x128 scale blocks: each column gathers its block's scale
        (1, 300, 520, False, "bf16", "bf16", tp.TritonConfig(16, 256, 8, 3, 1)),
        (5, 520, 300, True, None, "fp32", tp.TritonConfig(16, 256, 8, 2, 2)),
    ]
    for i, (m, n, k, per_row, bias_dt, out_dt, cfg) in enumerate(cases):
        x, w, w_s, bias = make_case(m, n, k, seed=i, device=cpu, per_row=per_row,
                                    bias_dtype=DT.get(bias_dt))
        od = DT[out_dt]
        for mode in ("native", "weight_only"):
            os.environ["FP8LINEAR_TRITON_MODE"] = mode
            a, a_s = fp8linear.quantize_activation(x)
            out = poisoned(m, n, od, cpu)
            tg.gemm(a, a_s, w, w_s, bias, out, config=cfg)
            check(out, ref.gemm(a, a_s, w, w_s, bias), f"{mode} gemm case {i}")
            xo = x.to(od)
            y = poisoned(m, n, od, cpu)
            tg.linear(xo, w, w_s, bias, y, config=cfg)
            if mode == "native":
                qa, qs = fp8linear.quantize_activation(xo)
                check(y, ref.gemm(qa, qs, w, w_s, bias), f"native linear case {i}")
                # fused quantization == separate quantization, bit for bit
                y2 = poisoned(m, n, od, cpu)
                tg.gemm(qa, qs, w, w_s, bias, y2, config=cfg or tg._plan(
                    "cpu", 0, m, n, k, xo.element_size(), False).cfg)
                assert torch.equal(y, y2), f"fused vs separate quant, case {i}"
            else:
                check(y, ref_weight_only(xo, w, w_s, bias), f"weight-only linear case {i}")
            n_checks += 1
    os.environ.pop("FP8LINEAR_TRITON_MODE", None)
    triton_interpreter.passed(n_checks)


if __name__ == "__main__":
    _interpreter_main()
