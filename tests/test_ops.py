"""block_fp8_gemm / fp8_linear on the CPU (reference backend) against the fp64 reference,
every ValueError with its message, the custom ops' fake impls, and torch.compile."""
import math
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp64_reference as ref
import fp8linear
from fp8linear.quant import expand_weight_scale

TOL = 2e-3  # relative Frobenius error against the fp64 reference on dequantized inputs
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_operands(m, n, k, seed, per_row=False, bias_dtype=None):
    g = torch.Generator().manual_seed(seed)
    a, a_s = fp8linear.quantize_activation(ref.random_matrix(m, k, g, spread=2.0))
    w, w_s = fp8linear.quantize_weight(ref.random_matrix(n, k, g, spread=2.0))
    if per_row:
        # genuinely per-row: each row its own scale, not a block scale repeated
        w_s = expand_weight_scale(w_s, n) * (1 + torch.rand(n, w_s.shape[1], generator=g))
    bias = None
    if bias_dtype is not None:
        bias = (torch.randn(n, generator=g) * 3).to(bias_dtype)
    return a, a_s, w, w_s.contiguous(), bias


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor):
    """got (in its dtype) against the fp64 reference: rel Frobenius error <= 2e-3 once the
    reference is rounded to the output dtype (the kernels round once, at the end); against
    the unrounded reference the output rounding may add up to half an ulp (a bf16 result
    of a few elements can be 3.9e-3 off by rounding alone)."""
    assert not torch.isnan(got).any()
    assert ref.rel_err(got, want.to(got.dtype)) <= TOL
    assert ref.rel_err(got, want) <= TOL + ref.UNIT_ROUNDOFF[got.dtype]


def poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), dtype=dtype)


SHAPES = [(1, 1, 1), (1, 128, 128), (1, 200, 300), (3, 257, 129), (17, 64, 1000),
          (64, 384, 384), (5, 7, 130), (130, 96, 520)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_gemm_matches_fp64_reference(m, n, k, per_row, out_dtype):
    bias_dtype = [None, torch.bfloat16, torch.float32][zlib.crc32(repr((m, n, k)).encode()) % 3]
    a, a_s, w, w_s, bias = make_operands(m, n, k, seed=m * 7919 + n * 31 + k,
                                         per_row=per_row, bias_dtype=bias_dtype)
    want = ref.gemm(a, a_s, w, w_s, bias)
    got = fp8linear.block_fp8_gemm(a, a_s, w, w_s, out_dtype=out_dtype, bias=bias)
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert_close_to_reference(got, want)

    out = poisoned(m, n, out_dtype)
    ret = fp8linear.block_fp8_gemm(a, a_s, w, w_s, out_dtype=out_dtype, out=out, bias=bias)
    assert ret is out and not torch.isnan(out).any()
    assert torch.equal(out, got)


# shapes up to M = 300 and K = 2048 (16 K blocks); the number of examples and the seed come
# from the Hypothesis profile (tests/conftest.py)
@given(m=st.integers(1, 300), n=st.integers(1, 300), k=st.integers(1, 2048),
       seed=st.integers(0, 2**31 - 1), per_row=st.booleans(), bias=st.booleans(),
       out_dtype=st.sampled_from(OUT_DTYPES))
def test_gemm_random_shapes(m, n, k, seed, per_row, bias, out_dtype):
    a, a_s, w, w_s, b = make_operands(m, n, k, seed, per_row, torch.bfloat16 if bias else None)
    out = poisoned(m, n, out_dtype)
    fp8linear.block_fp8_gemm(a, a_s, w, w_s, out_dtype=out_dtype, out=out, bias=b)
    assert_close_to_reference(out, ref.gemm(a, a_s, w, w_s, b))


def test_per_row_scales_equal_expanded_block_scales():
    a, a_s, w, w_s, _ = make_operands(9, 300, 260, seed=11)
    # each row's block scale, expanded here (not by the library's expand_weight_scale)
    rows_s = w_s.repeat_interleave(128, dim=0)[:300].contiguous()
    block = fp8linear.block_fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32)
    rows = fp8linear.block_fp8_gemm(a, a_s, w, rows_s, out_dtype=torch.float32)
    # both against the independent fp64 reference (on the CPU both run reference_gemm)
    want = ref.gemm(a, a_s, w, w_s)
    assert_close_to_reference(block, want)
    assert_close_to_reference(rows, want)
    assert torch.equal(block, rows)


