"""A tiny Hugging Face-style checkpoint written by the tests (no downloads), and a torch
model with the same tensor names to load it into.

The checkpoint has what converters get wrong: a tied lm_head (no lm_head.weight on disk),
an MoE layer (router `mlp.gate` + per-expert 2-D weights), attention biases, norms, N and K
not multiples of 128, two shards with an index, tokenizer and generation files.
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

CONFIG = {
    "architectures": ["TinyMoeForCausalLM"], "model_type": "tiny_moe", "vocab_size": 320,
    "hidden_size": 192, "intermediate_size": 320, "moe_intermediate_size": 160,
    "num_hidden_layers": 2, "num_experts": 2, "kv_dim": 64, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
OTHER_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": "{}",
               "generation_config.json": '{"do_sample": false}'}


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
                * self.weight.float()).to(x.dtype)


class Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, kv = c["hidden_size"], c["kv_dim"]
        self.q_proj = nn.Linear(h, h, bias=True)
        self.k_proj = nn.Linear(h, kv, bias=True)
        self.v_proj = nn.Linear(h, kv, bias=True)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x):  # not attention, but every projection takes part
        kv = (self.k_proj(x) * torch.sigmoid(self.v_proj(x))).repeat(1, 1, 3)
        return self.o_proj(self.q_proj(x) + kv)


class MLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Linear(c["hidden_size"], c["num_experts"], bias=False)  # the router
        self.experts = nn.ModuleList(MLP(c["hidden_size"], c["moe_intermediate_size"])
                                     for _ in range(c["num_experts"]))

    def forward(self, x):
        p = torch.softmax(self.gate(x).float(), -1).to(x.dtype)
        return sum(p[..., e:e + 1] * ex(x) for e, ex in enumerate(self.experts))


class Layer(nn.Module):
    def __init__(self, c, moe):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"])
        self.self_attn = Attn(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"])
        self.mlp = MoE(c) if moe else MLP(c["hidden_size"], c["intermediate_size"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c, moe=i == 1) for i in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"])


class TinyMoeForCausalLM(nn.Module):
    def __init__(self, c=CONFIG):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def random_state(seed=0, dtype=torch.bfloat16):
    """Random weights (scaled so activations stay O(1)) under the checkpoint's names, tied
    lm_head left out as transformers leaves it out."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in TinyMoeForCausalLM().state_dict().items():
        if name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            v = 1 + 0.1 * torch.randn(t.shape, generator=g)
        elif t.dim() == 2 and "embed" not in name:
            v = torch.randn(t.shape, generator=g) / t.shape[1] ** 0.5
        else:
            v = torch.randn(t.shape, generator=g) * (0.1 if t.dim() == 1 else 1.0)
        state[name] = v.to(dtype)
    return state


def write_checkpoint(path, seed=0, dtype=torch.bfloat16, config=CONFIG) -> dict:
    """Two shards + index + config + tokenizer/generation files. Returns the tensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = random_state(seed, dtype)
    names = list(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, shard in shards.items():
        save_file({n: state[n] for n in shard}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
         "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    for name, text in OTHER_FILES.items():
        (path / name).write_text(text)
    return state


LINEAR_WEIGHTS = sorted(
    n for n in random_state() if n.endswith("_proj.weight"))  # incl. the experts' 2-D weights
ROUTERS = ["model.layers.1.mlp.gate.weight"]
