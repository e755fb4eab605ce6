"""The portable Triton backend: ``gemm`` (entry points and the GEMM kernel), ``plan`` (tiles),
``quant``, ``norm_quant``, ``swiglu_quant`` (kernels that quantize their output)."""
