"""Tiny random transformers MoE models (Qwen3-MoE, Mixtral: fused experts in transformers
>= 5), built in memory for the FP8Experts and checkpoint tests (no downloads; the vLLM
tests write theirs with tests/integrations/vllm/tiny_moe.py)."""
import torch
import transformers  # (the dev extra's: missing, the tests that use it fail, never skip)


def qwen3_moe(inter=128):
    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=256, intermediate_size=384, moe_intermediate_size=inter,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)


def mixtral():
    return transformers.MixtralForCausalLM, transformers.MixtralConfig(
        vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)


def model_of(arch, dtype=torch.bfloat16, seed=0):
    """A random model whose weights are wide enough for FP8's error to be measured (the
    0.02 init would leave the experts' contribution in the noise)."""
    cls, cfg = arch() if callable(arch) else arch
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                wide = p.shape[0] == cfg.vocab_size
                p.normal_(0, 1.0 if wide else p.shape[-1] ** -0.5)
    return model.to(dtype).eval(), cfg


def experts_of(model):
    return model.model.layers[0].mlp.experts
