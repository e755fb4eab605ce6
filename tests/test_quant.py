"""fp8linear.quant against the independent fp64 formulation in fp64_reference.py."""
import math
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp64_reference as ref
import fp8linear
from fp8linear.quant import AMAX_EPS, FP8_MAX, expand_weight_scale, has_row_scales

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _seed(*params) -> int:
    # stable across processes (hash() of a str is salted per process)
    return zlib.crc32(repr(params).encode())


def assert_fp8_matches(q: torch.Tensor, x: torch.Tensor, scale_per_elem: torch.Tensor):
    """q must be e4m3_round(fl32(x / scale)): the quotient is rounded to fp32 first, as the
    kernels compute it (an fp64 quotient of fp32 values rounded to fp32 is the correctly
    rounded fp32 quotient). bf16 inputs put many quotients exactly on e4m3 ties, so this
    intermediate rounding is part of the definition."""
    quotient = (x.double() / scale_per_elem).float().double()
    want = ref.e4m3_round(quotient.clamp(-FP8_MAX, FP8_MAX))
    got = q.double()
    diff = got != want
    assert not diff.any(), (f"{int(diff.sum())} of {diff.numel()} values differ, first at "
                            f"{diff.nonzero()[0].tolist()}")


def check_weight(w: torch.Tensor, ue8m0: bool):
    q, s = fp8linear.quantize_weight(w, ue8m0=ue8m0)
    n, k = w.shape
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert s.dtype == torch.float32 and s.shape == (math.ceil(n / 128), math.ceil(k / 128))
    ideal = ref.weight_scales(w, ue8m0)
    if ue8m0:
        assert torch.equal(s.double(), ideal)
    else:  # the library's scale is amax / 448 rounded to fp32
        torch.testing.assert_close(s.double(), ideal, rtol=2.0 ** -23, atol=0)
    assert_fp8_matches(q, w, ref.per_element(s, n, k))
    return q, s


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (200, 300), (129, 257), (384, 100),
                                   (7, 1000)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_weight_matches_fp64_definition(shape, dtype, ue8m0):
    w = ref.random_matrix(*shape, _gen(_seed(shape, dtype, ue8m0)), dtype)
    q, s = check_weight(w, ue8m0)
    # dequantize_weight is the exact product of the two
    torch.testing.assert_close(fp8linear.dequantize_weight(q, s, torch.float64),
                               ref.dequant(q, s), rtol=2.0 ** -23, atol=0)


