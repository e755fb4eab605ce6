"""Tiny random mixture-of-experts models written straight to disk (no downloads), and their
torch reference: a Mixtral-style (4 experts, top-2, renormalized weights) and a
Qwen3-MoE-style (8 experts, top-4, unnormalized weights, q/k norms) decoder, one layer each.

Expert shapes keep whole 128x128 blocks (hidden 256, expert intermediate 256), the shapes
fp8linear's MoE kernels take; attention projections are block FP8 too.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

H, INTER, VOCAB = 256, 256, 512

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "intermediate_size": INTER, "num_local_experts": 4, "num_experts_per_tok": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "moe_intermediate_size": INTER, "intermediate_size": 512, "num_experts": 8,
             "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "num_attention_heads": 4, "num_key_value_heads": 2,
             "attention_bias": False}
# per model_type: the MoE block's name, an expert's gate, up and down projections, and the
# config key of the expert count
NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2", "num_local_experts"),
         "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj", "num_experts")}


def write_bf16(out_dir, arch: dict, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"hidden_size": H, "num_hidden_layers": 1, "head_dim": 64, "vocab_size": VOCAB,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, **arch}
    block, gate, up, down, n_experts = NAMES[cfg["model_type"]]
    g = torch.Generator().manual_seed(seed)

    def lin(n, k, gain=1.0):
        return (torch.randn(n, k, generator=g) * gain / k ** 0.5).to(torch.bfloat16)

    bf = dict(dtype=torch.bfloat16)
    p = "model.layers.0."
    q, kv = cfg["num_attention_heads"] * 64, cfg["num_key_value_heads"] * 64
    sd = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g).to(torch.bfloat16),
          "model.norm.weight": torch.ones(H, **bf), "lm_head.weight": lin(VOCAB, H, 3.0),
          p + "input_layernorm.weight": torch.ones(H, **bf),
          p + "post_attention_layernorm.weight": torch.ones(H, **bf),
          p + "self_attn.q_proj.weight": lin(q, H, 0.5), p + "self_attn.k_proj.weight":
          lin(kv, H, 0.5), p + "self_attn.v_proj.weight": lin(kv, H),
          p + "self_attn.o_proj.weight": lin(H, q), p + f"{block}.gate.weight": lin(
              cfg[n_experts], H, 4.0)}
    if cfg["model_type"] == "qwen3_moe":
        sd[p + "self_attn.q_norm.weight"] = torch.ones(64, **bf)
        sd[p + "self_attn.k_norm.weight"] = torch.ones(64, **bf)
    for i in range(cfg[n_experts]):
        e = f"{p}{block}.experts.{i}."
        sd[e + f"{gate}.weight"], sd[e + f"{up}.weight"] = lin(INTER, H), lin(INTER, H)
        sd[e + f"{down}.weight"] = lin(H, INTER)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


class _RefExperts(torch.nn.Module):
    """transformers' experts module (same call) on fp8linear.moe_reference's numerics."""

    def __init__(self, w13, s13, w2, s2):
        super().__init__()
        self.w13, self.s13, self.w2, self.s2 = w13, s13, w2, s2

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from fp8linear import moe_reference
        return moe_reference(hidden_states, self.w13, self.s13, self.w2, self.s2,
                             top_k_weights.contiguous(), top_k_index.contiguous())


def reference_logprobs(bf16_dir, fp8_dir, token_ids, dtype=torch.bfloat16) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 log-probabilities of the model run by transformers with
    activations in ``dtype``, its attention projections replaced by fp8linear's
    reference GEMM and its experts by ``moe_reference``, on the block-FP8 weights of
    ``fp8_dir`` (what the plugin holds: at these shapes the online quantization of the
    fused gate/up and q/k/v weights gives the same blocks)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_llama import _Fp8Linear  # noqa: PLC0415 (a sibling test module)

    cfg = AutoConfig.from_pretrained(str(bf16_dir))
    model = AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=dtype).eval()
    block, gate, up, down, n_experts_key = NAMES[cfg.model_type]
    sd = load_file(str(Path(fp8_dir) / "model.safetensors"))
    n_experts = getattr(cfg, n_experts_key)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = p + f"self_attn.{proj}."
            setattr(layer.self_attn, proj, _Fp8Linear(sd[w + "weight"],
                                                      sd[w + "weight_scale_inv"]))
        e = [f"{p}{block}.experts.{j}." for j in range(n_experts)]

        def stack(names, what):
            return torch.stack([torch.cat([sd[x + f"{n}.{what}"] for n in names]) for x in e])
        layer.mlp.experts = _RefExperts(stack((gate, up), "weight"),
                                        stack((gate, up), "weight_scale_inv"),
                                        stack((down,), "weight"),
                                        stack((down,), "weight_scale_inv"))
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)])).logits[0]
    return logits.float().log_softmax(-1)
