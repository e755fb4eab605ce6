#!/usr/bin/env python3
"""End-to-end decode throughput of a Llama-style decoder in plain PyTorch (issue 6, part 2):
BF16 nn.Linear vs fp8linear.FP8Linear vs torch's blockwise-scaled cuBLASLt _scaled_mm.

The model: Llama-3.1-8B-shaped layers (hidden 4096, 32 query / 8 KV heads of 128, FFN 14336,
vocab 128256, RMSNorm, RoPE), --layers of them (default 8, to fit the device's time; the
32-layer numbers scale the layer part by 4), seeded random weights, embeddings and lm_head in
BF16. Fused projections as vLLM builds them: qkv [6144, 4096], o [4096, 4096],
gate_up [28672, 4096], down [4096, 14336]. Static KV cache, SDPA attention (decode folds the
4 query heads of each KV head into SDPA's query-length axis, so GQA needs no K/V copies),
greedy argmax; one decode step (all layers + lm_head + argmax) is captured as a CUDA graph.

Variants (they share the same FP8 weights; BF16 keeps its own):
- bf16:      nn.Linear-equivalent F.linear on the BF16 weights;
- fp8linear: fp8linear.FP8Linear (activation quantization fused in its op);
- scaled_mm: torch._scaled_mm (cuBLASLt, 1x128 activation / 128x128 weight block scales),
             probed the way benchmarks/bench_gemm.py does (its cublas_call helper), M padded
             to a multiple of 4, activations quantized by fp8linear's one-kernel Triton quant
             (torch ops where Triton is absent), scales transposed to the M-major layout
             cuBLASLt wants. Dropped, with the reason printed, where the API is missing.

Measured per variant and batch (default 1, 4, 16, 64), after a BF16 prefill of --prompt-len
tokens fills the cache: the graph replay time of one decode step (median of --replays
interleaved replays, the three variants' graphs taking turns), tokens/s = batch / step time,
and the step's logits against the BF16 variant's (relative error, argmax agreement).
Also: the eager (no graph) decode step at batch 1, and each variant's eager-mode host overhead
per linear call at M=1 on the 4096x4096 o_proj: --eager-calls eager calls between two
torch.cuda.synchronize() (per call), minus the same calls replayed from a CUDA graph.

Everything is time-boxed (--budget-s): points that would start past the budget are skipped
and listed; the JSON (header: device, torch, date, command) and the PNG are always written.

  python benchmarks/e2e_decoder.py                          # H100, ~1 min
  python benchmarks/e2e_decoder.py --device cpu --tiny      # plumbing check on a CPU
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import common as C  # noqa: E402  (benchmarks/common.py, beside this script)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

T_START = time.time()
VARIANTS = ("bf16", "fp8linear", "scaled_mm")

LLAMA8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256,
               layers=8, rope_theta=500000.0, eps=1e-5)
TINY = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=384, vocab=1000, layers=2,
            rope_theta=10000.0, eps=1e-5)


def log(*a):
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


# ------------------------------------------------------------------------------ weights
def make_weights(cfg: dict, device, seed: int = 0) -> dict:
    """Seeded random BF16 weights, HF-Llama-like init (std 0.02, norms 1 with some spread)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, d = cfg["hidden"], cfg["head_dim"]
    nq, nkv, f = cfg["heads"] * d, cfg["kv_heads"] * d, cfg["ffn"]

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, device=device, generator=g) * std).to(torch.bfloat16)

    def norm_w(n):
        return (1.0 + 0.1 * torch.randn(n, device=device, generator=g)).to(torch.bfloat16)

    layers = []
    for _ in range(cfg["layers"]):
        layers.append({"qkv": rnd(nq + 2 * nkv, h), "o": rnd(h, nq),
                       "gate_up": rnd(2 * f, h), "down": rnd(h, f),
                       "in_norm": norm_w(h), "post_norm": norm_w(h)})
    return {"embed": rnd(cfg["vocab"], h, std=1.0), "layers": layers, "norm": norm_w(h),
            "lm_head": rnd(cfg["vocab"], h)}


