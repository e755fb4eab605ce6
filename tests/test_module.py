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
    # (0.064 here), so close, but not closer than fp8 allows: an unquantized model (0), or
    # one whose linears ran in bf16 (~0.003), fails
    err = ref.rel_err(got, want)
    assert 0.02 <= err <= 0.1, err
    assert len(_names(model)) == 6


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


def _state(m):
    return {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).clone()
            for k, v in m.state_dict().items()}


@pytest.mark.parametrize("rows", [False, True], ids=["block", "per_row"])
@pytest.mark.parametrize("value,what", [(float("nan"), "non-finite values"),
                                        (-1.0, "a non-positive value"),
                                        (0.0, "a non-positive value")])
def test_failed_load_leaves_the_layer_exactly_as_it_was(rows, value, what):
    m = FP8Linear.from_linear(_linear(300, 200, seed=5))
    before = _state(m)
    q, s = fp8linear.quantize_weight(_linear(300, 200, seed=6).weight.detach())
    if rows:  # a load that would also change the scale's layout
        s = expand_weight_scale(s, 200).contiguous()
    s[1, 2] = value
    tail = ("the checkpoint is corrupt or was quantized from weights holding inf/nan"
            if value != value else "weight scales must be positive and finite")
    with pytest.raises(ValueError) as e:
        m.load_state_dict({"weight": q, "weight_scale_inv": s, "bias": torch.ones(200)})
    assert str(e.value) == (f"weight_scale_inv has {what} (first at index (1, 2), value "
                            f"{value}): {tail}")
    after = _state(m)
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].shape == after[k].shape and torch.equal(before[k], after[k]), k


def test_failed_load_of_a_wrong_bias_or_weight_shape_changes_nothing():
    m = FP8Linear.from_linear(_linear(300, 200, seed=5))
    before = _state(m)
    q, s = fp8linear.quantize_weight(torch.randn(200, 300))
    rows = expand_weight_scale(s, 200).contiguous()
    with pytest.raises(ValueError) as e:
        m.load_state_dict({"weight": q, "weight_scale_inv": rows, "bias": torch.ones(199)})
    assert str(e.value) == "bias: expected shape (200,), got (199,)"
    with pytest.raises(ValueError) as e:
        m.load_state_dict({"weight": q[:, :256], "weight_scale_inv": s, "bias": torch.ones(200)})
    assert str(e.value) == "weight: expected shape (200, 300), got (200, 256)"
    after = _state(m)
    for k in before:
        assert before[k].shape == after[k].shape and torch.equal(before[k], after[k]), k


def test_load_bf16_scales_converts_them_exactly_and_rejects_other_dtypes():
    q, s = fp8linear.quantize_weight(torch.randn(200, 300))
    s16 = s.to(torch.bfloat16)
    m = FP8Linear(300, 200, bias=False)
    m.load_state_dict({"weight": q, "weight_scale_inv": s16})
    assert m.weight_scale_inv.dtype == torch.float32
    assert torch.equal(m.weight_scale_inv, s16.float())
    with pytest.raises(ValueError) as e:
        m.load_state_dict({"weight": q, "weight_scale_inv": s.double()})
    assert str(e.value) == ("weight_scale_inv: expected float32 (or bfloat16/float16), got "
                            "torch.float64")


def test_quantize_model_takes_a_string_as_one_pattern():
    # a string used to be iterated as characters: "lm_head" skipped every name with an "a"
    assert _names(quantize_model(Tiny(), skip="lm_head")) == _names(quantize_model(Tiny()))
    assert _names(quantize_model(Tiny(), skip="attn")) == [
        "layers.0.mlp", "layers.0.small", "layers.1.mlp", "layers.1.small", "lm_head"]


def test_quantize_model_refuses_a_single_linear():
    with pytest.raises(TypeError) as e:
        quantize_model(nn.Linear(256, 256))
    assert str(e.value) == ("quantize_model(nn.Linear) cannot replace the layer in place: use "
                            "FP8Linear.from_linear(linear) for a single layer")
    with pytest.raises(TypeError) as e:
        quantize_model({"a": nn.Linear(4, 4)})
    assert str(e.value) == "quantize_model expects an nn.Module, got dict"


def test_quantize_model_on_the_meta_device_makes_empty_layers():
    with torch.device("meta"):
        model = Tiny()
    quantize_model(model)
    layer = model.layers[0]["mlp"]
    assert isinstance(layer, FP8Linear) and layer.weight.device.type == "meta"
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (3, 2)
    assert layer.bias.dtype == torch.float32  # the original layer's dtype


def test_replace_linears_takes_exact_names():
    from fp8linear.module import replace_linears
    model = replace_linears(Tiny(), ["layers.0.attn"])  # a pattern would also match more
    assert _names(model) == ["layers.0.attn"]
    with pytest.raises(TypeError) as e:
        replace_linears(model, ["norm"])
    assert str(e.value) == "'norm' is a LayerNorm, not an nn.Linear"


def test_quantize_model_checks_every_weight_before_replacing_any():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 192)).to(torch.bfloat16)
    with torch.no_grad():
        model[1].weight[3, 4] = float("nan")
    with pytest.raises(ValueError) as e:
        quantize_model(model, skip=())
    assert str(e.value) == ("1.weight has non-finite values (first at index (3, 4), value nan): "
                            "cannot quantize it")
    assert all(type(m) is nn.Linear for m in model)  # (not the first one replaced)
