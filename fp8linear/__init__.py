"""fp8linear: block-scaled FP8 linear layers (DeepSeek-V3 numerics) for LLM inference."""
import warnings as _warnings

with _warnings.catch_warnings():
    # torch warns at import when NumPy is missing (a plain `pip install torch` has none);
    # nothing in fp8linear uses NumPy, so the CLI's first run should not print it
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy",
                             category=UserWarning)
    import torch as _torch  # noqa: F401
from .quant import (FP8_DTYPE, dequantize_activation, dequantize_weight, quantize_activation,
                    quantize_weight, reference_gemm)
from .ops import block_fp8_gemm, fp8_linear
from .norm_quant import rms_norm_quant  # (also registers its custom ops, as ops.py does)
from .swiglu_quant import silu_mul_quant  # (likewise)
from .experts import FP8Experts
from .module import FP8Linear, fp8_modules, quantize_model
from .moe import fused_moe, moe_reference

from .version import __version__  # noqa: E402

__all__ = [
    "FP8_DTYPE", "quantize_weight", "quantize_activation", "dequantize_weight",
    "dequantize_activation", "reference_gemm", "block_fp8_gemm", "fp8_linear", "rms_norm_quant",
    "silu_mul_quant", "fused_moe", "moe_reference", "FP8Linear", "FP8Experts",
    "quantize_model", "fp8_modules", "load_fp8_checkpoint", "save_fp8_checkpoint",
    "from_pretrained",
]


def __getattr__(name):
    # checkpoint I/O imports safetensors (and from_pretrained transformers) lazily: the core
    # needs only torch
    if name in ("load_fp8_checkpoint", "save_fp8_checkpoint", "from_pretrained"):
        from . import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(name)
