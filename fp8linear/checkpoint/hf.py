"""``fp8linear.from_pretrained``: a block-FP8 checkpoint directory into a Hugging Face
transformers model whose linear layers run FP8Linear.

Works for checkpoints written by ``fp8linear quantize`` / ``save_fp8_checkpoint`` and for
the DeepSeek-V3 / Qwen3-FP8 layout (``<layer>.weight`` float8_e4m3fn +
``<layer>.weight_scale_inv``, config.json ``quantization_config`` {quant_method fp8,
weight_block_size [128, 128]}). transformers is an optional dependency, imported here only.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
from torch import nn

from ..experts import fused_experts_problem, layer_names
from ..module import replace_experts, replace_linears
from .format import CONFIG_NAME, CheckpointError
from .hf_names import to_checkpoint
from .io import CheckpointDir, load_fp8_checkpoint


def from_pretrained(model_cls, path, dtype: torch.dtype = torch.bfloat16, device="cpu",
                    strict: bool = True) -> nn.Module:
    """Build ``model_cls`` from ``path``/config.json and load the block-FP8 checkpoint in
    ``path`` into it; returns the model in eval mode.

    ``model_cls``: a transformers model class (``LlamaForCausalLM``, ``BertModel``) or Auto
    class (``AutoModelForCausalLM``, ``AutoModel``), the one the checkpoint was saved from.
    The model is built with its parameters on the meta device (no memory, no random init;
    buffers such as rotary tables and position ids are computed as usual), every nn.Linear
    whose weight is float8 in the checkpoint becomes an FP8Linear (the others, e.g. an
    lm_head kept in bf16 or tied to the embeddings, stay nn.Linear) and every MoE layer's
    fused experts that the checkpoint holds per expert in float8 an FP8Experts; then the
    tensors load through safetensors (``load_fp8_checkpoint``: shapes, dtypes and scale
    values are checked). Other floating tensors take ``dtype``. Needs transformers, not
    accelerate. Names transformers renames while loading (Mixtral's ``block_sparse_moe``) are
    renamed by its rules (``hf_names``).

    transformers' own ``from_pretrained`` on such a checkpoint needs ``accelerate``
    (``pip install accelerate``, or the ``fp8linear[hf]`` extra) and runs transformers' FP8
    layers, not fp8linear's; without a GPU it dequantizes the weights to bf16 and fails when
    a layer's size is not a multiple of 128.
    """
    transformers = _import_transformers()
    path = Path(path)
    ckpt = CheckpointDir(path)
    _check_quantization_config(path, ckpt.config())
    config = transformers.AutoConfig.from_pretrained(str(path))
    # transformers would otherwise set up its own FP8 layers while building the model
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    # transformers renamed torch_dtype to dtype in 4.56
    major_minor = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    kw = {"dtype" if major_minor >= (4, 56) else "torch_dtype": dtype}
    with _parameters_on_meta():
        if hasattr(model_cls, "from_config"):  # an Auto class
            model = model_cls.from_config(config, **kw)
        elif isinstance(model_cls, type) and issubclass(model_cls,
                                                          transformers.PreTrainedModel):
            model = model_cls._from_config(config, **kw)
        else:
            raise TypeError(f"from_pretrained expects a transformers model class or Auto "
                            f"class, got {model_cls!r}")
    disk = to_checkpoint(model)

    def fp8_in_file(tensor: str) -> bool:
        return getattr(ckpt.entries.get(disk(tensor)), "dtype", None) == "F8_E4M3"
    replace_linears(model, [name for name, m in model.named_modules()
                            if isinstance(m, nn.Linear) and fp8_in_file(f"{name}.weight")])
    # transformers' fused experts whose checkpoint holds them per expert in fp8
    replace_experts(model, [name for name, m in model.named_modules()
                            if fused_experts_problem(m) is None
                            and fp8_in_file(f"{name}.0.{layer_names(m)[0]}.weight")])
    _materialize(model, torch.device(device))
    load_fp8_checkpoint(model, path, strict=strict)
    return model.eval()


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("fp8linear.from_pretrained needs transformers: pip install "
                          "transformers") from e
    return transformers


def _check_quantization_config(path: Path, config: dict) -> None:
    where = path / CONFIG_NAME
    if not config:
        raise CheckpointError(f"{where} is missing: from_pretrained builds the model from it")
    q = config.get("quantization_config")
    if not q:
        raise CheckpointError(f"{where} has no quantization_config: not a block-FP8 checkpoint "
                              f"(convert it with `fp8linear quantize`, or load it with "
                              f"transformers and run fp8linear.quantize_model)")
    if (q.get("quant_method") != "fp8" or list(q.get("weight_block_size") or []) != [128, 128]
            or q.get("fmt", "e4m3") != "e4m3"
            or q.get("activation_scheme", "dynamic") != "dynamic"):
        raise CheckpointError(f"{where}: quantization_config {q} is not block FP8: expected "
                              f"quant_method 'fp8', weight_block_size [128, 128], fmt 'e4m3' "
                              f"and activation_scheme 'dynamic'")


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters registered inside go to the meta device; buffers stay real.

    The checkpoint fills every parameter, but buffers are computed at construction (rotary
    inv_freq, BERT's position_ids) and are not in the checkpoint: building everything on
    the meta device would leave them empty.
    """
    # (what accelerate's init_empty_weights(include_buffers=False) does; patched for the
    # duration of the model's construction only)
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.detach().to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Empty parameters on ``device`` for the meta ones (tied parameters stay one object),
    buffers moved there; load_fp8_checkpoint then fills every parameter or raises."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.device.type == "meta":
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                               requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)
