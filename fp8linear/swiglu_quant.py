"""SiLU-and-mul (SwiGLU) with the FP8 quantization of its output in the same kernel.

For the activation between a gated MLP's gate_up_proj and down_proj: down_proj then runs
``block_fp8_gemm_scale_t`` on the fp8 activations, with no quantization step between the
activation and the GEMM. The vLLM plugin rewrites compiled graphs to this form
(integrations/vllm/quant_fusion_pass.py).

Numerics are vLLM's native ``SiluAndMul`` (``F.silu(x[..., :d]) * x[..., d:]`` in x's dtype:
silu computed in fp32 and rounded, the product rounded) followed by ``quantize_activation``.
Activation scales come as ``scale_t`` [d/128, ld], as from ``rms_norm_quant``
(norm_quant.py's docstring).
"""
from __future__ import annotations

import torch

from .norm_quant import _buffers, _check_x, _quantize_into
from .quant import BLOCK, silu_mul_reference


def _check(x):
    _check_x(x, "[M, 2 * d]", 2 * BLOCK, "SiLU-and-mul + quantization",
             " (two halves of whole 128-channel groups)")


def _op_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[1] // 2
    q, scale_t = _buffers(x[:, :d])
    if x.shape[0]:
        if x.device.type == "cuda":
            from .backends.triton import swiglu_quant as triton_swiglu_quant
            triton_swiglu_quant.launch(x, q, scale_t)
        else:
            _quantize_into(silu_mul_reference(x), q, scale_t)
    return q, scale_t


# A custom op (opaque to torch.compile, with a fake implementation), for compiled graphs.
op = torch.library.custom_op("fp8linear::silu_mul_quant", _op_impl, mutates_args=())


@op.register_fake
def _(x):
    return _buffers(x[:, :x.shape[1] // 2])


def silu_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp16 [M, 2d], d a multiple of 128 -> (fp8 [M, d], scale_t [d/128, ld] fp32) of
    ``silu(x[:, :d]) * x[:, d:]``; see the module docstring."""
    _check(x)
    return op(x) if torch.compiler.is_compiling() else _op_impl(x)