def quantize_weights(w: dict) -> list[dict]:
    """Block-FP8 copies of the four linear weights of every layer: {name: (q, scale_inv)}."""
    import fp8linear
    out = []
    for lw in w["layers"]:
        out.append({k: fp8linear.quantize_weight(lw[k]) for k in ("qkv", "o", "gate_up", "down")})
    return out


# ------------------------------------------------------------------------ linear layers
class BF16Linear(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = w

    def forward(self, x):
        return F.linear(x, self.weight)


def make_fp8linear(q, s):
    import fp8linear
    mod = fp8linear.FP8Linear(q.shape[1], q.shape[0], bias=False, device=q.device)
    mod.weight.data = q          # shared with the scaled_mm variant, no copy
    mod.weight_scale_inv.data = s
    return mod


class ScaledMMLinear(nn.Module):
    """torch._scaled_mm with blockwise scales (cuBLASLt): what a torch-only user can run."""

    def __init__(self, q, s, cublas_variant, quant):
        super().__init__()
        self.w, self.ws, self.variant, self.quant = q, s, cublas_variant, quant

    def forward(self, x):
        from bench_gemm import cublas_call
        n, k = self.w.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        mp = -(-m // 4) * 4
        if mp != m:
            x2 = F.pad(x2, (0, 0, 0, mp - m))
        elif not x2.is_contiguous():
            x2 = x2.contiguous()
        a, sa = self.quant(x2)
        sa = sa.t().contiguous().t()            # [Mp, Kb], strides (1, Mp)
        y = cublas_call(self.variant, a, sa, self.w, self.ws)
        return (y[:m] if mp != m else y).view(*lead, n)


def pick_quant(device):
    """The activation quantizer of the scaled_mm variant: one Triton kernel on a GPU."""
    import fp8linear
    if device.type == "cuda":
        try:
            from fp8linear.backends.triton import quant as triton_quant
            return triton_quant.quantize_activation, "fp8linear Triton quant kernel (1 launch)"
        except Exception as e:  # noqa: BLE001
            log(f"scaled_mm: Triton quant unavailable ({type(e).__name__}: {e}); torch ops")
    return fp8linear.quantize_activation, "fp8linear.quantize_activation (torch ops)"


def probe_scaled_mm(device, quant) -> tuple[str | None, list[str]]:
    """Which cublas_call variant (bench_gemm.py) computes blockwise _scaled_mm right here."""
    try:
        from bench_gemm import cublas_call  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return None, [f"bench_gemm.cublas_call not importable: {type(e).__name__}: {e}"]
    import fp8linear
    notes = []
    g = torch.Generator(device=device).manual_seed(123)
    w = torch.randn(256, 512, device=device, generator=g) * 0.02
    q, s = fp8linear.quantize_weight(w)
    wd = fp8linear.dequantize_weight(q, s)
    for variant in ("v1", "v2"):
        ok = True
        for m in (1, 37):
            x = torch.randn(m, 512, device=device, generator=g).to(torch.bfloat16)
            xq, xs = fp8linear.quantize_activation(x)
            ref = fp8linear.dequantize_activation(xq, xs) @ wd.t()
            try:
                y = ScaledMMLinear(q, s, variant, quant)(x).float()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                err = float((y - ref).norm() / ref.norm())
                notes.append(f"{variant} M={m}: rel_err {err:.2e}")
                ok = ok and err <= 2e-3
            except Exception as e:  # noqa: BLE001
                notes.append(f"{variant} M={m}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}")
                ok = False
            if not ok:
                break
        if ok:
            return variant, notes
    return None, notes


# ------------------------------------------------------------------------------- model
def rms_norm(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [..., T, D] (any heads axis before T), cos/sin [T, D] fp32."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class KVCache:
    def __init__(self, cfg, batch, max_seq, device):
        shape = (batch, cfg["kv_heads"], max_seq, cfg["head_dim"])
        self.k = [torch.zeros(shape, dtype=torch.bfloat16, device=device)
                  for _ in range(cfg["layers"])]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16, device=device)
                  for _ in range(cfg["layers"])]
        self.batch, self.max_seq = batch, max_seq


class Layer(nn.Module):
    def __init__(self, cfg, lw, linears):
        super().__init__()
        self.cfg = cfg
        self.qkv, self.o, self.gate_up, self.down = (linears[k] for k in
                                                      ("qkv", "o", "gate_up", "down"))
        self.in_norm, self.post_norm = lw["in_norm"], lw["post_norm"]

    def _mlp(self, x):
        h = rms_norm(x, self.post_norm, self.cfg["eps"])
        g, u = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)

    def decode(self, x, cos, sin, pos, mask, kc, vc):
        """x [B, hidden] at position pos (a [1] long tensor): one token per sequence."""
        c = self.cfg
        b, nh, nkv, d = x.shape[0], c["heads"], c["kv_heads"], c["head_dim"]
        h = rms_norm(x, self.in_norm, c["eps"])
        q, k, v = self.qkv(h).split([nh * d, nkv * d, nkv * d], dim=-1)
        q = apply_rope(q.view(b, nkv, nh // nkv, d), cos, sin)   # [B, KV, G, D]
        k = apply_rope(k.view(b, nkv, 1, d), cos, sin)           # [B, KV, 1, D]
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v.view(b, nkv, 1, d))
        att = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)  # [B, KV, G, D]
        x = x + self.o(att.reshape(b, nh * d))
        return self._mlp(x)

    def prefill(self, x, cos, sin, kc, vc):
        """x [B, T, hidden] at positions 0..T-1 (causal); fills kc/vc[:, :, :T]."""
        c = self.cfg
        b, t = x.shape[:2]
        nh, nkv, d = c["heads"], c["kv_heads"], c["head_dim"]
        h = rms_norm(x, self.in_norm, c["eps"])
        q, k, v = self.qkv(h).split([nh * d, nkv * d, nkv * d], dim=-1)
        q = apply_rope(q.view(b, t, nh, d).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, t, nkv, d).transpose(1, 2), cos, sin)
        v = v.view(b, t, nkv, d).transpose(1, 2)
        kc[:, :, :t].copy_(k)
        vc[:, :, :t].copy_(v)
        rep = nh // nkv
        att = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1),
                                             v.repeat_interleave(rep, dim=1), is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, nh * d))
        return self._mlp(x)


