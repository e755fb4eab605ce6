"""A tiny random Llama written straight to disk (safetensors + config.json): no downloads.

Shapes are chosen so that one model exercises both scale layouts of the plugin at TP=1:
k_proj/v_proj have 64 rows (one KV head of 64), so the fused QKV's k/v blocks do not start on
the 128 grid and take per-row scales; gate/up have 384 rows (3 whole blocks) and o_proj is
256x256 (2x2 blocks), which keep 128x128 block scales. The vocabulary (512) is no layer's
row count, so ``fp8linear quantize`` treats only the output head as vocabulary-sized.

Used by the CPU tests and by benchmarks/vllm_device (imported there by path).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN = 256
LAYERS = 2
HEADS = 4          # head_dim 64
KV_HEADS = 1
INTERMEDIATE = 384
VOCAB = 512

# the prompt of the engine checks: 48 token ids drawn once (fixed), none a special id
PROMPT = [1, 331, 40, 273, 459, 113, 88, 401, 17, 245, 302, 64, 199, 480, 7, 356, 122, 421,
          95, 267, 33, 508, 150, 211, 386, 74, 290, 443, 12, 169, 327, 58, 237, 470, 101, 314,
          26, 392, 141, 255, 417, 83, 176, 349, 10, 228, 465, 132]
MAX_TOKENS = 16

LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def config_dict(hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS,
                intermediate=INTERMEDIATE, vocab=VOCAB) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "vocab_size": vocab, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "initializer_range": 0.02, "attention_bias": False, "mlp_bias": False,
    }


def random_state_dict(cfg: dict, seed: int = 0, dtype=torch.bfloat16) -> dict:
    """Weights scaled so that the logits are decisive (std ~3), not the near-uniform
    distribution of a 0.02-initialised model. Each linear weight is ~N(0, 1/fan_in) times a
    gain drawn per 64-row band (e^-1.2 .. e^1.2), so the 128x128 block scales differ from
    block to block and between the two halves of a block: a scale applied to the wrong rows
    shows up in the outputs."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kvh = cfg["num_key_value_heads"]

    def lin(n, k):
        w = torch.randn(n, k, generator=g) / k ** 0.5
        bands = -(-n // 64)
        gain = torch.exp(torch.empty(bands, 1).uniform_(-1.2, 1.2, generator=g))
        return (w * gain.repeat_interleave(64, 0)[:n]).to(dtype)

    sd = {"model.embed_tokens.weight": torch.randn(v, h, generator=g).to(dtype),
          "model.norm.weight": torch.ones(h, dtype=dtype),
          "lm_head.weight": (torch.randn(v, h, generator=g) * 3 / h ** 0.5).to(dtype)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        # q/k halved: softer attention, so the outputs are less chaotic in the activations'
        # rounding (bf16 vs fp32, eager vs compiled) and tolerances can be tighter
        sd[p + "self_attn.q_proj.weight"] = lin(h, h) * 0.5
        sd[p + "self_attn.k_proj.weight"] = lin(kvh * hd, h) * 0.5
        sd[p + "self_attn.v_proj.weight"] = lin(kvh * hd, h)
        sd[p + "self_attn.o_proj.weight"] = lin(h, h) * 0.5
        sd[p + "mlp.gate_proj.weight"] = lin(inter, h)
        sd[p + "mlp.up_proj.weight"] = lin(inter, h)
        sd[p + "mlp.down_proj.weight"] = lin(h, inter) * 0.5
    return sd


def write_bf16(out_dir, seed: int = 0, **cfg_overrides) -> Path:
    """Write a BF16 checkpoint (model.safetensors + config.json) and return its directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_dict(**cfg_overrides)
    sd = random_state_dict(cfg, seed)
    save_file({k: t.contiguous() for k, t in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2}))
    return out


def write_fp8(bf16_dir, out_dir) -> Path:
    """Block-FP8 copy of a BF16 checkpoint through the project's converter
    (what ``fp8linear quantize IN OUT`` runs)."""
    from fp8linear.checkpoint import quantize_checkpoint

    quantize_checkpoint(bf16_dir, out_dir, progress=False, force=True)
    return Path(out_dir)


def write_compressed_tensors(bf16_dir, out_dir, ignore=("lm_head",)) -> Path:
    """Block-FP8 copy in llm-compressor's layout: ``quant_method: compressed-tensors``,
    float-quantized 128x128 block weights, scales named ``weight_scale`` (stored in bf16,
    as llm-compressor writes them); ``ignore`` as its config lists it (MoE: the routers)."""
    from safetensors.torch import load_file, save_file

    from fp8linear import quantize_weight

    src, out = Path(bf16_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    q = {}
    for name, t in sd.items():
        if name.endswith("_proj.weight"):
            w, s = quantize_weight(t)
            q[name], q[name[:-len("weight")] + "weight_scale"] = w, s.to(torch.bfloat16)
        else:
            q[name] = t
    save_file(q, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": list(ignore),
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "float-quantized",
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": "block", "block_structure": [128, 128]},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "dynamic": True, "strategy": "group", "group_size": 128},
        }},
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# ------------------------------------------------------------------ torch reference
class _Fp8Linear(torch.nn.Module):
    """fp8linear.fp8_linear with given fp8 weight and (block or per-row) scales."""

    def __init__(self, w_fp8, scale):
        super().__init__()
        self.register_buffer("w", w_fp8)
        self.register_buffer("s", scale.float().contiguous())

    def forward(self, x):
        from fp8linear import fp8_linear
        return fp8_linear(x, self.w, self.s)


def _fp8_groups(sd: dict, layer_prefix: str, online: bool, scale_dtype):
    """{proj name: (fp8 weight, per-row scale)} as the plugin holds them.

    Checkpoint mode: each projection quantized alone (what ``fp8linear quantize`` writes).
    Online mode: the plugin quantizes vLLM's fused q/k/v and gate/up weights as one matrix
    each, so blocks may straddle two projections."""
    from fp8linear import quantize_weight
    from fp8linear.quant import expand_weight_scale

    groups = ([["q_proj", "k_proj", "v_proj"], ["o_proj"]], [["gate_proj", "up_proj"],
                                                             ["down_proj"]])
    out = {}
    for kind, sub in zip(("self_attn", "mlp"), groups):
        for names in sub:
            ws = [sd[f"{layer_prefix}{kind}.{n}.weight"] for n in names]
            parts = [torch.cat(ws)] if online else ws
            qs = []
            for w in parts:
                q, s = quantize_weight(w)
                if scale_dtype is not None:
                    s = s.to(scale_dtype).float()
                qs.append((q, expand_weight_scale(s, q.shape[0])))
            q = torch.cat([a for a, _ in qs])
            s = torch.cat([b for _, b in qs])
            r0 = 0
            for n, w in zip(names, ws):
                out[f"{kind}.{n}"] = (q[r0:r0 + w.shape[0]], s[r0:r0 + w.shape[0]])
                r0 += w.shape[0]
    return out


def reference_logprobs(model_dir, token_ids, fp8=None, scale_dtype=None) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 log-probabilities of the checkpoint's BF16 weights, run
    by transformers' Llama in fp32 (``fp8=None``), or with every linear layer but the
    output head replaced by fp8linear's reference GEMM on the block-FP8 weights the plugin
    holds (``fp8="checkpoint"`` or ``"online"``; ``scale_dtype`` rounds the scales as a
    checkpoint storing them in that dtype does)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config", None)
    sd = load_file(str(d / "model.safetensors"))
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    if fp8 is not None:
        for i, layer in enumerate(model.model.layers):
            for name, (q, s) in _fp8_groups(sd, f"model.layers.{i}.", fp8 == "online",
                                            scale_dtype).items():
                kind, proj = name.split(".")
                setattr(getattr(layer, kind), proj, _Fp8Linear(q, s))
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)])).logits[0]
    return logits.float().log_softmax(-1)


def expected_digests(model_dir, fp8: str, scale_dtype=None) -> dict:
    """{vLLM layer name: float64 (sum, sum of squares, sum of |.|) of its dequantized
    weight} for the FP8 weights the plugin should hold (see engine_runner.inspect_model)."""
    from safetensors.torch import load_file

    from fp8linear.quant import dequantize_weight

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    sd = load_file(str(d / "model.safetensors"))
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "self_attn.o_proj": ("self_attn.o_proj",),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "mlp.down_proj": ("mlp.down_proj",)}
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        groups = _fp8_groups(sd, f"model.layers.{i}.", fp8 == "online", scale_dtype)
        for name, parts in fused.items():
            w = torch.cat([dequantize_weight(*groups[p]) for p in parts]).double()
            out[f"model.layers.{i}.{name}"] = [float(w.sum()), float((w * w).sum()),
                                               float(w.abs().sum())]
    return out

