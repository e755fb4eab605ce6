"""One tensor-parallel rank of the layer tests: builds vLLM linear layers with the
fp8_blockgemm config, loads checkpoint tensors through vLLM's weight loaders (as a model's
load_weights does), processes them and runs a forward pass. Writes what came out as JSON;
the assertions live in test_vllm_layers.py.

usage: python tp_worker.py RANK WORLD_SIZE PORT OUT.json

All ranks build the same random checkpoint tensors (fixed seeds) and compute the expected
output of the whole, unsharded layer with fp8linear's reference GEMM; each rank reports the
part of it that it should hold, next to what the layer produced.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from fp8linear import fp8_linear, quantize_weight
from fp8linear.quant import dequantize_weight

M = 5  # tokens


def ckpt(n, k, seed):
    """A random 'checkpoint' matrix with per-64-row-band gains: (bf16, fp8, block scale)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    gain = torch.exp(torch.empty(-(-n // 64), 1).uniform_(-1.5, 1.5, generator=g))
    w = (w * gain.repeat_interleave(64, 0)[:n]).to(torch.bfloat16)
    q, s = quantize_weight(w)
    return w, q, s


def act(k, seed=100):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, k, generator=g).to(torch.bfloat16)


def load(param, tensor, *shard):
    param.weight_loader(param, tensor, *shard)


def finish(layer):
    layer.quant_method.process_weights_after_loading(layer)


def run(layer, x):
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def compare(got, want, layer, extra=None):
    got, want = got.float(), want.float()
    qm = layer.quant_method
    scale = getattr(layer, getattr(qm, "scale_name", "weight_scale_inv"))
    res = {
        "shape": list(got.shape), "want_shape": list(want.shape),
        "max_abs_diff": float((got - want).abs().max()) if got.shape == want.shape else None,
        "want_max": float(want.abs().max()),
        "weight_dtype": str(layer.weight.dtype), "scale_shape": list(scale.shape),
        "plan": qm.plan.describe() if getattr(qm, "plan", None) else None,
        "method": type(qm).__name__,
    }
    res.update(extra or {})
    return res


# ----------------------------------------------------------------------------- cases
def case_qkv(cfg, rank, tp, kv_heads, online=False):
    from vllm.model_executor.layers.linear import QKVParallelLinear
    hidden, hd, heads = 256, 64, 4
    layer = QKVParallelLinear(hidden, hd, heads, kv_heads, bias=False,
                              params_dtype=torch.bfloat16, quant_config=cfg,
                              prefix="model.layers.0.self_attn.qkv_proj")
    mats = {"q": ckpt(heads * hd, hidden, 1), "k": ckpt(kv_heads * hd, hidden, 2),
            "v": ckpt(kv_heads * hd, hidden, 3)}
    scale_name = getattr(layer.quant_method, "scale_name", "weight_scale_inv")
    for sid, (w, q, s) in mats.items():
        if online:
            load(layer.weight, w, sid)
        else:
            load(layer.weight, q, sid)
            load(getattr(layer, scale_name), s, sid)
    finish(layer)
    x = act(hidden)
    # this rank's rows of each projection: q split by heads; k/v by kv heads, replicated
    # across ranks when there are fewer kv heads than ranks
    q_rows = heads * hd // tp
    kv_per_rank = max(1, kv_heads // tp) * hd
    kv_start = (rank * kv_heads // tp if kv_heads >= tp else rank // (tp // kv_heads)) * hd
    parts = []
    for sid, (w, q, s) in mats.items():
        if online:
            continue
        y = fp8_linear(x, q, s)
        parts.append(y[:, rank * q_rows:(rank + 1) * q_rows] if sid == "q"
                     else y[:, kv_start:kv_start + kv_per_rank])
    if online:
        # online: the rank's fused [q; k; v] slice is quantized as one matrix
        w_rank = torch.cat([mats["q"][0][rank * q_rows:(rank + 1) * q_rows],
                            mats["k"][0][kv_start:kv_start + kv_per_rank],
                            mats["v"][0][kv_start:kv_start + kv_per_rank]])
        want = fp8_linear(x, *quantize_weight(w_rank))
    else:
        want = torch.cat(parts, dim=1)
    return compare(run(layer, x), want, layer)


def case_merged(cfg, rank, tp, inter=384, hidden=256, online=False):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    layer = MergedColumnParallelLinear(hidden, [inter, inter], bias=False,
                                       params_dtype=torch.bfloat16, quant_config=cfg,
                                       prefix="model.layers.0.mlp.gate_up_proj")
    mats = [ckpt(inter, hidden, 11), ckpt(inter, hidden, 12)]
    for i, (w, q, s) in enumerate(mats):
        if online:
            load(layer.weight, w, i)
        else:
            load(layer.weight, q, i)
            load(layer.weight_scale_inv, s, i)
    finish(layer)
    x = act(hidden)
    per = inter // tp
    if online:
        w_rank = torch.cat([w[rank * per:(rank + 1) * per] for w, _, _ in mats])
        want = fp8_linear(x, *quantize_weight(w_rank))
    else:
        want = torch.cat([fp8_linear(x, q, s)[:, rank * per:(rank + 1) * per]
                          for _, q, s in mats], dim=1)
    return compare(run(layer, x), want, layer)


def case_column(cfg, rank, tp, n=320, hidden=256):
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    layer = ColumnParallelLinear(hidden, n, bias=False, params_dtype=torch.bfloat16,
                                 quant_config=cfg, prefix="model.layers.0.mlp.col")
    w, q, s = ckpt(n, hidden, 21)
    load(layer.weight, q)
    load(layer.weight_scale_inv, s)
    finish(layer)
    x = act(hidden)
    per = n // tp
    want = fp8_linear(x, q, s)[:, rank * per:(rank + 1) * per]
    return compare(run(layer, x), want, layer)


def case_row(cfg, rank, tp, k=384, n=256, online=False):
    """RowParallelLinear with reduce_results=False: each rank's partial product."""
    from vllm.model_executor.layers.linear import RowParallelLinear
    layer = RowParallelLinear(k, n, bias=False, params_dtype=torch.bfloat16,
                              reduce_results=False, quant_config=cfg,
                              prefix="model.layers.0.mlp.down_proj")
    w, q, s = ckpt(n, k, 31)
    if online:
        load(layer.weight, w)
    else:
        load(layer.weight, q)
        load(layer.weight_scale_inv, s)
    finish(layer)
    x_full = act(k)
    per = k // tp
    cols = slice(rank * per, (rank + 1) * per)
    x = x_full[:, cols].contiguous()
    got = run(layer, x)
    # the definition of K re-blocking: the rank's columns of the dequantized checkpoint
    # weight (bf16 weight when online), requantized on a 128 grid from the first column
    src = w.float() if online else dequantize_weight(q, s)
    want = fp8_linear(x, *quantize_weight(src[:, cols]))
    # how far the rank's weight moved from the checkpoint's (re-blocking's extra error),
    # against the bound: half an e4m3 step at the new block's scale s, i.e.
    # max(2^-4 |w|, 2^-10 s) (the second term: near-zero values, e4m3's subnormal range)
    before = (w.float() if online else dequantize_weight(q, s))[:, cols]
    held = dequantize_weight(layer.weight, layer.weight_scale_inv)
    new_scale = dequantize_weight(torch.ones_like(held).to(layer.weight.dtype),
                                  layer.weight_scale_inv)
    bound = torch.maximum(before.abs() * 2 ** -4, new_scale * 2 ** -10)
    moved = (held - before).abs()
    extra = {"reblock_bound_ratio": float((moved / bound).max()),
             "reblock_changed_fraction": float((moved > 0).float().mean())}
    return compare(got, want, layer, extra)


def case_row_allreduce(cfg, rank, tp, k=384, n=256):
    """RowParallelLinear with the all-reduce: the sum of the ranks equals the whole layer
    up to re-blocking error."""
    from vllm.model_executor.layers.linear import RowParallelLinear
    layer = RowParallelLinear(k, n, bias=False, params_dtype=torch.bfloat16,
                              quant_config=cfg, prefix="model.layers.1.mlp.down_proj")
    w, q, s = ckpt(n, k, 41)
    load(layer.weight, q)
    load(layer.weight_scale_inv, s)
    finish(layer)
    x_full = act(k)
    per = k // tp
    got = run(layer, x_full[:, rank * per:(rank + 1) * per].contiguous())
    want = fp8_linear(x_full, q, s)
    # error against the exact product of the checkpoint's weights, TP=1 path vs this rank
    # count's sum (which adds K re-blocking and activation groups starting at each shard)
    exact = x_full.float() @ dequantize_weight(q, s).t()
    rel = lambda y: float((y.float() - exact).norm() / exact.norm())  # noqa: E731
    return compare(got, want, layer, {"rel_err": rel(got), "rel_err_unsharded": rel(want)})


def case_replicated(cfg, rank, tp, n=200, k=300):
    from vllm.model_executor.layers.linear import ReplicatedLinear
    layer = ReplicatedLinear(k, n, bias=False, params_dtype=torch.bfloat16,
                             quant_config=cfg, prefix="model.layers.0.mlp.gate")
    w, q, s = ckpt(n, k, 51)
    load(layer.weight, q)
    load(layer.weight_scale_inv, s)
    finish(layer)
    x = act(k)
    return compare(run(layer, x), fp8_linear(x, q, s), layer)


def case_custom_loader(cfg, rank, tp):
    """A layer class with its own weight loader: the plugin cannot re-slice its scales, so
    a misaligned shard must fail at construction (aligned ones load through vLLM's code)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    class CustomMerged(MergedColumnParallelLinear):
        def weight_loader_v2(self, param, loaded_weight, loaded_shard_id=None):
            return super().weight_loader_v2(param, loaded_weight, loaded_shard_id)

    try:
        layer = CustomMerged(256, [384, 384], bias=False, params_dtype=torch.bfloat16,
                             quant_config=cfg, prefix="model.layers.5.mlp.custom_up")
    except Exception as e:  # noqa: BLE001 (the error is the result)
        return {"raised": type(e).__name__, "message": str(e)}
    mats = [ckpt(384, 256, 61), ckpt(384, 256, 62)]
    for i, (_, q, s) in enumerate(mats):
        load(layer.weight, q, i)
        load(layer.weight_scale_inv, s, i)
    finish(layer)
    x = act(256)
    per = 384 // tp
    want = torch.cat([fp8_linear(x, q, s)[:, rank * per:(rank + 1) * per]
                      for _, q, s in mats], dim=1)
    return compare(run(layer, x), want, layer)


def case_bad_scale(cfg, value):
    """A scale the checkpoint lacks (value None) or holds inf: fails once, at load."""
    from vllm.model_executor.layers.linear import ReplicatedLinear
    layer = ReplicatedLinear(256, 256, bias=False, params_dtype=torch.bfloat16,
                             quant_config=cfg, prefix="model.layers.7.mlp.bad")
    _, q, s = ckpt(256, 256, 71)
    load(layer.weight, q)
    if value is not None:
        s = s.clone()
        s[1, 0] = value
        load(layer.weight_scale_inv, s)
    try:
        finish(layer)
    except Exception as e:  # noqa: BLE001 (the error is the result)
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def case_online_layerwise(cfg, rank, tp):
    """Online quantization happens per layer, the moment its last shard is loaded: before
    that the weight has no storage (meta device), after it the layer holds FP8 only."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    a, b = (MergedColumnParallelLinear(256, [384, 384], bias=False,
                                       params_dtype=torch.bfloat16, quant_config=cfg,
                                       prefix=f"model.layers.{i}.mlp.gate_up_proj")
            for i in (0, 1))
    state = {"created_on_meta": [a.weight.is_meta, b.weight.is_meta]}
    gate, up = ckpt(384, 256, 81)[0], ckpt(384, 256, 82)[0]
    load(a.weight, gate, 0)
    state["after_first_shard"] = [str(a.weight.device), hasattr(a, "weight_scale_inv")]
    load(a.weight, up, 1)  # the last shard: quantized now, no process_weights call needed
    state["after_last_shard"] = [str(a.weight.dtype), str(a.weight.device),
                                 list(a.weight_scale_inv.shape)]
    state["other_layer"] = [b.weight.is_meta]
    return state


def cases(rank, tp):
    from fp8linear_vllm.checkpoint_format import parse_quantization_config
    from fp8linear_vllm.config import Fp8BlockGemmConfig
    fp8 = Fp8BlockGemmConfig(parse_quantization_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128]}))
    online = Fp8BlockGemmConfig()
    return {
        "qkv_kv2": lambda: case_qkv(fp8, rank, tp, kv_heads=2),
        "qkv_kv1": lambda: case_qkv(fp8, rank, tp, kv_heads=1),
        "merged_384": lambda: case_merged(fp8, rank, tp, inter=384),
        "merged_256": lambda: case_merged(fp8, rank, tp, inter=256),
        "column_320": lambda: case_column(fp8, rank, tp),
        "row_384": lambda: case_row(fp8, rank, tp, k=384),
        "row_256": lambda: case_row(fp8, rank, tp, k=256),
        "row_384_allreduce": lambda: case_row_allreduce(fp8, rank, tp),
        "replicated": lambda: case_replicated(fp8, rank, tp),
        "online_qkv_kv1": lambda: case_qkv(online, rank, tp, kv_heads=1, online=True),
        "online_merged_384": lambda: case_merged(online, rank, tp, inter=384, online=True),
        "online_row_384": lambda: case_row(online, rank, tp, k=384, online=True),
        "custom_loader": lambda: case_custom_loader(fp8, rank, tp),
        "online_layerwise": lambda: case_online_layerwise(online, rank, tp),
        "missing_scale": lambda: case_bad_scale(fp8, None),
        "inf_scale": lambda: case_bad_scale(fp8, float("inf")),
    }


def main(rank: int, world: int, port: int, out_path: str) -> int:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (init_distributed_environment,
                                  initialize_model_parallel)

    import fp8linear_vllm
    fp8linear_vllm.register()
    # vLLM's CPU communicator names its shared-memory group after this (its CPU worker
    # sets it; a bare process must): the same value on every rank
    os.environ.setdefault("VLLM_DIST_IDENT", f"fp8linear-tp-test-{port}")
    results = {}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)
        torch.set_num_threads(1)
        for name, fn in cases(rank, world).items():
            try:
                results[name] = fn()
            except Exception:  # noqa: BLE001 (reported per case)
                results[name] = {"error": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
