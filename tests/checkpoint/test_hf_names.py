"""fp8linear.checkpoint.hf_names: the names transformers renames between a model and its
checkpoints (Mixtral's block_sparse_moe), both ways; none for other models and modules."""
from torch import nn

from fp8linear.checkpoint.hf_names import to_checkpoint, to_model
from tiny_hf_moe import mixtral, model_of, qwen3_moe


def test_mixtral_names_both_ways():
    model, _ = model_of(mixtral)
    disk = "model.layers.1.block_sparse_moe.experts.3.w1.weight_scale_inv"
    ours = "model.layers.1.mlp.experts.3.w1.weight_scale_inv"
    assert to_model(model)(disk) == ours
    assert to_checkpoint(model)(ours) == disk
    for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        assert to_model(model)(name) == name == to_checkpoint(model)(name)


def test_models_without_renames_keep_their_names():
    model, _ = model_of(qwen3_moe)
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    assert to_model(model)(name) == name == to_checkpoint(model)(name)
    plain = nn.Sequential(nn.Linear(2, 2))
    assert to_checkpoint(plain)("0.block_sparse_moe.weight") == "0.block_sparse_moe.weight"