class Decoder(nn.Module):
    def __init__(self, cfg, w, layer_linears, max_seq):
        super().__init__()
        self.cfg = cfg
        self.embed, self.norm, self.lm_head = w["embed"], w["norm"], w["lm_head"]
        self.layers = nn.ModuleList(Layer(cfg, lw, lin)
                                    for lw, lin in zip(w["layers"], layer_linears))
        d = cfg["head_dim"]
        dev = self.embed.device
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, device=dev).float() / d))
        ang = torch.outer(torch.arange(max_seq, device=dev).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.cos, self.sin = ang.cos(), ang.sin()            # [S, D] fp32
        self.positions = torch.arange(max_seq, device=dev)

    def _head(self, x):
        logits = F.linear(rms_norm(x, self.norm, self.cfg["eps"]), self.lm_head)
        return logits.argmax(dim=-1), logits

    def step(self, tokens, pos, cache: KVCache):
        """One decode step: tokens [B] at position pos ([1] long tensor, same for the whole
        batch) -> (next tokens [B], logits [B, vocab]). Graph-capturable: no host syncs."""
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)   # [1, D]
        mask = (self.positions[: cache.max_seq] <= pos).view(1, 1, 1, -1)
        for i, layer in enumerate(self.layers):
            x = layer.decode(x, cos, sin, pos, mask, cache.k[i], cache.v[i])
        return self._head(x)

    def prefill(self, tokens, cache: KVCache):
        """tokens [B, T] at positions 0..T-1 -> (next tokens [B], last logits [B, vocab])."""
        t = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        for i, layer in enumerate(self.layers):
            x = layer.prefill(x, self.cos[:t], self.sin[:t], cache.k[i], cache.v[i])
        return self._head(x[:, -1])