# shapes up to 2048 (16 blocks a side); examples and seed: the Hypothesis profile
# (tests/conftest.py)
@given(n=st.integers(1, 2048), k=st.integers(1, 2048), seed=st.integers(0, 2**31 - 1),
       ue8m0=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_weight_random_shapes(n, k, seed, ue8m0, dtype):
    check_weight(ref.random_matrix(n, k, _gen(seed), dtype), ue8m0)


def test_edge_blocks_use_their_partial_region():
    g = _gen(1)
    w = torch.randn(130, 260, generator=g) * 100
    w[128:, 256:] = torch.randn(2, 4, generator=g) * 1e-3  # the small corner block
    _, s = fp8linear.quantize_weight(w)
    corner = w[128:, 256:].abs().max()
    assert s.shape == (2, 3)
    assert s[1, 2] == (corner / 448).float()
    # a 128-row block must not see the rows below it, nor a K block the columns beyond it
    assert s[0, 2] == (w[:128, 256:].abs().max() / 448).float()
    assert s[1, 0] == (w[128:, :128].abs().max() / 448).float()


def test_ue8m0_scales_are_powers_of_two_that_cover_amax():
    w = ref.random_matrix(300, 500, _gen(2))
    _, s = fp8linear.quantize_weight(w, ue8m0=True)
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all()
    amax = ref.weight_scales(w) * 448  # fp64 amax per block
    assert (s.double() * 448 >= amax).all() and (s.double() * 224 < amax).all()


def test_all_zero_block_gets_eps_scale_and_zero_values():
    w = ref.random_matrix(256, 256, _gen(3))
    w[:128, 128:] = 0
    q, s = fp8linear.quantize_weight(w)
    assert s[0, 1] == torch.tensor(AMAX_EPS / 448, dtype=torch.float32)
    assert (q[:128, 128:].float() == 0).all()
    assert (fp8linear.dequantize_weight(q, s)[:128, 128:] == 0).all()


def test_dequantized_weight_error_is_within_half_an_e4m3_step():
    w = ref.random_matrix(256, 384, _gen(4), torch.float32)
    q, s = fp8linear.quantize_weight(w)
    err = (fp8linear.dequantize_weight(q, s, torch.float64) - w.double()).abs()
    per = ref.per_element(s, *w.shape)
    # relative 2^-4 for normal values, absolute half the subnormal spacing 2^-10 otherwise
    bound = torch.maximum(w.double().abs() * 2.0 ** -4, per * 2.0 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()


def test_dequantize_per_row_scales_equals_block_scales_expanded():
    w = ref.random_matrix(200, 300, _gen(5))
    q, s = fp8linear.quantize_weight(w)
    rows = expand_weight_scale(s, 200)
    assert rows.shape == (200, 3)
    assert torch.equal(fp8linear.dequantize_weight(q, rows), fp8linear.dequantize_weight(q, s))
    torch.testing.assert_close(fp8linear.dequantize_weight(q, rows, torch.float64),
                               ref.dequant(q, rows), rtol=2.0 ** -23, atol=0)


def check_activation(x: torch.Tensor, ue8m0: bool):
    q, s = fp8linear.quantize_activation(x, ue8m0=ue8m0)
    kb = math.ceil(x.shape[-1] / 128)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (*x.shape[:-1], kb) and s.dtype == torch.float32
    ideal = ref.activation_scales(x, ue8m0)
    if ue8m0:
        assert torch.equal(s.double(), ideal)
    else:
        torch.testing.assert_close(s.double(), ideal, rtol=2.0 ** -23, atol=0)
    x2, s2 = x.reshape(-1, x.shape[-1]), s.reshape(-1, kb)
    assert_fp8_matches(q.reshape(x2.shape), x2, ref.per_element(s2, *x2.shape))
    torch.testing.assert_close(fp8linear.dequantize_activation(q, s, torch.float64),
                               ref.dequant(q, s), rtol=2.0 ** -23, atol=0)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 128), (2, 5, 300), (4, 1, 2, 129)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_activation_matches_fp64_definition(shape, dtype, ue8m0):
    g = _gen(_seed(shape, dtype, ue8m0))
    x = ref.random_matrix(math.prod(shape[:-1]), shape[-1], g, dtype).reshape(shape)
    check_activation(x, ue8m0)


@given(m=st.integers(1, 300), k=st.integers(1, 2048), seed=st.integers(0, 2**31 - 1),
       ue8m0=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_activation_random_shapes(m, k, seed, ue8m0, dtype):
    check_activation(ref.random_matrix(m, k, _gen(seed), dtype), ue8m0)


def test_activation_all_zero_token_is_finite():
    x = ref.random_matrix(3, 256, _gen(6))
    x[1] = 0
    q, s = fp8linear.quantize_activation(x)
    assert torch.isfinite(s).all() and s[1].eq(AMAX_EPS / 448).all()
    assert (q[1].float() == 0).all()


@pytest.mark.parametrize("fn,kw,msg", [
    (fp8linear.quantize_weight, {"block": 64}, "unsupported block size 64: fp8linear "
                                               "supports only 128"),
    (fp8linear.quantize_weight, {"block": (128, 64)}, r"unsupported block size \[128, 64\]"),
    (fp8linear.quantize_activation, {"group": 256}, "unsupported group size 256"),
])
def test_block_sizes_other_than_128_are_refused(fn, kw, msg):
    with pytest.raises(ValueError, match=msg):
        fn(torch.randn(128, 128), **kw)


def test_weight_input_errors():
    with pytest.raises(ValueError, match=r"weight must be 2-D \[N, K\], got shape \(2, 3, 4\)"):
        fp8linear.quantize_weight(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="weight must be bf16/fp16/fp32, got torch.int32"):
        fp8linear.quantize_weight(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^weight must be bf16/fp16/fp32, got "
                                         r"torch.float8_e4m3fn$"):
        fp8linear.quantize_weight(torch.randn(4, 4).to(torch.float8_e4m3fn))
    for bad in (float("inf"), float("nan")):
        w = torch.randn(4, 4)
        w[1, 2] = bad
        with pytest.raises(ValueError, match=r"^weight has non-finite values \(inf/nan\): "
                                             r"cannot quantize$"):
            fp8linear.quantize_weight(w)


def test_activation_input_errors():
    with pytest.raises(ValueError, match="activation must be bf16/fp16/fp32, got torch.int64"):
        fp8linear.quantize_activation(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^activation must be bf16/fp16/fp32, got "
                                         r"torch.float8_e4m3fn$"):
        fp8linear.quantize_activation(torch.randn(2, 4).to(torch.float8_e4m3fn))


def test_has_row_scales_tells_the_two_layouts_apart():
    assert has_row_scales(torch.empty(200, 3), 200)
    assert not has_row_scales(torch.empty(2, 3), 200)
    assert has_row_scales(torch.empty(100, 3), 100)
    assert not has_row_scales(torch.empty(1, 3), 100)
    assert not has_row_scales(torch.empty(1, 3), 1)  # one row: the same either way


def test_dequantize_weight_checks_the_scale():
    q, s = fp8linear.quantize_weight(torch.randn(200, 300))
    cases = [
        (torch.ones(5, 5), "weight_scale_inv has shape (5, 5) but weight is [200, 300]: "
                           "expected (2, 3) for 128x128 blocks or (200, 3) per row"),
        (torch.ones(1, 1), "weight_scale_inv has shape (1, 1) but weight is [200, 300]: "
                           "expected (2, 3) for 128x128 blocks or (200, 3) per row"),
        (torch.ones(2, 3, 1), "weight_scale_inv has shape (2, 3, 1) but weight is [200, 300]: "
                              "expected (2, 3) for 128x128 blocks or (200, 3) per row"),
        (-s, "weight_scale_inv has a non-positive value (first at index (0, 0), value "
             f"{-float(s[0, 0])}): weight scales must be positive and finite"),
        (s * 0, "weight_scale_inv has a non-positive value (first at index (0, 0), value "
                "0.0): weight scales must be positive and finite"),
    ]
    for scale, msg in cases:
        with pytest.raises(ValueError) as e:
            fp8linear.dequantize_weight(q, scale)
        assert str(e.value) == msg
    bad = s.clone()
    bad[1, 1] = float("inf")
    with pytest.raises(ValueError) as e:
        fp8linear.dequantize_weight(q, bad, name="layers.0.q_proj.weight")
    assert str(e.value) == ("layers.0.q_proj.weight_scale_inv has non-finite values (first at "
                            "index (1, 1), value inf): the checkpoint is corrupt or was "
                            "quantized from weights holding inf/nan")
    with pytest.raises(ValueError) as e:
        fp8linear.dequantize_weight(q.view(2, 100, 300), s)
    assert str(e.value) == "weight must be 2-D [N, K], got shape (2, 100, 300)"
    # both accepted layouts still work
    rows = expand_weight_scale(s, 200)
    assert torch.equal(fp8linear.dequantize_weight(q, s), fp8linear.dequantize_weight(q, rows))
