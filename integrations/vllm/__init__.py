"""fp8linear's vLLM plugin: ``--quantization fp8_blockgemm``.

Installed as the module ``fp8linear_vllm`` with the entry point
``vllm.general_plugins: fp8_blockgemm = fp8linear_vllm:register``, so every vLLM process
(API server, engine core, workers) registers the method at start-up with no user code.
Importing this package does not import vLLM; ``register()`` does.
"""
from __future__ import annotations

NAME = "fp8_blockgemm"


def register() -> None:
    """Register the ``fp8_blockgemm`` quantization method with vLLM (idempotent)."""
    from . import config  # noqa: F401  (the class registers itself when defined)
