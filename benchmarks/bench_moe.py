"""Block-FP8 MoE layer: fp8linear's fused_moe against vLLM's fused-MoE kernels, on one GPU.

One point = (model, M). Every method runs the whole expert part of a layer (activation
quantization, gate_up, SiLU-and-mul, down, the top-k weighted sum) from bf16 tokens and
routing to bf16 output. Each is timed as a CUDA graph of LAUNCHES calls, each call routed by
its own uniform-random top-k ids (the same ids for every method), the methods' graphs
replayed in turn (benchmarks/common.py), median over replays. Replayed in turn, methods share
one clock: at the power cap that flatters the one that draws more power. --sustained S also
replays each graph alone for S seconds from --sustained-from tokens (us_sustained, with the
SM clock and power sampled), as a model's prefill runs its layers back to back.

Floor of a point = max(bytes of the experts its calls touch / read bandwidth, FLOPs / peak):
the read bandwidth and the peak (our dense GEMM at 8192 x 8192 x 4096) are measured in the
same run.

    python benchmarks/bench_moe.py --out results.json [--models qwen3_30b_a3b,...] [--ms 1,4]

Methods: fp8linear_moe (fp8linear.fused_moe); vllm_triton_moe (vLLM's Triton fused MoE,
torch.ops.vllm.fused_experts, with its tuned config for the shape and GPU where vLLM ships
one, else its default: the row's `config` says which); vllm_deepgemm_moe (vLLM's DeepGEMM
MoE experts, DeepGemmExperts in its modular kernel: DeepGEMM's m-grouped contiguous GEMMs
over rows padded to 128 an expert, with vLLM's permutation, SiLU-and-mul + quantization and
combine; the weights prepared as vLLM prepares them). vLLM runs DeepGEMM only where it takes
the shape (from 128 tokens, intermediate > 512) and its Triton MoE below: the DeepGEMM
method has rows only where it ran. The vLLM methods need vLLM (the DeepGEMM one its DeepGEMM).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import common as C
import fp8linear

MODELS = {  # experts, top_k, hidden, expert intermediate
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "qwen3_235b_a22b": (128, 8, 4096, 1536),
    "deepseek_v3": (256, 8, 7168, 2048),
    "mixtral_8x7b": (8, 2, 4096, 14336),
}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
LAUNCHES = 16
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--methods", default="fp8linear_moe,vllm_triton_moe,vllm_deepgemm_moe")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--explore-tiles", default="",
                   help="e.g. 64,128: also fp8linear_moe@t<tile> (token tile forced) at M >= 128")
    p.add_argument("--explore-prefill", action="store_true",
                   help="also fp8linear_moe@prefill / @decode (the prefill kernel forced on / "
                        "off) at M >= 64")
    p.add_argument("--explore-pdl", action="store_true",
                   help="also fp8linear_moe@nopdl (the grouped GEMMs without PDL)")
    p.add_argument("--explore-slots", action="store_true",
                   help="also fp8linear_moe@slots / @sorted (the slot tiles forced on / off) "
                        "at M <= 8")
    p.add_argument("--explore-group-m", default="",
                   help="e.g. 1,8: also fp8linear_moe@g<band> (the prefill kernel's tile order "
                        "band forced) at M >= 256")
    p.add_argument("--sustained", type=float, default=0.0, metavar="S",
                   help="also replay each method's graph alone for S seconds per point (rows: "
                        "us_sustained, clock_mhz_sustained, power_w_sustained)")
    p.add_argument("--sustained-from", type=int, default=1024, metavar="M",
                   help="the points --sustained times (the compute-bound ones)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def random_experts(e: int, n: int, k: int, gen: torch.Generator):
    """[E, N, K] fp8 with 128x128 block scales, made expert by expert (bounded memory)."""
    w = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device="cuda")
    for i in range(e):
        w[i] = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(
            torch.float8_e4m3fn)  # (past 448 the cast gives NaN)
    s = torch.rand(e, cdiv(n, 128), cdiv(k, 128), device="cuda", generator=gen) * 1e-4
    return w, s + 1e-5


def routings(m: int, e: int, k: int, gen: torch.Generator):
    """LAUNCHES uniform-random top-k routings: (ids int32 [M, k], softmax weights fp32)."""
    out = []
    for _ in range(LAUNCHES):
        logits = torch.rand(m, e, device="cuda", generator=gen)
        w, ids = torch.topk(logits, k, dim=1)
        out.append((ids.to(torch.int32).contiguous(), torch.softmax(w, 1).contiguous()))
    return out


def vllm_config(e: int, inter: int) -> str:
    from vllm.model_executor.layers.fused_moe import fused_moe as fm
    name = fm.get_config_file_name(e, inter, "fp8_w8a8", [128, 128])
    path = os.path.join(os.path.dirname(fm.__file__), "configs", name)
    return f"tuned: {name}" if os.path.exists(path) else "default (no tuned file for this shape)"


class VllmDeepGemm:
    """vLLM's DeepGEMM MoE experts for one model's weights: its modular kernel (no-EP
    prepare/finalize, DeepGemmExperts), the weights through vLLM's DeepGEMM preparation."""

    def __init__(self, e: int, k: int, h: int, inter: int, w13, s13, w2, s2):
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (
            FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType,
            fp8_w8a8_moe_quant_config)
        from vllm.model_executor.layers.fused_moe.experts import deep_gemm_moe as dg
        from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
            MoEPrepareAndFinalizeNoDPEPModular)
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            prepare_fp8_moe_layer_for_deepgemm)
        from vllm.v1.worker import workspace
        if not workspace.is_workspace_manager_initialized():
            workspace.init_workspace_manager(torch.device("cuda"))
        self.w13, self.w2, s13, s2 = prepare_fp8_moe_layer_for_deepgemm(
            w13, w2, s13, s2, (128, 128))
        moe = FusedMoEConfig(
            num_experts=e, experts_per_token=k, hidden_dim=h, intermediate_size=inter,
            num_local_experts=e, num_logical_experts=e, activation=MoEActivation.SILU,
            device="cuda", routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
            in_dtype=torch.bfloat16)
        quant = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[128, 128])
        self.kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                                        dg.DeepGemmExperts(moe, quant))
        self.e, self.silu, self.valid = e, MoEActivation.SILU, dg._valid_deep_gemm

    def takes(self, x) -> bool:
        return self.valid(x, self.w13, self.w2)

    def __call__(self, x, weights, ids):
        return self.kernel.apply(hidden_states=x, w1=self.w13, w2=self.w2,
                                 topk_weights=weights, topk_ids=ids, activation=self.silu,
                                 global_num_experts=self.e, expert_map=None,
                                 apply_router_weight_on_input=False)


