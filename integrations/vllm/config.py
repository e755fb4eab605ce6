"""``--quantization fp8_blockgemm``: the vLLM QuantizationConfig that routes every linear
layer through fp8linear."""
from __future__ import annotations

from typing import Any, Optional

import torch

from fp8linear import knobs

from . import compat, compile_config
from .checkpoint_format import NAME, CheckpointFormat, parse_quantization_config
from .layer_filter import matches_any
from .linear_method import Fp8BlockGemmLinearMethod
from .moe_method import moe_method
from .online import Fp8BlockGemmOnlineLinearMethod

compat.register_weight_loader_v2(Fp8BlockGemmLinearMethod)
compat.register_weight_loader_v2(Fp8BlockGemmOnlineLinearMethod)


@compat.register_quantization_config(NAME)
class Fp8BlockGemmConfig(compat.QuantizationConfig):
    """Block-FP8 (128x128) linear layers on fp8linear's kernels.

    ``checkpoint`` describes a block-FP8 checkpoint; None means a bf16/fp16 checkpoint that
    is quantized while it loads. Linear layers get our methods; MoE experts get vLLM's own
    block-FP8 methods (loading, sharding) running our experts kernel (moe_method.py);
    attention (KV-cache scales) gets vLLM's; lm_head and embeddings stay in high precision.
    """

    def __init__(self, checkpoint: Optional[CheckpointFormat] = None):
        super().__init__()
        self.checkpoint = checkpoint
        self._vllm_config = None  # vLLM's config for the same checkpoint, built on demand
        self._announced = False

    def __repr__(self) -> str:
        return f"Fp8BlockGemmConfig({self.checkpoint or 'online quantization'})"

    # ------------------------------------------------------------------ vLLM's interface
    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # FP8 (e4m3) tensor-core MMAs start at sm_89 (Ada); Hopper runs the sm90 kernels.
        return 89

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        # the checkpoint's config.json carries the quantization_config; without one the
        # checkpoint is bf16/fp16 and vLLM constructs us with no arguments
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8BlockGemmConfig":
        return cls(parse_quantization_config(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        """Take over a quantized checkpoint only when the user asked for fp8_blockgemm
        (plain ``--quantization fp8`` stays vLLM's). An unsupported checkpoint fails here,
        at config time, with the reason."""
        if user_quant != NAME:
            return None
        parse_quantization_config(hf_quant_cfg)
        return NAME

    def apply_vllm_mapper(self, hf_to_vllm_mapper):
        if self.checkpoint is not None:
            fmt = self.checkpoint
            fmt.ignored = _map_names(hf_to_vllm_mapper, fmt.ignored)
            if fmt.targets is not None:
                fmt.targets = _map_names(hf_to_vllm_mapper, fmt.targets)
        if self._vllm_config is not None:
            self._vllm_config.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not self._announced:
            self._announced = True
            compat.logger.info(
                "fp8_blockgemm: %s; linear layers run on fp8linear's block-FP8 GEMM, MoE "
                "experts on fp8linear's block-FP8 MoE",
                "bf16/fp16 checkpoint quantized to 128x128 block FP8 while loading"
                if self.checkpoint is None else f"{self.checkpoint.method} block-FP8 checkpoint")
            # (the model is being built: vLLM's compile backend does not exist yet)
            vllm_config = compat.current_vllm_config()
            if compile_config.enable_inductor_pdl(vllm_config):
                compat.logger.info(
                    "fp8_blockgemm: Inductor's kernels launch with PDL (%s), so each GEMM "
                    "starts streaming its weights under the kernel before it (%s=0: off)",
                    compile_config.KEY, knobs.VLLM_PDL.name)
            if compile_config.install_quant_fusion_pass(vllm_config):
                compat.logger.info(
                    "fp8_blockgemm: RMSNorms and SiLU-and-muls feeding block-FP8 linears "
                    "quantize their output in the same kernel (a compile pass; %s=0: off)",
                    knobs.VLLM_FUSE_QUANT.name)
        if isinstance(layer, compat.LinearBase):
            if not self.quantizes(prefix):
                return compat.UnquantizedLinearMethod()
            if self.checkpoint is None:
                return Fp8BlockGemmOnlineLinearMethod()
            return Fp8BlockGemmLinearMethod(self.checkpoint.scale_name)
        if isinstance(layer, compat.RoutedExperts):
            if not self.quantizes(prefix):
                return (compat.unquantized_moe_method(layer) if self.checkpoint is None
                        else self.vllm_config().get_quant_method(layer, prefix))
            vllm_method = (compat.online_block_fp8_moe_method(layer) if self.checkpoint is None
                           else self.vllm_config().get_quant_method(layer, prefix))
            return moe_method(vllm_method, layer, prefix)
        if self.checkpoint is not None and isinstance(layer, compat.Attention):
            return self.vllm_config().get_quant_method(layer, prefix)
        return None  # lm_head, embeddings and everything else: unquantized

    # ------------------------------------------------------------------ helpers
    def quantizes(self, prefix: str) -> bool:
        """Whether the linear/MoE layer ``prefix`` is block FP8 (in the checkpoint, or
        after online quantization)."""
        fmt = self.checkpoint
        if fmt is None:
            return True
        if matches_any(prefix, fmt.ignored, self.packed_modules_mapping):
            return False
        if fmt.targets is not None:
            return matches_any(prefix, fmt.targets, self.packed_modules_mapping)
        return True

    def vllm_config(self):
        """vLLM's own config for the checkpoint (MoE experts, KV-cache scales)."""
        if self._vllm_config is None:
            self._vllm_config = compat.vllm_checkpoint_config(self.checkpoint)
        # models fill packed_modules_mapping as they are built: keep both views in step
        self._vllm_config.packed_modules_mapping = self.packed_modules_mapping
        return self._vllm_config


def _map_names(mapper, names):
    plain = [n for n in names if not n.startswith("re:")]
    return [n for n in names if n.startswith("re:")] + mapper.apply_list(plain)