def build_models(cfg, w, q, variants, cublas_variant, quant, max_seq) -> dict:
    models = {}
    for v in variants:
        lins = []
        for i, lw in enumerate(w["layers"]):
            if v == "bf16":
                lins.append({k: BF16Linear(lw[k]) for k in ("qkv", "o", "gate_up", "down")})
            elif v == "fp8linear":
                lins.append({k: make_fp8linear(*q[i][k]) for k in q[i]})
            elif v == "scaled_mm":
                lins.append({k: ScaledMMLinear(*q[i][k], cublas_variant, quant) for k in q[i]})
            else:
                raise ValueError(v)
        models[v] = Decoder(cfg, w, lins, max_seq)
    return models


def linear_weight_bytes(cfg, w, q, variant) -> int:
    """Bytes one decode step must read: the layers' linear weights (+ scales) and lm_head."""
    lm = w["lm_head"].numel() * 2
    if variant == "bf16":
        return lm + sum(t.numel() * 2 for lw in w["layers"]
                        for k, t in lw.items() if k in ("qkv", "o", "gate_up", "down"))
    return lm + sum(a.numel() + b.numel() * 4 for lq in q for a, b in lq.values())


# ---------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def capture(fn, device, warmup=3):
    """A CUDA graph of fn() (warm-up calls on a side stream first); on a CPU an eager
    stand-in with the same replay() interface. Returns (graph, outputs of the captured call)."""
    if device.type != "cuda":
        out = fn()
        return C.CpuGraph(lambda i: fn(), 1, None), out
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def host_overhead(mods: dict, x, device, calls: int, graph_calls: int = 100) -> list[dict]:
    """Per linear call at M=1: eager time between two synchronizes, graph time, and the
    host-only enqueue time of the eager loop."""
    rows = []
    for name, mod in mods.items():
        try:
            with torch.no_grad():
                for _ in range(20):
                    mod(x)
                sync(device)

                def many():
                    y = None
                    for _ in range(graph_calls):
                        y = mod(x)
                    return y
                g, _ = capture(many, device)
                best_graph = float("inf")
                for _ in range(5):
                    sync(device)
                    t0 = time.perf_counter()
                    g.replay()
                    sync(device)
                    best_graph = min(best_graph, (time.perf_counter() - t0) / graph_calls)
                best_eager, best_host = float("inf"), float("inf")
                for _ in range(3):
                    sync(device)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        mod(x)
                    t1 = time.perf_counter()
                    sync(device)
                    t2 = time.perf_counter()
                    best_eager = min(best_eager, (t2 - t0) / calls)
                    best_host = min(best_host, (t1 - t0) / calls)
                del g
            rows.append({"variant": name, "eager_us": best_eager * 1e6,
                         "graph_us": best_graph * 1e6,
                         "overhead_us": (best_eager - best_graph) * 1e6,
                         "host_enqueue_us": best_host * 1e6})
        except Exception as e:  # noqa: BLE001
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
            log(f"host overhead {name}: {type(e).__name__}: {e}")
    return rows


# ------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    p.add_argument("--layers", type=int, help="decoder layers (default 8; --tiny 2)")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompt-len", type=int, default=128,
                   help="tokens prefilled before the timed decode steps")
    p.add_argument("--max-seq", type=int, default=256, help="KV cache length")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays per point")
    p.add_argument("--eager-calls", type=int, default=1000)
    p.add_argument("--budget-s", type=float, default=140.0,
                   help="no new point starts after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON path or folder (default benchmarks/results/<date>_"
                                 "e2e_decoder_<device>.json); the PNG goes beside it")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--table", metavar="JSON", help="print the table of an earlier run and exit")
    a = p.parse_args(argv)
    if a.tiny:
        a.prompt_len = min(a.prompt_len, 16)
        a.max_seq = min(a.max_seq, 32)
        a.replays = min(a.replays, 5)
        a.eager_calls = min(a.eager_calls, 50)
    return a