def make_call(method, x, w13, s13, w2, s2, routes, deepgemm=None):
    if method == "fp8linear_moe":
        return lambda i: fp8linear.fused_moe(x, w13, s13, w2, s2, routes[i][1], routes[i][0])
    if method.startswith("fp8linear_moe@"):  # a plan piece forced (exploration)
        from fp8linear.backends.sm90 import moe_plan
        over = forced_pieces(method.split("@")[1])

        def call(i):
            with moe_plan.forced(**over):
                return fp8linear.fused_moe(x, w13, s13, w2, s2, routes[i][1], routes[i][0])
        return call
    if method == "vllm_deepgemm_moe":
        return lambda i: deepgemm(x, routes[i][1], routes[i][0])
    if method == "vllm_triton_moe":
        return lambda i: torch.ops.vllm.fused_experts(
            hidden_states=x, w1=w13, w2=w2, topk_weights=routes[i][1], topk_ids=routes[i][0],
            activation="silu", use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2,
            block_shape=[128, 128])
    raise ValueError(f"unknown method {method}")


# forced_pieces' words: a switch each, or a letter and a number
SWITCH_PIECES = {"nopdl": ("pdl", False), "unfused": ("fused_act", False),
                 "prefill": ("prefill", True), "decode": ("prefill", False),
                 "slots": ("slot_tiles", True), "sorted": ("slot_tiles", False),
                 "tileroute": ("tile_route", True), "notileroute": ("tile_route", False),
                 "tokenrows": ("token_rows", True), "notokenrows": ("token_rows", False),
                 "downroute": ("down_route", True), "nodownroute": ("down_route", False)}
