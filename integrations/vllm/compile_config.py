"""What the plugin changes in vLLM's torch.compile settings: Inductor's Triton kernels launch
with programmatic dependent launch (PDL) on Hopper.

Why. In a compiled vLLM model (vLLM's default) every GEMM follows a kernel Inductor
generated: the residual add + RMSNorm before qkv_proj and gate_up_proj, SiLU-and-mul before
down_proj. Our sm90 kernels launch under PDL and start their weight stream before
griddepcontrol.wait, but that overlaps the previous kernel only if that kernel lets its
dependents launch early. Inductor's kernels do so with ``triton.enable_pdl`` (torch >= 2.9;
off by default): each calls gdc_launch_dependents once its loads are issued and gdc_wait before
it reads what the kernel before it wrote, so a GEMM's launch, prologue and first weight loads
run under the norm or activation kernel instead of after it (what bench_gemm's ``elem`` and
``b2b`` modes measure apart: ~3 us a decode GEMM on the H100), and the kernel after a GEMM is
launched before the GEMM ends. Measured end to end: docs/tuning.md, vllm-inductor-pdl.

``FP8LINEAR_VLLM_PDL=0`` leaves Inductor's setting alone; a value the user put in
``compilation_config.inductor_compile_config`` is never overridden.

Also on Hopper: a post-grad pass (quant_fusion_pass.py) that makes the kernels before our
linear layers quantize their own output: vLLM's RMSNorm -> our linears becomes one norm +
quantization kernel -> GEMMs on its fp8 output, SiLU-and-mul -> down_proj likewise, removing
the quantization step between each of them and its GEMMs. ``FP8LINEAR_VLLM_FUSE_QUANT=0``
leaves it out (``=1`` installs it on other devices too); a ``post_grad_custom_post_pass`` the
user set is kept.
"""
from __future__ import annotations

import torch

from fp8linear import knobs
from fp8linear.backends import dispatch

KEY = "triton.enable_pdl"
PASS_KEY = "post_grad_custom_post_pass"


def hopper() -> bool:
    """Whether this process's GEMMs run our sm90 kernels (the ones that start early)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    return dispatch.forced_backend() in (None, "sm90")


def inductor_has_pdl() -> bool:
    try:
        from torch._inductor import config
    except ImportError:  # a torch without Inductor
        return False
    return hasattr(config.triton, "enable_pdl")


def enable_inductor_pdl(vllm_config) -> bool:
    """Turn on ``triton.enable_pdl`` in ``vllm_config``'s Inductor options where it helps;
    returns whether it did. Called while the model is built, before vLLM creates its compile
    backend (which copies these options) and hashes the config for its compile cache."""
    if vllm_config is None or knobs.get(knobs.VLLM_PDL) == "0":
        return False
    options = vllm_config.compilation_config.inductor_compile_config
    if KEY in options or not hopper() or not inductor_has_pdl():
        return False
    options[KEY] = True
    return True


def install_quant_fusion_pass(vllm_config) -> bool:
    """Put quant_fusion_pass.QuantFusionPass in ``vllm_config``'s Inductor options (see the module
    docstring); returns whether it did. Called while the model is built, like
    enable_inductor_pdl."""
    switch = knobs.get(knobs.VLLM_FUSE_QUANT)
    if vllm_config is None or switch == "0":
        return False
    options = vllm_config.compilation_config.inductor_compile_config
    # (=1 installs it off Hopper too: the fused op runs as Triton on other GPUs and as its
    # torch reference on the CPU. vLLM's CPU platform decomposes its norms before any pass,
    # so there it finds only the SiLU-and-mul to rewrite.)
    if PASS_KEY in options or not (hopper() or switch == "1"):
        return False
    from .quant_fusion_pass import QuantFusionPass
    options[PASS_KEY] = QuantFusionPass()
    return True
