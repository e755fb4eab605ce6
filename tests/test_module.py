"""FP8Linear, from_linear, quantize_model, state_dict round trips, load-time checks."""
import io

import pytest
import torch
from torch import nn

import fp64_reference as ref
import fp8linear
from fp8linear import FP8Linear, fp8_modules, quantize_model
from fp8linear.quant import expand_weight_scale


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _linear(k, n, bias=True, dtype=torch.bfloat16, seed=0):
    lin = nn.Linear(k, n, bias=bias)
    g = _gen(seed)
    with torch.no_grad():
        lin.weight.copy_(ref.random_matrix(n, k, g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype)


def test_init_parameters():
    m = FP8Linear(300, 200, bias=True, dtype=torch.float16)
    assert m.weight.dtype == torch.float8_e4m3fn and m.weight.shape == (200, 300)
    assert m.weight_scale_inv.dtype == torch.float32 and m.weight_scale_inv.shape == (2, 3)
    assert m.bias.dtype == torch.float16 and m.bias.shape == (200,)
    assert not any(p.requires_grad for p in m.parameters())
    assert FP8Linear(300, 200, bias=False).bias is None
    with pytest.raises(ValueError, match="unsupported block size 64"):
        FP8Linear(300, 200, block_size=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_forward_matches_reference(dtype, bias):
    lin = _linear(300, 200, bias, dtype, seed=1)
    m = FP8Linear.from_linear(lin)
    q, s = fp8linear.quantize_weight(lin.weight)
    assert torch.equal(m.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(m.weight_scale_inv, s)
    if bias:
        assert m.bias.dtype == dtype and torch.equal(m.bias, lin.bias)
    x = ref.random_matrix(6, 300, _gen(2), spread=1.0).to(dtype).reshape(2, 3, 300)
    y = m(x)
    assert y.shape == (2, 3, 200) and y.dtype == dtype
    xq, xs = fp8linear.quantize_activation(x.reshape(-1, 300))
    want = ref.gemm(xq, xs, q, s, lin.bias if bias else None)
    assert ref.rel_err(y.reshape(-1, 200), want) <= 2e-3 + 2.0 ** -8
    # and close to the original layer: e4m3 precision
    assert ref.rel_err(y, lin(x).double()) <= 0.05


def test_from_linear_ue8m0():
    m = FP8Linear.from_linear(_linear(256, 256), ue8m0=True)
    mant, _ = torch.frexp(m.weight_scale_inv)
    assert (mant == 0.5).all()


def test_dtype_conversion_keeps_fp8_weight_and_fp32_scales():
    m = FP8Linear.from_linear(_linear(256, 130, dtype=torch.float32))
    w, s = m.weight.clone(), m.weight_scale_inv.clone()
    m.to(torch.bfloat16)
    assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.dtype == torch.float32
    assert m.bias.dtype == torch.bfloat16  # the bias follows the model's dtype
    m.half()
    assert m.bias.dtype == torch.float16
    assert torch.equal(m.weight.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(m.weight_scale_inv, s)
    m.to("meta")
    assert m.weight.device.type == "meta" and m.weight.dtype == torch.float8_e4m3fn


def test_extra_repr():
    m = FP8Linear.from_linear(_linear(300, 200))
    assert repr(m) == ("FP8Linear(in_features=300, out_features=200, bias=True, "
                       "weight=float8_e4m3fn, block=128x128)")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 256)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"attn": nn.Linear(256, 256), "mlp": nn.Linear(256, 300),
                           "small": nn.Linear(256, 16)}) for _ in range(2))
        self.norm = nn.LayerNorm(300)
        self.lm_head = nn.Linear(300, 50, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for blk in self.layers:
            h = blk["attn"](h) + blk["small"](h).sum(-1, keepdim=True)
        return self.lm_head(self.norm(self.layers[-1]["mlp"](h)))


def _names(model):
    return sorted(n for n, _ in fp8_modules(model))


def test_quantize_model_default_skips_lm_head_only():
    model = Tiny()
    out = quantize_model(model)
    assert out is model
    assert _names(model) == [f"layers.{i}.{p}" for i in range(2)
                             for p in ("attn", "mlp", "small")]
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.embed, nn.Embedding)