NUMBER_PIECES = {"t": "token_tile", "g": "group_m", "c": "prefill_config", "s": "splits",
                 "w": "window", "k": "ctas"}


def forced_pieces(pieces: str) -> dict:
    """The plan pieces an exploration method forces (backends/sm90/moe_plan.py ``forced``), joined
    by "+": t<tile>, nopdl, prefill / decode, slots / sorted, g<band>, c<config> (the prefill
    kernel's tile), s<splits> (the decode kernel's K splits), w<window> (the decode kernel's
    weight stages in flight, 0: its whole ring), unfused (the prefill kernel's gate_up
    without its SiLU-and-mul epilogue), tileroute / notileroute (moe-tile-route), tokenrows /
    notokenrows (moe-token-rows), downroute / nodownroute (moe-down-route), k<ctas> (the
    decode kernel's CTAs an SM)."""
    over = {}
    for piece in pieces.split("+"):
        if piece in SWITCH_PIECES:
            key, value = SWITCH_PIECES[piece]
            over[key] = value
        elif piece[:1] in NUMBER_PIECES and piece[1:].isdigit():
            over[NUMBER_PIECES[piece[0]]] = int(piece[1:])
        else:
            raise ValueError(f"unknown forced piece {piece!r}")
    return over


def peak_tflops() -> float:
    m = n = 8192
    k = 4096
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    a_s = torch.rand(m, k // 128, device="cuda") + 0.5
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    w_s = torch.rand(n // 128, k // 128, device="cuda") + 0.5
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    g = C.capture_graph(lambda i: fp8linear.block_fp8_gemm(a, a_s, w, w_s, out=out), 4)
    us = C.median(C.time_graphs_interleaved({"g": g}, 10)["g"]) / 4
    return 2 * m * n * k / (us * 1e-6) / 1e12


def _version(dist: str) -> str | None:
    try:
        import importlib.metadata as md
        return md.version(dist)
    except Exception:  # noqa: BLE001
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    methods = args.methods.split(",")
    if "vllm_triton_moe" in methods:
        import vllm.model_executor.layers.fused_moe.fused_moe  # noqa: F401  (registers the op)
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "date": C.utc_now(), "command": C.command_line(),
              "git_commit": C.git_commit(), "launches_per_graph": LAUNCHES,
              "vllm": _version("vllm")}
    header |= C.measure_read_bandwidth()
    header["peak_tflops"] = peak_tflops()
    log(f"read {header['read_bw_gbps']:.0f} GB/s, peak {header['peak_tflops']:.0f} TFLOPS")
    rows = []
    sampler = C.ClockSampler() if args.sustained > 0 else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model in args.models.split(","):
        e, k, h, inter = MODELS[model]
        w13, s13 = random_experts(e, 2 * inter, h, gen)
        w2, s2 = random_experts(e, h, inter, gen)
        config = vllm_config(e, inter) if "vllm_triton_moe" in methods else ""
        deepgemm = (VllmDeepGemm(e, k, h, inter, w13, s13, w2, s2)
                    if "vllm_deepgemm_moe" in methods else None)
        expert_bytes = 3 * inter * h
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16)
            routes = routings(m, e, k, gen)
            touched = sum(ids.unique().numel() for ids, _ in routes) / LAUNCHES
            floor = max(touched * expert_bytes / (header["read_bw_gbps"] * 1e3),
                        2 * m * k * expert_bytes / (header["peak_tflops"] * 1e6))
            graphs, outs = {}, {}
            extra = [f"fp8linear_moe@t{t}" for t in args.explore_tiles.split(",") if t and
                     m >= 128] + (["fp8linear_moe@nopdl"] if args.explore_pdl else []) + (
                ["fp8linear_moe@prefill", "fp8linear_moe@decode"]
                if args.explore_prefill and m >= 64 else []) + (
                ["fp8linear_moe@slots", "fp8linear_moe@sorted"]
                if args.explore_slots and m <= 8 else []) + [
                f"fp8linear_moe@g{g}" for g in args.explore_group_m.split(",") if g and
                m >= 256]
            here = [n for n in methods if n != "vllm_deepgemm_moe" or deepgemm.takes(x)]
            for meth in here + extra:
                call = make_call(meth, x, w13, s13, w2, s2, routes, deepgemm)
                outs[meth] = call(0).clone()  # (vLLM returns a reused buffer)
                graphs[meth] = C.capture_graph(call, LAUNCHES)
            base = outs[methods[0]].float()
            ref = None
            if m <= 64:  # the reference path, for the first call's routing (host loops)
                ref = fp8linear.moe_reference(x, w13, s13, w2, s2, routes[0][1],
                                              routes[0][0]).float()
            times = C.time_graphs_interleaved(graphs, args.replays)
            alone = ({meth: C.replay_alone(g, args.sustained, sampler)
                      for meth, g in graphs.items()}
                     if sampler is not None and m >= args.sustained_from else {})
            for meth in here + extra:
                us = C.median(times[meth]) / LAUNCHES
                err = float((outs[meth].float() - base).norm() / base.norm())
                err_ref = None if ref is None else float((outs[meth].float() - ref).norm()
                                                         / ref.norm())
                rows.append({"method": meth, "model": model, "E": e, "top_k": k, "H": h,
                             "I": inter, "M": m, "us": us, "floor_us": floor,
                             "pct_floor": 100 * floor / us, "experts_touched": touched,
                             "config": (config if meth == "vllm_triton_moe" else
                                        "DeepGEMM m-grouped contiguous, 128-row alignment"
                                        if meth == "vllm_deepgemm_moe" else "fp8linear plan"),
                             "rel_diff_vs_first": err, "rel_err_vs_reference": err_ref})
                if meth in alone:
                    rows[-1] |= {"us_sustained": alone[meth]["us"] / LAUNCHES,
                                 "clock_mhz_sustained": alone[meth]["clock_mhz"],
                                 "power_w_sustained": alone[meth]["power_w"]}
                log(f"{model:16s} M={m:5d} {meth:16s} {us:9.1f} us  floor {floor:8.1f} "
                      f"({100 * floor / us:5.1f}%)  diff {err:.1e} vs ref {err_ref}" + (
                          f"  alone {rows[-1]['us_sustained']:.1f} us at "
                          f"{rows[-1]['clock_mhz_sustained']:.0f} MHz" if meth in alone else ""))
            del graphs, outs
            C.write_json(args.out, header, rows)
        del w13, s13, w2, s2, deepgemm
        torch.cuda.empty_cache()
    if sampler is not None:
        sampler.stop()
    print(summary(rows, methods))
    return 0


