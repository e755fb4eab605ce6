"""Functions engine_runner.py runs inside vLLM's model (LLM.apply_model): what each linear
layer holds and, on a GPU, which fp8linear backend its shapes dispatch to. A module of
their own so that they pickle by name into separate engine-core / worker processes."""
from __future__ import annotations


def inspect_model(model):
    """Every vLLM linear layer with its quant method, weight/scale shapes and call count;
    every MoE layer with its method, the class of its experts kernel and weight shapes."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase

    from fp8linear.quant import dequantize_weight
    rows = []
    for name, mod in model.named_modules():
        if isinstance(mod, RoutedExperts):
            qm = mod.quant_method
            kernel = getattr(qm, "moe_kernel", None)
            rows.append({
                "name": name, "cls": type(mod).__name__, "method": type(qm).__name__,
                "experts": type(kernel.fused_experts).__name__ if kernel else None,
                "weight": [str(mod.w13_weight.dtype), list(mod.w13_weight.shape),
                           list(mod.w2_weight.shape)],
                "scale": [list(getattr(mod, f"w{i}_{n}").shape) for i in (13, 2)
                          for n in ("weight_scale_inv", "weight_scale")
                          if hasattr(mod, f"w{i}_{n}")]})
            continue
        if not isinstance(mod, LinearBase):
            continue
        qm = mod.quant_method
        scale = getattr(mod, getattr(qm, "scale_name", "weight_scale_inv"), None)
        digest = None
        if scale is not None:
            # float64 sums of the dequantized weight: equal to the expected ones only if
            # every fp8 value met its own scale
            w = dequantize_weight(mod.weight.data, scale.data).double()
            digest = [float(w.sum()), float((w * w).sum()), float(w.abs().sum())]
        rows.append({
            "name": name, "cls": type(mod).__name__, "method": type(qm).__name__,
            "weight": [str(mod.weight.dtype), list(mod.weight.shape)],
            "scale": list(scale.shape) if scale is not None else None,
            "calls": getattr(qm, "calls", None), "digest": digest,
        })
    return rows


def check_layers_on_device(model):
    """GPU runs: which fp8linear backend each FP8 layer's shapes dispatch to, and how its
    output on the device compares with the torch reference GEMM on the CPU."""
    import torch

    from fp8linear import fp8_linear
    from fp8linear.backends import dispatch
    from fp8linear.quant import quantize_activation, reference_gemm
    from vllm.model_executor.layers.linear import LinearBase
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if not isinstance(mod, LinearBase) or not hasattr(qm, "scale_name"):
            continue
        w, s = mod.weight, getattr(mod, qm.scale_name)
        n, k = w.shape
        backends = {m: dispatch.backend_for(w.device, m, n, k).name for m in (1, 64, 512)}
        errs = {}
        for m in (3, 200):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            got = fp8_linear(x.to(w.device), w, s).float().cpu()
            xq, xs = quantize_activation(x)
            want = reference_gemm(xq, xs, w.cpu(), s.cpu(), out_dtype=torch.float32)
            errs[m] = float((got - want).norm() / want.norm())
        rows.append({"name": name, "backends": backends, "rel_err": errs,
                     "device": str(w.device)})
    return rows