@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3), (2, 1, 4)])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_fp8_linear_matches_reference(lead, dtype):
    n, k = 200, 300
    g = torch.Generator().manual_seed(zlib.crc32(repr((lead, dtype)).encode()))
    x = ref.random_matrix(math.prod(lead), k, g, spread=1.0).to(dtype).reshape(*lead, k)
    w, w_s = fp8linear.quantize_weight(ref.random_matrix(n, k, g))
    bias = torch.randn(n, generator=g).to(dtype)
    y = fp8linear.fp8_linear(x, w, w_s, bias)
    assert y.shape == (*lead, n) and y.dtype == dtype and not torch.isnan(y).any()
    # exact definition: quantize x per token per 128 channels, then the block GEMM
    xq, xs = fp8linear.quantize_activation(x.reshape(-1, k))
    assert_close_to_reference(y.reshape(-1, n), ref.gemm(xq, xs, w, w_s, bias))
    # and the end-to-end error against unquantized activations stays at e4m3 precision
    full = x.double() @ ref.dequant(w, w_s).t() + bias.double()
    assert ref.rel_err(y, full) <= 0.05


def test_fp8_linear_non_contiguous_input():
    g = torch.Generator().manual_seed(3)
    x = ref.random_matrix(300, 8, g).t()  # [8, 300], strided
    w, w_s = fp8linear.quantize_weight(ref.random_matrix(64, 300, g))
    assert not x.is_contiguous()
    assert torch.equal(fp8linear.fp8_linear(x, w, w_s), fp8linear.fp8_linear(x.contiguous(), w, w_s))


def test_column_major_activation_scales_give_the_same_result():
    # vLLM's and DeepGEMM's layout: [M, Kb] with strides (1, ld), ld >= M
    g = torch.Generator().manual_seed(6)
    x = ref.random_matrix(5, 300, g)
    a, a_s = fp8linear.quantize_activation(x)
    col = torch.empty(a_s.shape[1], 8)[:, :5].copy_(a_s.t()).t()
    assert col.stride() == (1, 8)
    w, w_s = fp8linear.quantize_weight(ref.random_matrix(64, 300, g))
    got = fp8linear.block_fp8_gemm(a, col, w, w_s, out_dtype=torch.float32)
    # against the fp64 reference on the row-major scales (on the CPU both layouts run
    # reference_gemm: equal outputs alone would not show that either is right)
    assert_close_to_reference(got, ref.gemm(a, a_s, w, w_s))
    assert torch.equal(got, fp8linear.block_fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32))


def test_empty_batch_gives_empty_output_without_a_launch(monkeypatch):
    from fp8linear.backends import dispatch

    def no_launch(*args):
        raise AssertionError("a backend was asked to run an empty batch")
    monkeypatch.setattr(dispatch, "backend_for", no_launch)
    g = torch.Generator().manual_seed(4)
    w, w_s = fp8linear.quantize_weight(ref.random_matrix(64, 256, g))
    y = fp8linear.fp8_linear(torch.empty(2, 0, 256, dtype=torch.bfloat16), w, w_s)
    assert y.shape == (2, 0, 64) and y.dtype == torch.bfloat16
    a = torch.empty(0, 256, dtype=torch.float8_e4m3fn)
    a_s = torch.empty(0, 2)
    assert fp8linear.block_fp8_gemm(a, a_s, w, w_s).shape == (0, 64)
    out = torch.empty(0, 64, dtype=torch.bfloat16)
    assert fp8linear.block_fp8_gemm(a, a_s, w, w_s, out=out) is out


# ---------------------------------------------------------------------- error paths
def _good(m=4, n=200, k=300):
    return make_operands(m, n, k, seed=5, bias_dtype=torch.bfloat16)


def _noncontig(t):
    return t.t().contiguous().t() if t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 else t


