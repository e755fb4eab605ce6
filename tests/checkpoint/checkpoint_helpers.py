"""Shared by the checkpoint tests: a quantized tiny MoE model and shard surgery."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import tiny_checkpoints as tiny
from fp8linear import quantize_model
from fp8linear.checkpoint import INDEX_NAME

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}


def quantized_tiny(seed=0, ue8m0=False):
    torch.manual_seed(seed)
    model = tiny.TinyMoeForCausalLM().to(torch.bfloat16)
    model.load_state_dict(tiny.random_state(seed), strict=False)  # lm_head is tied
    return quantize_model(model, skip=("lm_head", "*.mlp.gate"), ue8m0=ue8m0)


def assert_same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for n in sa:
        assert sa[n].dtype == sb[n].dtype and sa[n].shape == sb[n].shape, n
        assert torch.equal(sa[n].view(torch.uint8) if sa[n].dtype == torch.float8_e4m3fn
                           else sa[n], sb[n].view(torch.uint8)
                           if sb[n].dtype == torch.float8_e4m3fn else sb[n]), n


def read_index(path):
    return json.loads((Path(path) / INDEX_NAME).read_text())["weight_map"]



def rewrite(path, name, tensor=None):
    """Replace (or with tensor=None remove) one tensor in the shard that holds it."""
    wm = read_index(path)
    file = path / wm[name]
    tensors = load_file(str(file))
    if tensor is None:
        del tensors[name]
        del wm[name]
        (path / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    else:
        tensors[name] = tensor
    save_file(tensors, str(file))
    return file

