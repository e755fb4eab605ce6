"""Runs vLLM engines in a fresh process and writes what they produced as JSON.

usage: python engine_runner.py SPEC.json OUT.json

SPEC: {"runs": [{"name", "model", "quantization" (or null), "enforce_eager",
                 "prompt" (token ids), "max_tokens", "llm_kwargs" (optional),
                 "layer_check" (optional, GPU)}, ...],
       "forbid_reference": optional (GPU: the torch reference GEMM must not run)}
OUT:  {name: {"prompt_logprobs": [logprob of prompt token i+1 given tokens 0..i, ...],
              "prompt_top": [{token: logprob} top-5 at each prompt position, ...],
              "tokens": [greedy ids], "token_logprobs": [...], "token_top": [...],
              "layers": [{"name", "cls", "method", "weight", "scale", "calls",
                          "digest"}, ...],
              "start_s", "generate_s", "quant_fusion_rewrites"} or {"error": traceback}}

One process runs every engine in turn (import vLLM once: ~8 s on 2 cores); engines run
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with a small KV cache. The plugin registers
itself through its entry point, exactly as in production.
"""
from __future__ import annotations

import gc
import json
import sys
import time
import traceback


def forbid_reference_backend():
    """Any call of the torch reference GEMM or MoE with CUDA tensors raises: a GPU run that
    completes ran our CUDA/Triton kernels only."""
    from fp8linear import moe
    from fp8linear.backends import reference

    def refusing(fn):
        def call(*args, **kwargs):
            if any(getattr(a, "is_cuda", False) for a in args):
                raise RuntimeError("fp8linear's torch reference backend ran on a GPU tensor")
            return fn(*args, **kwargs)
        return call

    reference.gemm, reference.linear = refusing(reference.gemm), refusing(reference.linear)
    moe.moe_reference = refusing(moe.moe_reference)


def run_one(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    # imported from a module (not defined here, in __main__): apply_model pickles them by
    # name into the engine-core / worker processes when those are separate
    from model_inspect import check_layers_on_device, inspect_model

    kw = dict(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
              enforce_eager=spec.get("enforce_eager", True), max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=64 * 2**20,
              seed=0)
    if spec.get("quantization"):
        kw["quantization"] = spec["quantization"]
    kw.update(spec.get("llm_kwargs") or {})
    import torch
    from fp8linear_vllm.quant_fusion_pass import QuantFusionPass
    # (the engine core runs in this process: see above)
    fused0 = QuantFusionPass.norms + QuantFusionPass.acts
    t0 = time.time()
    llm = LLM(**kw)
    t1 = time.time()
    # GPU: the allocator's peak up to here (weights, profiling run, KV cache); the peak
    # right after loading is in vLLM's debug log (benchmarks/vllm_device reads it there)
    cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16),
                            logprobs=5, prompt_logprobs=5, detokenize=False, ignore_eos=True)
        prompt = spec["prompt"]
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        t2 = time.time()
        plp = out.prompt_logprobs  # [None, {tok: Logprob}, ...]
        res = {
            "prompt_logprobs": [plp[i][prompt[i]].logprob for i in range(1, len(prompt))],
            "prompt_top": [{str(t): lp.logprob for t, lp in plp[i].items()
                            if lp.rank is not None and lp.rank <= 5}
                           for i in range(1, len(prompt))],
            "tokens": list(out.outputs[0].token_ids),
            "token_logprobs": [d[t].logprob for d, t in zip(out.outputs[0].logprobs,
                                                            out.outputs[0].token_ids)],
            "token_top": [{str(t): lp.logprob for t, lp in d.items()
                           if lp.rank is not None and lp.rank <= 5}
                          for d in out.outputs[0].logprobs],
            "layers": llm.apply_model(inspect_model)[0],
            "device_layers": (llm.apply_model(check_layers_on_device)[0]
                              if spec.get("layer_check") else None),
            "start_s": round(t1 - t0, 1), "generate_s": round(t2 - t1, 2),
            "cuda_peak_after_start_bytes": cuda_peak,
            # producers the plugin's compile pass made quantize for our linears (compiled
            # engines with the pass installed)
            "quant_fusion_rewrites": QuantFusionPass.norms + QuantFusionPass.acts - fused0,
        }
    finally:
        del llm
        gc.collect()
        try:
            from vllm.distributed import cleanup_dist_env_and_memory
            cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001 (best effort between engines)
            pass
    return res


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    if spec.get("forbid_reference"):
        forbid_reference_backend()
    results = {}
    for run in spec["runs"]:
        try:
            results[run["name"]] = run_one(run)
        except Exception:  # noqa: BLE001 (reported per run, the others still run)
            results[run["name"]] = {"error": traceback.format_exc()}
        with open(out_path, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