GEMM_ERRORS = [
    ("w", lambda a, s, w, ws, b: torch.randn(200, 300).to(torch.float8_e4m3fn)[None],
     r"weight must be a 2-D \[N, K\] tensor, got \(1, 200, 300\)"),
    ("w", lambda a, s, w, ws, b: w.to(torch.bfloat16), "weight must be torch.float8_e4m3fn, "
                                                         "got torch.bfloat16"),
    ("w", lambda a, s, w, ws, b: _noncontig(w), r"weight must be contiguous \(row-major\)"),
    ("ws", lambda a, s, w, ws, b: ws[:, :2].contiguous(),
     r"weight_scale_inv has shape \(2, 2\) but weight is \[200, 300\]: expected \(2, 3\) "
     r"for 128x128 blocks or \(200, 3\) per row"),
    ("ws", lambda a, s, w, ws, b: ws.double(), "weight_scale_inv must be torch.float32, "
                                               "got torch.float64"),
    ("ws", lambda a, s, w, ws, b: ws.flatten(), "weight_scale_inv must be a 2-D fp32 tensor"),
    ("ws", lambda a, s, w, ws, b: _noncontig(torch.ones(200, 3)),
     "weight_scale_inv must be contiguous"),
    ("ws", lambda a, s, w, ws, b: ws.to("meta"), "weight_scale_inv is on meta but weight "
                                                 "is on cpu"),
    ("a", lambda a, s, w, ws, b: a[None], r"a \(activations\) must be a 2-D \[M, 300\]"),
    ("a", lambda a, s, w, ws, b: a.float(), r"a \(activations\) must be torch.float8_e4m3fn, "
                                            r"got torch.float32"),
    ("a", lambda a, s, w, ws, b: a[:, :256].contiguous(),
     r"a \(activations\) must have shape \(4, 300\), got \(4, 256\)"),
    ("a", lambda a, s, w, ws, b: a.t().contiguous().t(),
     r"a \(activations\) must be contiguous"),
    ("s", lambda a, s, w, ws, b: s[:, :2].contiguous(),
     r"a_scale must have shape \(4, 3\), got \(4, 2\)"),
    ("s", lambda a, s, w, ws, b: s.half(), "a_scale must be torch.float32, got torch.float16"),
    ("s", lambda a, s, w, ws, b: torch.ones(4, 6)[:, ::2],
     r"a_scale must be row-major, or column-major \(strides \(1, ld\) with ld >= 4\), got "
     r"strides \(6, 2\)"),
    ("a", lambda a, s, w, ws, b: a.to("meta"), r"a \(activations\) is on meta but the weight "
                                               r"is on cpu"),
    ("b", lambda a, s, w, ws, b: b[:100], r"bias must have shape \(200,\), got \(100,\)"),
    ("b", lambda a, s, w, ws, b: b.to(torch.int32), "bias must be bf16/fp16/fp32, got "
                                                    "torch.int32"),
    ("b", lambda a, s, w, ws, b: torch.randn(400)[::2], "bias must be contiguous"),
    ("b", lambda a, s, w, ws, b: b.to("meta"), "bias is on meta but the weight is on cpu"),
]


@pytest.mark.parametrize("which,make,msg", GEMM_ERRORS)
def test_gemm_errors(which, make, msg):
    a, s, w, ws, b = _good()
    args = {"a": a, "s": s, "w": w, "ws": ws, "b": b}
    args[which] = make(a, s, w, ws, b)
    with pytest.raises(ValueError, match=msg):
        fp8linear.block_fp8_gemm(args["a"], args["s"], args["w"], args["ws"],
                                 bias=args["b"])


