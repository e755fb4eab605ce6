"""integrations/vllm/checkpoint_format.py and layer_filter.py: which checkpoints are served
and which layers they left unquantized.

Both modules import no vLLM, so their tests run without it (they live outside
tests/integrations/vllm, whose tests need vLLM installed)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from fp8linear_vllm.checkpoint_format import (UnsupportedCheckpointError,
                                              parse_quantization_config)
from fp8linear_vllm.layer_filter import matches_any, pattern_matches

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}


def ct(**weights):
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
         "strategy": "block", "block_structure": [128, 128]}
    w.update(weights)
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head", "re:.*mlp.gate$"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": w,
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                      "strategy": "group", "group_size": 128}}}}


def test_fp8_block_checkpoint():
    fmt = parse_quantization_config(dict(FP8, ignored_layers=["model.layers.0.mlp.gate"]))
    assert (fmt.method, fmt.scale_name) == ("fp8", "weight_scale_inv")
    assert fmt.ignored == ["model.layers.0.mlp.gate"] and fmt.targets is None
    hf = parse_quantization_config(dict(FP8, modules_to_not_convert=["lm_head"]))
    assert hf.ignored == ["lm_head"]
    assert parse_quantization_config(dict(FP8, scale_fmt="ue8m0")).method == "fp8"


def test_compressed_tensors_block_checkpoint():
    fmt = parse_quantization_config(ct())
    assert (fmt.method, fmt.scale_name) == ("compressed-tensors", "weight_scale")
    assert fmt.ignored == ["lm_head", "re:.*mlp.gate$"] and fmt.targets is None


def test_not_quantized():
    assert parse_quantization_config(None) is None
    assert parse_quantization_config({}) is None


@pytest.mark.parametrize("cfg,match", [
    (dict(FP8, weight_block_size=None), "per-tensor FP8.*--quantization fp8"),
    (dict(FP8, weight_block_size=[64, 64]), r"unsupported weight_block_size \[64, 64\]"),
    (dict(FP8, weight_block_size=[128]), r"unsupported weight_block_size \[128\]"),
    (dict(FP8, activation_scheme="static"), "unsupported activation_scheme 'static'"),
    (dict(FP8, fmt="e5m2"), "unsupported fmt 'e5m2'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    (ct(strategy="channel"), "weight strategy 'channel'"),
    (ct(block_structure=[64, 128]), r"unsupported block_structure \[64, 128\]"),
    (ct(num_bits=4, type="int"), "4-bit int"),
    (ct(symmetric=False), "asymmetric"),
    (dict(ct(), transform_config={"x": 1}), "transforms"),
])
def test_unsupported_checkpoints_say_why(cfg, match):
    with pytest.raises(UnsupportedCheckpointError, match=match) as e:
        parse_quantization_config(cfg)
    assert str(e.value).startswith("fp8_blockgemm: ")


def test_compressed_tensors_static_activations_rejected():
    cfg = ct()
    cfg["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(UnsupportedCheckpointError, match="static activation scales"):
        parse_quantization_config(cfg)


@pytest.mark.parametrize("pattern,name,hit", [
    ("lm_head", "lm_head", True),
    ("mlp.gate", "model.layers.0.mlp.gate", True),
    ("mlp.gate", "model.layers.0.mlp.gate_proj", False),
    ("model.layers.1", "model.layers.1.self_attn.o_proj", True),
    ("model.layers.1", "model.layers.10.self_attn.o_proj", False),
    ("down_proj", "model.layers.3.mlp.down_proj", True),
    ("re:.*mlp.gate$", "model.layers.0.mlp.gate", True),
    ("re:.*mlp.gate$", "model.layers.0.mlp.gate_up_proj", False),
])
def test_pattern_matches(pattern, name, hit):
    assert pattern_matches(pattern, name) is hit


def test_fused_layers_match_through_their_parts():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj",
                                                                           "up_proj"]}
    p = "model.layers.0.self_attn.qkv_proj"
    assert matches_any(p, ["model.layers.0.self_attn"], packed)
    assert not matches_any(p, ["model.layers.1.self_attn.q_proj"], packed)
    assert matches_any(p, ["q_proj", "k_proj", "v_proj"], packed)
    assert matches_any(p, ["model.layers.0.self_attn.qkv_proj"], packed)  # vLLM's name
    with pytest.raises(ValueError, match="fused layer 'model.layers.0.self_attn.qkv_proj'"):
        matches_any(p, ["model.layers.0.self_attn.k_proj"], packed)
    assert not matches_any(p, [], packed)


def test_the_plugins_pure_modules_import_no_vllm():
    # what lets these tests (and test_vllm_sharding.py) run on machines without vLLM
    code = ("import sys\n"
            "import fp8linear_vllm.sharding, fp8linear_vllm.checkpoint_format\n"
            "import fp8linear_vllm.layer_filter\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "[]\n"
