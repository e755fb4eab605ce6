"""`fp8linear demo`: a small seeded random Llama-style transformer, quantized with
quantize_model and compared with the original (memory, output error, and on CUDA speed).

The model is plain torch (no downloads, no transformers) with Llama's structure and names:
RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP, untied lm_head.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .module import fp8_modules, quantize_model


@dataclass
class DemoConfig:
    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    batch: int = 4
    seq_len: int = 128
    seed: int = 0
    rope_theta: float = 10000.0


# Large enough on a GPU that the GEMMs, not kernel launches, decide the time.
CUDA_CONFIG = DemoConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_layers=4, num_heads=32, num_kv_heads=8, batch=8, seq_len=512)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.h, self.kvh = cfg.num_heads, cfg.num_kv_heads
        self.d = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kvh, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kvh, self.d).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.h // self.kvh
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """Returns (final hidden states, logits)."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        d = cfg.hidden_size // cfg.num_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        freqs = torch.outer(torch.arange(t, device=ids.device).float(), self.inv_freq)
        dtype = self.embed_tokens.weight.dtype
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        h = self.norm(x)
        return h, self.lm_head(h)


def build_model(cfg: DemoConfig, device="cpu", dtype=torch.bfloat16) -> TinyLlama:
    """Seeded random weights with unit-variance activations: N(0, 1/fan_in) for linear
    layers (0.02 would shrink the residual stream to noise and make the comparison moot)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    model = TinyLlama(cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen)
                               / math.sqrt(m.in_features))
            elif isinstance(m, nn.Embedding):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen))
            elif isinstance(m, RMSNorm):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
    return model.to(device=device, dtype=dtype).eval()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float(torch.linalg.norm(a - ref) / torch.linalg.norm(ref))


def _time_ms(fn, reps: int = 10) -> float:
    """Median milliseconds per call on CUDA (events; warmed up first)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def run_demo(cfg: DemoConfig | None = None, device=None, dtype=torch.bfloat16,
             timing: bool | None = None) -> dict:
    """Build, quantize (lm_head stays bf16, as in DeepSeek-V3) and compare. Returns a dict."""
    t0 = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = cfg or (CUDA_CONFIG if device.type == "cuda" else DemoConfig())
    timing = device.type == "cuda" if timing is None else timing
    original = build_model(cfg, device, dtype)
    quantized = quantize_model(copy.deepcopy(original))
    layers = fp8_modules(quantized)

    linear_before = _bytes(m.weight for n, m in original.named_modules()
                           if isinstance(m, nn.Linear) and n in dict(layers))
    linear_after = _bytes(t for _, m in layers for t in (m.weight, m.weight_scale_inv))
    total_before = _bytes(original.parameters())
    total_after = _bytes(quantized.parameters())

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=gen)
    ids = ids.to(device)
    with torch.inference_mode():
        h_ref, logits_ref = original(ids)
        h_q, logits_q = quantized(ids)
        result = {
            "config": asdict(cfg), "device": str(device), "dtype": str(dtype).split(".")[-1],
            "quantized_layers": len(layers), "tokens": cfg.batch * cfg.seq_len,
            "linear_weight_bytes": (linear_before, linear_after),
            "model_bytes": (total_before, total_after),
            "hidden_rel_err": _rel_err(h_q, h_ref),
            "logits_rel_err": _rel_err(logits_q, logits_ref),
            "top1_agreement": float((logits_q.argmax(-1) == logits_ref.argmax(-1))
                                    .float().mean()),
            "time_ms": None,
        }
        if timing:
            result["time_ms"] = (_time_ms(lambda: original(ids)),
                                 _time_ms(lambda: quantized(ids)))
    result["wall_s"] = time.perf_counter() - t0
    return result


def format_report(r: dict) -> str:
    c = r["config"]
    mib = 2.0 ** 20
    lb, la = r["linear_weight_bytes"]
    mb, ma = r["model_bytes"]
    lines = [
        f"fp8linear demo: random Llama-style model, {c['num_layers']} layers, hidden "
        f"{c['hidden_size']}, MLP {c['intermediate_size']}, vocab {c['vocab_size']}, "
        f"seed {c['seed']}; {r['dtype']} on {r['device']}",
        f"quantized {r['quantized_layers']} linear layers to block FP8 (128x128 scales); "
        f"embeddings, norms and lm_head stay {r['dtype']}",
        f"  linear weights {lb / mib:8.2f} MiB -> {la / mib:8.2f} MiB  "
        f"(saved {lb - la:,} bytes, {1 - la / lb:.1%})",
        f"  whole model    {mb / mib:8.2f} MiB -> {ma / mib:8.2f} MiB  "
        f"(saved {1 - ma / mb:.1%})",
        f"output vs the {r['dtype']} original on {r['tokens']} tokens:",
        f"  logits relative error (Frobenius)  {r['logits_rel_err']:.4f}",
        f"  final hidden state relative error  {r['hidden_rel_err']:.4f}",
        f"  top-1 token agreement              {r['top1_agreement']:.1%}",
    ]
    if r["time_ms"]:
        to, tq = r["time_ms"]
        lines.append(f"speed, forward pass of {r['tokens']} tokens: {r['dtype']} {to:.2f} ms, "
                     f"fp8 {tq:.2f} ms ({to / tq:.2f}x)")
    else:
        lines.append("speed: not measured (no CUDA device; the CPU runs the torch reference "
                     "path, which is for correctness, not speed)")
    lines.append(f"done in {r['wall_s']:.1f} s")
    return "\n".join(lines)