def test_quantize_model_skip_patterns_and_min_features():
    assert _names(quantize_model(Tiny(), skip=("layers.0.*", "lm_head"))) == [
        "layers.1.attn", "layers.1.mlp", "layers.1.small", ]
    assert _names(quantize_model(Tiny(), skip=("mlp",))) == [
        "layers.0.attn", "layers.0.small", "layers.1.attn", "layers.1.small", "lm_head"]
    assert _names(quantize_model(Tiny(), min_features=64)) == [
        "layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]


def test_quantized_model_output_close_to_original():
    torch.manual_seed(0)
    model = Tiny()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        want = model(ids)
        got = quantize_model(model)(ids)
    # three quantized layers in a row (one of them summed over 16 outputs): a few e4m3 steps
    assert ref.rel_err(got, want) <= 0.1


def test_state_dict_round_trip():
    src = quantize_model(Tiny())
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    assert sd["layers.0.attn.weight"].dtype == torch.float8_e4m3fn
    assert sd["layers.0.attn.weight_scale_inv"].shape == (2, 2)
    dst = quantize_model(Tiny())  # different random weights until loaded
    dst.load_state_dict(sd)
    for (n1, t1), (n2, t2) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert n1 == n2 and t1.dtype == t2.dtype
        assert torch.equal(t1.view(torch.uint8) if t1.dtype == torch.float8_e4m3fn else t1,
                           t2.view(torch.uint8) if t2.dtype == torch.float8_e4m3fn else t2)
    ids = torch.randint(0, 50, (1, 5))
    assert torch.equal(src(ids), dst(ids))


def test_load_per_row_scales():
    lin = _linear(300, 200, seed=3)
    q, s = fp8linear.quantize_weight(lin.weight)
    rows = expand_weight_scale(s, 200) * (1 + torch.rand(200, 3, generator=_gen(4)))
    m = FP8Linear(300, 200)
    m.load_state_dict({"weight": q, "weight_scale_inv": rows.contiguous(), "bias": lin.bias})
    assert m.weight_scale_inv.shape == (200, 3)
    x = torch.randn(4, 300, dtype=torch.bfloat16)
    xq, xs = fp8linear.quantize_activation(x)
    assert ref.rel_err(m(x), ref.gemm(xq, xs, q, rows, lin.bias)) <= 2e-3 + 2.0 ** -8


def test_load_errors():
    q, s = fp8linear.quantize_weight(torch.randn(200, 300))
    m = FP8Linear(300, 200, bias=False)
    with pytest.raises(ValueError, match="weight: expected float8_e4m3fn, got torch.bfloat16"):
        m.load_state_dict({"weight": torch.randn(200, 300, dtype=torch.bfloat16),
                           "weight_scale_inv": s})
    with pytest.raises(ValueError, match=r"weight_scale_inv: expected shape \(2, 3\) \(128x128 "
                                         r"blocks\) or \(200, 3\) \(per row\), got \(2, 2\)"):
        m.load_state_dict({"weight": q, "weight_scale_inv": s[:, :2]})
    bad = s.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"weight_scale_inv has non-finite values \(first at "
                                         r"index \(1, 2\), value nan\)"):
        m.load_state_dict({"weight": q, "weight_scale_inv": bad})
    bad[1, 2] = float("inf")
    model = nn.Sequential(nn.Linear(300, 200))
    quantize_model(model)
    with pytest.raises(ValueError, match=r"^0\.weight_scale_inv has non-finite values"):
        model.load_state_dict({"0.weight": q, "0.weight_scale_inv": bad,
                               "0.bias": torch.zeros(200)})


def test_validate_names_the_layer():
    model = quantize_model(nn.Sequential(nn.Linear(256, 256)))
    model[0].weight_scale_inv.data[0, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"layer0.weight_scale_inv has non-finite values"):
        model[0].validate("layer0")
