"""The MoE model of the end-to-end benchmark (e2e_vllm.py --shape qwen3_30b_a3b): a
Qwen3-30B-A3B-shaped decoder (48 layers, hidden 2048, 32 query / 4 KV heads of 128, 128
experts, top-8, expert intermediate 768, vocab 151936) with seeded random weights.

Only the block-FP8 checkpoint is written (~31 GB): each weight is drawn in bf16 on the GPU
and quantized with fp8linear.quantize_weight as `fp8linear quantize` does, so the
60 GB BF16 original never touches the disk. The BF16 baseline is the same config without
``quantization_config``, loaded with vLLM's load_format="dummy" (random weights of the same
shapes: a BF16 model's time per token does not depend on its values).
"""
from __future__ import annotations

import json
import os

QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936)
# --shape tiny_moe: the same architecture, small (CPU plumbing checks only)
TINY_MOE = dict(QWEN3_30B_A3B, hidden_size=256, intermediate_size=512,
                moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, num_experts=8, num_experts_per_tok=2, vocab_size=1024)


def config(model: dict, layers: int) -> dict:
    return dict(model, num_hidden_layers=layers, max_position_embeddings=8192,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
                bos_token_id=151643, eos_token_id=151645, initializer_range=0.02)


def write_bf16_config(path: str, model: dict, layers: int) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config(model, layers), f, indent=1)


def write_fp8_checkpoint(path: str, model: dict, layers: int, seed: int,
                         shard_bytes: float = 4e9) -> int:
    """Block-FP8 checkpoint (weights + weight_scale_inv, config.json with
    fp8linear's quantization_config); returns the tensor bytes written."""
    import torch
    from common import write_shards

    from fp8linear import quantize_weight
    from fp8linear.checkpoint import quantization_config

    os.makedirs(path, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    h, v, d = model["hidden_size"], model["vocab_size"], model["head_dim"]
    inter, experts = model["moe_intermediate_size"], model["num_experts"]
    nq, nkv = model["num_attention_heads"] * d, model["num_key_value_heads"] * d

    def rnd(*shape, std=0.02):
        return torch.randn(*shape, device=dev, generator=g) * std

    def bf16(t):
        return t.to(torch.bfloat16).cpu()

    def norm(n):
        return bf16(1.0 + 0.05 * rnd(n, std=1.0))

    def fp8(name, n, k):
        w, s = quantize_weight(rnd(n, k).to(torch.bfloat16))
        yield name + ".weight", w.cpu()
        yield name + ".weight_scale_inv", s.cpu()

    def tensors():
        yield "model.embed_tokens.weight", bf16(rnd(v, h))
        for i in range(layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", norm(h)
            yield p + "post_attention_layernorm.weight", norm(h)
            yield p + "self_attn.q_norm.weight", norm(d)
            yield p + "self_attn.k_norm.weight", norm(d)
            for proj, n, k in (("q_proj", nq, h), ("k_proj", nkv, h), ("v_proj", nkv, h),
                               ("o_proj", h, nq)):
                yield from fp8(p + "self_attn." + proj, n, k)
            yield p + "mlp.gate.weight", bf16(rnd(experts, h))
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                yield from fp8(q + "gate_proj", inter, h)
                yield from fp8(q + "up_proj", inter, h)
                yield from fp8(q + "down_proj", h, inter)
        yield "model.norm.weight", norm(h)
        yield "lm_head.weight", bf16(rnd(v, h))

    total = write_shards(path, tensors(), shard_bytes)
    with open(os.path.join(path, "config.json"), "w") as f:
        # the routers stay bf16 (as `fp8linear quantize` and Qwen's FP8 checkpoints keep them)
        routers = [f"model.layers.{i}.mlp.gate" for i in range(layers)]
        json.dump(dict(config(model, layers), quantization_config=quantization_config(
            ignored_layers=routers)), f, indent=1)
    return total
