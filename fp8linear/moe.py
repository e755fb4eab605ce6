"""The block-FP8 mixture-of-experts layer's numerics: the definition every MoE backend meets.

For each token and each of its top-k experts e (weights w13[e] = [gate; up] and w2[e]):

1. the token's activations are quantized per 128 channels (``quantize_activation``);
2. gate_up = the block-FP8 GEMM with w13[e] (fp32 per K block, rounded to x's dtype);
3. h = SiLU(gate) * up in x's dtype, then quantized per 128 channels (``silu_mul_quant``'s
   numerics: the down projection's input);
4. y_e = the block-FP8 GEMM of h with w2[e], rounded to x's dtype (as gate_up: the bytes
   the layer writes and reads between the GEMM and the sum halve against fp32; the rounding
   is 2^-8 of an element, against the 2^-4 of h's fp8 quantization before);
5. out = sum over the k slots, in slot order, of topk_weight * y_e, in fp32, rounded once.

An expert id of -1 marks a slot whose expert this layer does not hold (expert parallelism:
another rank's): the slot is skipped, its weight unread.

``moe_reference`` runs anywhere (the CPU reference); it groups tokens by expert, as the
kernels do, which changes no result: each (token, slot) is computed on its own. ``fused_moe``
is the layer for serving: on Hopper our grouped expert GEMMs (backends/sm90/moe.py, with
moe_routing.py's stages), elsewhere the reference.
"""
from __future__ import annotations

import torch

from .backends import dispatch
from .quant import FP8_DTYPE, cdiv, quantize_activation, reference_gemm, silu_mul_reference

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, out=None):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be a 2-D [M, H] bf16/fp16/fp32 tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                         f"{' ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}")
    m, h = x.shape
    if w13.dim() != 3 or w13.dtype != FP8_DTYPE or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be float8_e4m3fn [E, 2*I, {h}], got {tuple(w13.shape)} "
                         f"{w13.dtype}")
    e, two_i, _ = w13.shape
    i = two_i // 2
    if w2.dim() != 3 or w2.dtype != FP8_DTYPE or tuple(w2.shape) != (e, h, i):
        raise ValueError(f"w2 must be float8_e4m3fn [{e}, {h}, {i}], got {tuple(w2.shape)} "
                         f"{w2.dtype}")
    for name, s, n, k in (("w13_scale", w13_scale, two_i, h), ("w2_scale", w2_scale, h, i)):
        shapes = ((e, cdiv(n, 128), cdiv(k, 128)), (e, n, cdiv(k, 128)))
        if s.dtype != torch.float32 or tuple(s.shape) not in shapes:
            raise ValueError(f"{name} must be fp32 of shape {shapes[0]} (128x128 blocks) or "
                             f"{shapes[1]} (per row), got {tuple(s.shape)} {s.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_ids.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 [{m}, top_k], got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    tensors = {"x": x, "w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale,
               "topk_weights": topk_weights, "topk_ids": topk_ids}
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, strides "
                             f"{t.stride()})")
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == x.shape
                                and out.dtype == x.dtype and out.device == x.device
                                and out.is_contiguous()):
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}"
               f"{'' if out.is_contiguous() else ' (not contiguous)'}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of x's shape "
                         f"{tuple(x.shape)} on {x.device}, got {got}")


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                  w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """out [M, H] in x's dtype (see the module docstring for the numerics).

    x [M, H]; w13 float8 [E, 2I, H] (gate rows first), w13_scale [E, ceil(2I/128), Hb] or
    per-row [E, 2I, Hb]; w2 float8 [E, H, I], w2_scale [E, ceil(H/128), Ib] or [E, H, Ib];
    topk_weights [M, k] and topk_ids [M, k]: expert ids in 0..E-1, or -1 for a slot skipped
    (its expert not held here); others are a ValueError.
    The expert ids are read (a host sync): a reference, not a serving path.
    """
    _check(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    m, h = x.shape
    num_experts = w13.shape[0]
    ids = topk_ids.long()
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= num_experts):
        raise ValueError(f"topk_ids must be expert ids in 0..{num_experts - 1} or -1, got "
                         f"values from {int(ids.min())} to {int(ids.max())}")
    xq, xs = quantize_activation(x)
    y = torch.zeros(m, ids.shape[1], h, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = reference_gemm(xq[tok], xs[tok], w13[e], w13_scale[e], out_dtype=x.dtype)
        hq, hs = quantize_activation(silu_mul_reference(gate_up))
        y[tok, slot] = reference_gemm(hq, hs, w2[e], w2_scale[e], out_dtype=x.dtype).float()
    out = torch.zeros(m, h, dtype=torch.float32, device=x.device)
    for j in range(ids.shape[1]):  # the fixed combine order: slot 0 first
        here = ids[:, j:j + 1] >= 0
        out += torch.where(here, topk_weights[:, j:j + 1].float() * y[:, j], 0.0)
    return out.to(x.dtype)


def _fused_moe_into(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                    w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, out: torch.Tensor) -> None:
    if x.shape[0] == 0:
        return
    inter = w13.shape[1] // 2
    block = w13_scale.shape[1] == cdiv(2 * inter, 128) and w2_scale.shape[1] == cdiv(
        x.shape[1], 128)
    # (fp32 activations: the reference; the kernels take bf16/fp16)
    if x.dtype != torch.float32 and dispatch.moe_backend(x.device, x.shape[1], inter,
                                                         block) == "sm90":
        from .backends.sm90 import moe as sm90_moe
        sm90_moe.fused_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, out)
    else:
        out.copy_(moe_reference(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids))


# A custom op (opaque to torch.compile, with a fake implementation), for compiled graphs.
op = torch.library.custom_op("fp8linear::fused_moe", _fused_moe_into, mutates_args=("out",))


@op.register_fake
def _(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, out):
    return None


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
              w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The block-FP8 MoE layer: ``moe_reference``'s arguments and numerics, on the fastest
    path for the device; returns out [M, H] in x's dtype (written into ``out`` where given:
    contiguous, on x's device). On the GPU the expert ids are not read on the host (CUDA
    graphs and torch.compile work): they must lie in 0..E-1, or be -1 for a slot of an expert
    not held here (skipped)."""
    _check(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, out)
    if out is None:
        out = torch.empty_like(x)
    args = (x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, out)
    (op if torch.compiler.is_compiling() else _fused_moe_into)(*args)
    return out