def _vs_best_vllm(by: dict, key: str) -> str:
    """fp8linear's speedup over the faster vLLM method of a point by the rows' ``key``."""
    vllm = [r[key] for meth, r in by.items() if meth.startswith("vllm") and key in r]
    ours = by.get("fp8linear_moe", {}).get(key)
    return f"{min(vllm) / ours:.2f}x" if vllm and ours else ""


def summary(rows, methods) -> str:
    """Per model and M: each method's µs and its speedup over the best vLLM method (and, where
    --sustained timed the point, the same with each method alone)."""
    methods = list(dict.fromkeys(list(methods) + [r["method"] for r in rows]))
    lines = ["model            M      " + "  ".join(f"{m:>16s}" for m in methods)
             + "  fp8linear vs best vLLM"]
    keys = sorted({(r["model"], r["M"]) for r in rows}, key=lambda t: (t[0], t[1]))
    for model, m in keys:
        by = {r["method"]: r for r in rows if r["model"] == model and r["M"] == m}
        alone = _vs_best_vllm(by, "us_sustained")
        lines.append(f"{model:16s} {m:5d}  " + "  ".join(
            f"{by[x]['us']:9.1f} ({by[x]['pct_floor']:3.0f}%)" if x in by else f"{'':>16s}"
            for x in methods) + f"  {_vs_best_vllm(by, 'us')}"
            + (f" (alone {alone})" if alone else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