def device_slug(device) -> str:
    if device.type != "cuda":
        return "cpu"
    import re
    name = torch.cuda.get_device_name(0)
    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"\W+", "_", name)).lower()


def header(args, device, cfg) -> dict:
    h = {"benchmark": "e2e_decoder", "torch": torch.__version__, "date": C.utc_now(),
         "command": C.command_line(), "git_commit": C.git_commit(),
         "python": sys.version.split()[0]}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        h.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                 capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                 sm_count=p.multi_processor_count, memory_bytes=p.total_memory)
    else:
        h["device"] = "cpu (plumbing check only: timings meaningless)"
    h["model"] = dict(cfg, shape="tiny" if args.tiny else "Llama-3.1-8B layers",
                      note=(f"{cfg['layers']} of Llama-3.1-8B's 32 layers (seeded random "
                            f"weights), lm_head and embeddings BF16" if not args.tiny
                            else "tiny CPU smoke-test model"))
    h.update(prompt_len=args.prompt_len, max_seq=args.max_seq, replays=args.replays,
             timing=("one CUDA graph per (variant, batch) holding one decode step (all layers "
                     "+ lm_head + argmax) at position prompt_len; replays of the variants "
                     "interleaved; step_ms = median replay time; tok_s = batch / step time"))
    return h


