"""fp8linear.checkpoint.info: what `fp8linear info` reports, from headers only."""
import json

import torch
from safetensors.torch import load_file, save_file

import tiny_checkpoints as tiny
from checkpoint_helpers import read_index, rewrite
from fp8linear.checkpoint import INDEX_NAME, checkpoint_info, quantization_config


def test_checkpoint_info(converted):
    info = checkpoint_info(converted)
    assert info["quantization_config"]["weight_block_size"] == [128, 128]
    assert info["scale_fmt"] == "fp32"
    assert info["quantized_tensors"] == info["scale_tensors"] == len(tiny.LINEAR_WEIGHTS)
    assert info["unquantized_2d_weights"] == ["model.embed_tokens.weight",
                                              "model.layers.1.mlp.gate.weight"]
    assert info["fp8_without_scale"] == []
    assert info["bytes_by_dtype"]["F8_E4M3"] == info["quantized_params"]
    assert info["total_bytes"] == sum(info["bytes_by_dtype"].values())
    assert info["quantization_config"] == quantization_config(
        ignored_layers=["model.layers.1.mlp.gate"])


def test_checkpoint_info_reports_inconsistent_scales(converted):
    w = "model.layers.1.self_attn.q_proj.weight"
    file = converted / read_index(converted)[w]
    rewrite(converted, w + "_scale_inv", torch.ones(2, 2, dtype=torch.int32))
    rewrite(converted, "model.layers.0.mlp.up_proj.weight_scale_inv")
    up = converted / read_index(converted)["model.layers.0.mlp.up_proj.weight"]
    wm = read_index(converted)  # a scale beside a weight that is not fp8
    norm = converted / wm["model.norm.weight"]
    tensors = load_file(str(norm))
    tensors["model.norm.weight_scale_inv"] = torch.ones(1)
    save_file(tensors, str(norm))
    wm["model.norm.weight_scale_inv"] = norm.name
    (converted / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    assert sorted(checkpoint_info(converted)["problems"]) == sorted([
        f"{file}: fp8 tensor '{w}' [192, 192] needs an F32 scale '{w}_scale_inv' of shape "
        f"[2, 2] (128x128 blocks) or [192, 2] (per row), found I32 [2, 2]",
        f"{up}: fp8 tensor 'model.layers.0.mlp.up_proj.weight' [320, 192] needs an F32 scale "
        f"'model.layers.0.mlp.up_proj.weight_scale_inv' of shape [3, 2] (128x128 blocks) or "
        f"[320, 2] (per row), found none",
        f"{norm}: scale 'model.norm.weight_scale_inv' belongs to no fp8 tensor (its weight is "
        f"BF16)"])