def test_gemm_out_errors():
    a, s, w, ws, _ = _good()
    with pytest.raises(ValueError, match=r"out_dtype must be one of bf16/fp16/fp32, got "
                                         r"torch.int8"):
        fp8linear.block_fp8_gemm(a, s, w, ws, out_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 200\), got \(4, 199\)"):
        fp8linear.block_fp8_gemm(a, s, w, ws, out=torch.empty(4, 199, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be torch.bfloat16, got torch.float32"):
        fp8linear.block_fp8_gemm(a, s, w, ws, out=torch.empty(4, 200))
    with pytest.raises(ValueError, match="out must be contiguous"):
        fp8linear.block_fp8_gemm(a, s, w, ws, out=torch.empty(200, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="out is on meta but the weight is on cpu"):
        fp8linear.block_fp8_gemm(a, s, w, ws, out=torch.empty(4, 200, dtype=torch.bfloat16,
                                                              device="meta"))


def test_fp8_linear_errors():
    _, _, w, ws, b = _good()
    x = torch.randn(2, 300)
    with pytest.raises(ValueError, match=r"x must have last dimension 300 \(the weight is "
                                         r"\[200, 300\]\), got \(2, 299\)"):
        fp8linear.fp8_linear(torch.randn(2, 299), w, ws)
    with pytest.raises(ValueError, match="x must be bf16/fp16/fp32, got torch.float64"):
        fp8linear.fp8_linear(x.double(), w, ws)
    with pytest.raises(ValueError, match="x must be bf16/fp16/fp32, got torch.float8_e4m3fn"):
        fp8linear.fp8_linear(x.to(torch.float8_e4m3fn), w, ws)
    with pytest.raises(ValueError, match="x is on meta but the weight is on cpu"):
        fp8linear.fp8_linear(x.to("meta"), w, ws)
    with pytest.raises(ValueError, match=r"bias must have shape \(200,\), got \(3,\)"):
        fp8linear.fp8_linear(x, w, ws, torch.randn(3))
    with pytest.raises(ValueError, match="weight must be torch.float8_e4m3fn"):
        fp8linear.fp8_linear(x, w.float(), ws)


def test_backend_env_is_checked(monkeypatch):
    a, s, w, ws, _ = _good()
    monkeypatch.setenv("FP8LINEAR_BACKEND", "cublas")
    with pytest.raises(ValueError, match=r"FP8LINEAR_BACKEND='cublas': expected one of "
                                         r"reference, triton, sm90"):
        fp8linear.block_fp8_gemm(a, s, w, ws)


def test_forcing_a_gpu_backend_on_cpu_warns_and_uses_the_reference(monkeypatch):
    a, s, w, ws, _ = _good()
    want = fp8linear.block_fp8_gemm(a, s, w, ws)
    monkeypatch.setenv("FP8LINEAR_BACKEND", "triton")
    with pytest.warns(UserWarning, match="FP8LINEAR_BACKEND=triton ignored for a cpu tensor"):
        got = fp8linear.block_fp8_gemm(a, s, w, ws)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------- custom ops
def test_custom_ops_fake_impls_give_shapes_and_dtypes():
    m, n, k = 5, 200, 300
    meta = dict(device="meta")
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, **meta)
    s = torch.empty(m, 3, **meta)
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn, **meta)
    ws = torch.empty(2, 3, **meta)
    for dt in OUT_DTYPES:
        c = torch.ops.fp8linear.block_fp8_gemm(a, s, w, ws, None, dt)
        assert c.shape == (m, n) and c.dtype == dt and c.device.type == "meta"
        y = torch.ops.fp8linear.fp8_linear(torch.empty(m, k, dtype=dt, **meta), w, ws, None)
        assert y.shape == (m, n) and y.dtype == dt


def test_custom_ops_pass_opcheck():
    a, s, w, ws, b = _good(m=3, n=136, k=200)
    x = torch.randn(3, 200, dtype=torch.bfloat16)
    # test_schema is left out: its mutation check multiplies the inputs, which torch does
    # not implement for float8 on the CPU
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fp8linear.block_fp8_gemm.default,
                          (a, s, w, ws, b, torch.bfloat16), test_utils=utils)
    torch.library.opcheck(torch.ops.fp8linear.fp8_linear.default, (x, w, ws, b),
                          test_utils=utils)


def test_torch_compile_fullgraph_matches_eager():
    g = torch.Generator().manual_seed(8)
    w, ws = fp8linear.quantize_weight(ref.random_matrix(136, 200, g))
    bias = torch.randn(136, generator=g).to(torch.bfloat16)

    def f(x):
        return torch.relu(fp8linear.fp8_linear(x, w, ws, bias)) * 2

    compiled = torch.compile(f, fullgraph=True)
    for lead in [(3,), (2, 5)]:
        x = ref.random_matrix(math.prod(lead), 200, g).to(torch.bfloat16).reshape(*lead, 200)
        assert torch.equal(compiled(x), f(x))


def test_shape_errors_say_what_they_got():
    w = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"a \(activations\) must be a 2-D \[M, 256\] "
                                         r"float8_e4m3fn tensor, got shape \(3, 4, 256\)"):
        fp8linear.block_fp8_gemm(torch.zeros(3, 4, 256).to(torch.float8_e4m3fn),
                                 torch.ones(3, 2), w, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"weight_scale_inv must be a 2-D fp32 tensor of shape "
                                         r"\(2, 2\) .* got shape \(2,\)"):
        fp8linear.block_fp8_gemm(torch.zeros(3, 256).to(torch.float8_e4m3fn),
                                 torch.ones(3, 2), w, torch.ones(2))