def main(argv=None) -> int:
    global T_START  # the budget and the log's clock count from here, not from import
    T_START = time.time()
    args = parse_args(argv)
    if args.table:
        import json
        with open(args.table) as f:
            d = json.load(f)
        print(table(d["header"], d["rows"], d["header"]))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("e2e_decoder: no CUDA device (use --device cpu --tiny)", file=sys.stderr)
        return 2
    cfg = dict(TINY if args.tiny else LLAMA8B)
    if args.layers:
        cfg["layers"] = args.layers
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    variants = [v for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
    if args.prompt_len >= args.max_seq:
        raise SystemExit("--prompt-len must be < --max-seq")
    name = f"{C.utc_now()[:10]}_e2e_decoder_{device_slug(device)}.json"
    out = args.out or os.path.join(HERE, "results", name)
    if os.path.isdir(out):
        out = os.path.join(out, name)
    torch.manual_seed(args.seed)
    h = header(args, device, cfg)
    dropped, skipped, rows = {}, [], []
    result = {"rows": rows, "host_overhead": [], "eager_step": [], "errors": []}

    def save():
        h.update(variants=variants, dropped=dropped, skipped=skipped,
                 elapsed_s=round(time.time() - T_START, 1))
        C.write_json(out, dict(h, **{k: v for k, v in result.items() if k != "rows"}), rows)

    over = lambda: time.time() - T_START > args.budget_s  # noqa: E731
    with torch.no_grad():
        t = time.time()
        w = make_weights(cfg, device, args.seed)
        q = quantize_weights(w) if any(v != "bf16" for v in variants) else None
        sync(device)
        h["setup_weights_s"] = round(time.time() - t, 2)
        log(f"weights: {cfg['layers']} layers in {h['setup_weights_s']} s")
        quant, cublas_variant = None, None
        if "scaled_mm" in variants:
            quant, h["scaled_mm_quant"] = pick_quant(device)
            cublas_variant, h["scaled_mm_probe"] = probe_scaled_mm(device, quant)
            log(f"scaled_mm probe: {'; '.join(h['scaled_mm_probe'])}")
            if cublas_variant is None:
                dropped["scaled_mm"] = ("blockwise torch._scaled_mm unavailable or wrong here: "
                                        + "; ".join(h["scaled_mm_probe"]))
                log(f"dropping scaled_mm: {dropped['scaled_mm']}")
                variants.remove("scaled_mm")
            h["scaled_mm_cublas_variant"] = cublas_variant
        if device.type == "cuda":
            try:
                bw = C.measure_read_bandwidth(gib=1.0, iters=10)
                h["read_bw_gbps"] = bw["read_bw_gbps"]
            except Exception as e:  # noqa: BLE001
                log(f"read bandwidth: {e}")
        h["weight_bytes"] = {v: linear_weight_bytes(cfg, w, q, v) for v in variants}
        models = build_models(cfg, w, q, variants, cublas_variant, quant, args.max_seq)
        save()

        g = torch.Generator(device=device).manual_seed(args.seed + 1)
        for b in batches:
            if over():
                skipped.append(f"batch {b} (budget)")
                continue
            try:
                t = time.time()
                cache = KVCache(cfg, b, args.max_seq, device)
                prompt = torch.randint(0, cfg["vocab"], (b, args.prompt_len), device=device,
                                       generator=g)
                first, _ = models[variants[0]].prefill(prompt, cache)
                tokens = first.clone()
                pos = torch.tensor([args.prompt_len], device=device)
                graphs, outs = {}, {}
                for v in variants:
                    graphs[v], outs[v] = capture(lambda m=models[v]: m.step(tokens, pos, cache),
                                                 device)
                times = C.time_graphs_interleaved(graphs, args.replays)
                sync(device)
                ref = outs.get("bf16", outs[variants[0]])[1].float()
                for v in variants:
                    ms = C.median(times[v]) / 1e3
                    lg = outs[v][1].float()
                    row = {"variant": v, "batch": b, "step_ms": ms,
                           "step_ms_p10": C.percentile(times[v], 10) / 1e3,
                           "step_ms_p90": C.percentile(times[v], 90) / 1e3,
                           "tok_s": b / (ms * 1e-3),
                           "logits_rel_err_vs_bf16": float((lg - ref).norm() / ref.norm()),
                           "argmax_agree_vs_bf16": float((lg.argmax(-1) == ref.argmax(-1))
                                                         .float().mean())}
                    if h.get("read_bw_gbps"):
                        row["floor_ms"] = h["weight_bytes"][v] / (h["read_bw_gbps"] * 1e9) * 1e3
                        row["pct_floor"] = 100.0 * row["floor_ms"] / ms
                    rows.append(row)
                base = {r["variant"]: r for r in rows if r["batch"] == b}
                for v in variants:
                    if "bf16" in base:
                        base[v]["speedup_vs_bf16"] = base["bf16"]["step_ms"] / base[v]["step_ms"]
                log(f"batch {b}: " + ", ".join(f"{v} {base[v]['step_ms']:.3f} ms"
                                              for v in variants)
                    + f" ({time.time() - t:.1f} s)")
                if b == batches[0]:
                    # eager decode step (no graph), same inputs
                    for v in variants:
                        if over():
                            skipped.append(f"eager step {v} (budget)")
                            continue
                        m = models[v]
                        for _ in range(3):
                            m.step(tokens, pos, cache)
                        best = float("inf")
                        for _ in range(5 if device.type == "cuda" else 2):
                            sync(device)
                            t0 = time.perf_counter()
                            m.step(tokens, pos, cache)
                            sync(device)
                            best = min(best, time.perf_counter() - t0)
                        graph_ms = base[v]["step_ms"]
                        result["eager_step"].append({"variant": v, "batch": b,
                                                     "eager_ms": best * 1e3,
                                                     "graph_ms": graph_ms})
                del graphs, outs, cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"batch {b}: {type(e).__name__}: {e}")
                log(f"batch {b} failed:\n{traceback.format_exc()}")
            save()

        if over():
            skipped.append("host overhead (budget)")
        else:
            x = torch.randn(1, cfg["heads"] * cfg["head_dim"], device=device,
                            generator=g).to(torch.bfloat16)
            mods = {v: models[v].layers[0].o for v in variants}
            shape = tuple(w["layers"][0]["o"].shape)
            result["host_overhead"] = [dict(r, N=shape[0], K=shape[1], M=1) for r in
                                       host_overhead(mods, x, device, args.eager_calls)]
    save()
    log(f"wrote {out}")
    if not args.no_plot:
        try:
            png = plot(out)
            log(f"wrote {png}")
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {type(e).__name__}: {e}")
    print(table(h, rows, result))
    return 0 if rows and not result["errors"] else 1


