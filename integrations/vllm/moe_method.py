"""MoE layers on fp8linear's block-FP8 MoE (``fp8linear.fused_moe``).

vLLM's own block-FP8 MoE methods keep what they do well: creating the expert weights,
loading and sharding them (tensor and expert parallel), online quantization of bf16/fp16
experts layer by layer. Only the experts class of their modular kernel is ours
(``Fp8BlockGemmExperts``): vLLM's prepare/finalize still does the token dispatch, and
``apply`` gets the layer's tokens, their top-k routing and the local experts' weights.

Where our kernels do not take the layer (a GPU other than Hopper, an expert intermediate
size whose shard is off the 128 grid, non-SiLU experts, all-to-all expert parallelism),
vLLM's kernels run it, with one log line saying why.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8linear import fused_moe
from fp8linear.backends import dispatch

from . import compat

mk = compat.modular_kernel
_logged: set = set()


def local_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """The slots' local expert ids. Under expert parallelism ``expert_map`` maps a global id
    to the local one or -1: fused_moe skips a slot of id -1 (another rank's), which then
    costs no GEMM rows here."""
    if expert_map is None:
        return topk_ids
    return expert_map[topk_ids.long()].to(topk_ids.dtype)


class Fp8BlockGemmExperts(mk.FusedMoEExpertsModular):
    """gate_up GEMM, SiLU-and-mul + quantization, down GEMM and the top-k weighted sum, in
    ``fp8linear.fused_moe`` (it quantizes the activations itself: the prepare step hands
    them over unquantized)."""

    @staticmethod
    def activation_format():
        return mk.FusedMoEActivationFormat.Standard

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # the plugin decides per device (moe_method below)

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (compat.kFp8Static128BlockSym,
                                                compat.kFp8Dynamic128Sym)

    @staticmethod
    def _supports_activation(activation) -> bool:
        return activation == compat.MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        # tensor parallel and expert parallel without all-to-all kernels (those hand the
        # experts a batched layout)
        return not moe_parallel_config.use_all2all_kernels

    def finalize_weight_and_reduce_impl(self):
        return compat.TopKWeightAndReduceNoOP()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        return (0,), (0,), (M, K)  # fused_moe allocates its own intermediates

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        ids, weights = local_ids(topk_ids, expert_map), topk_weights
        if apply_router_weight_on_input:  # already applied to the input (top-1 models)
            weights = torch.ones_like(weights)
        args = (hidden_states, w1, self.w1_scale, w2, self.w2_scale, weights.contiguous(),
                ids.contiguous())
        if (output.is_contiguous() and output.dtype == hidden_states.dtype
                and output.shape == hidden_states.shape):  # (vLLM's buffer: written in place)
            fused_moe(*args, out=output)
        else:
            output.copy_(fused_moe(*args))


def why_not(layer) -> Optional[str]:
    """None when our experts take this MoE layer on this machine, else the reason."""
    moe = layer.moe_config
    if not (Fp8BlockGemmExperts._supports_activation(moe.activation) and moe.is_act_and_mul):
        return f"activation {moe.activation} (ours: SiLU-and-mul)"
    if moe.has_bias or moe.swiglu_limit is not None or moe.is_lora_enabled:
        return "expert biases, a clamped SwiGLU or LoRA"
    if not Fp8BlockGemmExperts._supports_parallel_config(moe.moe_parallel_config):
        return "all-to-all expert parallelism"
    hidden, inter = moe.hidden_dim, moe.intermediate_size_per_partition
    device = compat.current_device()
    if device.type == "cpu":
        return None  # vLLM has no block-FP8 MoE kernel on the CPU: ours is the reference
    if device.type != "cuda":
        return f"device {device.type}"
    if dispatch.moe_backend(device, hidden, inter, block_scales=True) != "sm90":
        return (f"not a Hopper GPU, or hidden {hidden} / expert intermediate {inter} per rank "
                f"outside our kernels (hidden % 16, intermediate % 128)")
    return None


def moe_method(vllm_method, layer, prefix: str):
    """vLLM's block-FP8 MoE method ``vllm_method`` running our experts where they take
    ``layer``; vLLM's experts otherwise (logged once per reason)."""
    reason = why_not(layer)
    if reason is None:
        compat.use_experts(vllm_method, Fp8BlockGemmExperts)
    elif reason not in _logged:
        _logged.add(reason)
        compat.logger.info("fp8_blockgemm: MoE layers such as '%s' run on vLLM's block-FP8 "
                           "MoE kernels: %s", prefix, reason)
    return vllm_method
