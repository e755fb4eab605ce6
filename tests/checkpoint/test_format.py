"""fp8linear.checkpoint.format: which tensors of a checkpoint are linear-layer weights."""
import pytest

from fp8linear.checkpoint import CheckpointError, tensor_role

LLAMA = {"vocab_size": 1000, "tie_word_embeddings": False}


@pytest.mark.parametrize("name,shape,quantize,reason", [
    ("model.layers.3.self_attn.q_proj.weight", (512, 512), True, "linear weight"),
    ("model.layers.3.mlp.down_proj.weight", (512, 1376), True, "linear weight"),
    ("model.layers.0.mlp.gate_proj.weight", (1000, 512), True, "linear weight"),  # = vocab
    ("model.layers.5.mlp.experts.17.gate_proj.weight", (256, 512), True, "linear weight"),
    ("model.layers.5.mlp.shared_experts.up_proj.weight", (256, 512), True, "linear weight"),
    ("model.layers.2.block_sparse_moe.experts.3.w1.weight", (700, 512), True, "linear"),
    ("transformer.h.0.attn.c_attn.weight", (512, 1536), True, "linear weight"),
    ("bert.encoder.layer.0.attention.output.dense.weight", (512, 512), True, "linear"),
    ("model.layers.5.self_attn.kv_a_proj_with_mqa.weight", (576, 512), True, "linear"),
    ("model.embed_tokens.weight", (1000, 512), False, "embedding"),
    ("transformer.wte.weight", (1000, 512), False, "embedding"),
    ("shared.weight", (1000, 512), False, "embedding"),
    ("lm_head.weight", (1000, 512), False, "output head"),
    ("output.weight", (1000, 512), False, "output head"),
    ("embed_out.weight", (1000, 512), False, "embedding"),
    ("cls.predictions.decoder.weight", (1000, 512), False, "vocabulary-sized"),
    ("model.layers.5.mlp.gate.weight", (64, 512), False, "MoE router"),
    ("model.layers.5.block_sparse_moe.gate.weight", (8, 512), False, "MoE router"),
    ("model.layers.5.mlp.router.weight", (32, 512), False, "MoE router"),
    ("model.norm.weight", (512,), False, "1-D"),
    ("model.layers.0.self_attn.q_proj.bias", (512,), False, "1-D"),
    ("model.layers.0.self_attn.q_norm.weight", (512, 4), False, "normalization"),
    ("model.layers.0.mlp.experts.gate_up_proj", (8, 1024, 512), False, "3-D"),
    ("visual.patch_embed.proj.weight", (512, 3, 2, 14, 14), False, "5-D"),
    ("model.layers.0.attn.rel_pos", (64, 64), False, "not a .weight tensor"),
])
def test_tensor_role(name, shape, quantize, reason):
    q, why = tensor_role(name, shape, "BF16", LLAMA)
    assert q == quantize and reason in why


def test_tensor_role_tied_head_skip_and_dtypes():
    tied = {"vocab_size": 1000, "tie_word_embeddings": True}
    assert tensor_role("lm_head.weight", (1000, 64), "F16", tied) == (
        False, "output head (tied to the input embeddings)")
    # multimodal configs keep the text model's keys in text_config
    assert tensor_role("language_model.out.weight", (1000, 64), "F32",
                       {"text_config": {"vocab_size": 1000}})[0] is False
    assert tensor_role("a.b.weight", (64, 64), "BF16", {}, skip=("a.*",)) == (
        False, "matches --skip 'a.*'")
    assert tensor_role("a.b.weight", (64, 64), "I64", {}) == (False, "I64 (not bf16/fp16/fp32)")
    with pytest.raises(CheckpointError, match="tensor 'a.b.weight' is already F8_E4M3: the "
                                              "input checkpoint is quantized"):
        tensor_role("a.b.weight", (64, 64), "F8_E4M3", {})