# ------------------------------------------------------------------------ output
def table(h, rows, result) -> str:
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    lines = [f"e2e_decoder: {h.get('device')}, torch {h.get('torch')}, "
             f"{h['model']['layers']} layers ({h['model']['shape']})",
             "decode step (CUDA graph), ms per step | tokens/s | speedup vs bf16:"]
    lines.append(f"{'batch':>5} " + " ".join(f"{v:>24}" for v in variants))
    for b in sorted({r["batch"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["batch"] == b}
        cells = []
        for v in variants:
            r = by.get(v)
            cells.append(f"{'-':>24}" if r is None else
                         f"{r['step_ms']:7.3f} {r['tok_s']:9.0f} {r.get('speedup_vs_bf16', 0):5.2f}x")
        lines.append(f"{b:>5} " + " ".join(cells))
    if result.get("eager_step"):
        lines.append("eager decode step at batch " + str(result["eager_step"][0]["batch"]) + ": "
                     + ", ".join(f"{r['variant']} {r['eager_ms']:.2f} ms (graph "
                                 f"{r['graph_ms']:.2f})" for r in result["eager_step"]))
    for r in result.get("host_overhead", []):
        if "error" in r:
            lines.append(f"host overhead {r['variant']}: {r['error']}")
        else:
            lines.append(f"host overhead per call, M=1 {r['N']}x{r['K']}: {r['variant']:>9}: "
                         f"eager {r['eager_us']:7.1f} us - graph {r['graph_us']:6.1f} us = "
                         f"{r['overhead_us']:6.1f} us (host enqueue {r['host_enqueue_us']:.1f} us)")
    err = [f"{r['variant']}@{r['batch']}: {r['logits_rel_err_vs_bf16']:.3f}/"
           f"{r['argmax_agree_vs_bf16']:.2f}" for r in rows if r["variant"] != "bf16"]
    if err:
        lines.append("logits rel err / argmax agreement vs bf16: " + ", ".join(err))
    if h.get("dropped"):
        lines.append(f"dropped: {h['dropped']}")
    if h.get("skipped"):
        lines.append(f"skipped: {h['skipped']}")
    return "\n".join(lines)


def plot(json_path: str) -> str:
    import json
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(json_path) as f:
        d = json.load(f)
    h, rows = d["header"], d["rows"]
    style = {"bf16": ("tab:gray", "x"), "fp8linear": ("tab:red", "o"),
             "scaled_mm": ("tab:green", "v")}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for v in VARIANTS:
        rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["batch"])
        if rs:
            c, m = style[v]
            ax.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], marker=m, color=c,
                    label=v)
    ax.set_xscale("log", base=2)
    bs = sorted({r["batch"] for r in rows})
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decode tokens/s (CUDA graph)")
    ax.set_title(f"{h['model']['layers']}-layer Llama-3.1-8B-shaped decoder")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax = axes[1]
    ho = [r for r in h.get("host_overhead", []) if "error" not in r]
    if ho:
        xs = range(len(ho))
        ax.bar([i - 0.2 for i in xs], [r["eager_us"] for r in ho], 0.4, label="eager (synced)")
        ax.bar([i + 0.2 for i in xs], [r["graph_us"] for r in ho], 0.4, label="CUDA graph")
        ax.set_xticks(list(xs), [r["variant"] for r in ho])
        ax.set_ylabel("µs per linear call, M=1")
        ax.set_title(f"eager host overhead, {ho[0]['N']}x{ho[0]['K']}")
        ax.legend()
    fig.suptitle(f"{h.get('device')}, torch {h.get('torch')}, {h.get('date')}", fontsize=9)
    fig.tight_layout()
    png = os.path.splitext(json_path)[0] + ".png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


if __name__ == "__main__":
    sys.exit(main())
