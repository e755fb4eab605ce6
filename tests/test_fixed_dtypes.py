"""FixedDtypes (fp8linear/fixed_dtypes.py): model.to(dtype) keeps the named parameters' dtypes
and moves them with the module; the others follow the dtype."""
import torch
from torch import nn

from fp8linear.fixed_dtypes import FixedDtypes


class Layer(FixedDtypes):
    FIXED_DTYPES = ("weight", "scale")

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((4, 4), 1.5).to(torch.float8_e4m3fn),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.tensor([1 + 2 ** -20]), requires_grad=False)
        self.bias = nn.Parameter(torch.ones(4, dtype=torch.bfloat16), requires_grad=False)


def test_dtype_casts_skip_the_fixed_parameters():
    layer = nn.Sequential(Layer()).to(torch.float16)[0]
    assert layer.weight.dtype == torch.float8_e4m3fn and float(layer.weight[0, 0]) == 1.5
    assert layer.scale.dtype == torch.float32 and float(layer.scale) == 1 + 2 ** -20  # not rounded
    assert layer.bias.dtype == torch.float16
    layer.half().float()
    assert (layer.weight.dtype, layer.scale.dtype, layer.bias.dtype) == (
        torch.float8_e4m3fn, torch.float32, torch.float32)


def test_device_moves_take_the_fixed_parameters_along():
    layer = Layer().to("meta")
    assert {p.device.type for p in layer.parameters()} == {"meta"}
    assert layer.weight.dtype == torch.float8_e4m3fn
