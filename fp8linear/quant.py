"""The numerics contract (DeepSeek-V3 block FP8), written plainly in torch.

Every backend (sm90 CUDA, Triton) is tested against these functions; on the CPU they are
the compute path.

- weights: float8_e4m3fn [N, K], one fp32 dequant multiplier (``scale_inv``) per 128x128
  block, shape [ceil(N/128), ceil(K/128)], or per row [N, ceil(K/128)];
- activations: per token, per 128 channels, scale = max(amax, eps) / 448;
- GEMM: each 128-wide K block's product accumulates in fp32 and is multiplied by
  a_scale x w_scale before it joins the fp32 total; the output is rounded once;
- a gated MLP's (and an MoE expert's) activation: SiLU-and-mul in the activations' dtype,
  then quantized as activations.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
# scale dtypes a checkpoint may hold (Qwen3-FP8 ships bf16/fp16 ones): all convert to fp32 exactly
SCALE_LOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Smallest amax a group may have: keeps the scale finite for all-zero groups. Same value as
# vLLM's per-token-group quantization, so both produce bit-identical activations.
AMAX_EPS = 1e-10


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def empty_scale_t(m: int, groups: int, device) -> torch.Tensor:
    """A token-minor activation-scale buffer for ``m`` tokens: fp32 [groups, ld], ld = m rounded
    up to 4 (the 16-byte rows the Hopper kernels read and write with TMA), unwritten."""
    return torch.empty(groups, cdiv(m, 4) * 4, dtype=torch.float32, device=device)


def scale_view(scale_t: torch.Tensor, m: int) -> torch.Tensor:
    """The [M, K/128] activation-scale view of a token-minor ``scale_t`` [K/128, ld] buffer
    (token m's scale of group g at ``scale_t[g, m]``, as the Hopper kernels read it in place)."""
    return scale_t[:, :m].t()


def check_block_size(block, what: str = "block") -> None:
    """Only 128 is supported: the kernels hard-wire 128-wide K blocks (one TMA box row)."""
    sizes = tuple(block) if isinstance(block, (tuple, list)) else (block,)
    if any(int(b) != BLOCK for b in sizes):
        raise ValueError(
            f"unsupported {what} size {list(sizes) if len(sizes) > 1 else sizes[0]}: "
            f"fp8linear supports only {BLOCK} (DeepSeek-V3 128x128 weight blocks, "
            f"1x128 activation groups)")


def _amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    # Divide by a 448 *tensor*: torch on CUDA turns division by a Python scalar into a
    # multiplication by its reciprocal, one ulp off IEEE amax / 448 for some values, and that
    # ulp moves x / scale across fp8 rounding ties. The kernels divide exactly, like the CPU.
    return amax.clamp(min=AMAX_EPS) / torch.full_like(amax, FP8_MAX)


def _round_scale(scale: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    # UE8M0 (DeepSeek-V3.1): scales become powers of two, rounded *up* so that
    # amax / scale never exceeds 448.
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def quantize_weight(w: torch.Tensor, block: int = BLOCK, ue8m0: bool = False):
    """[N, K] float weight -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/128), ceil(K/128)]).

    Edge blocks (N or K not a multiple of 128) take the amax of their partial region.
    """
    check_block_size(block)
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise ValueError(f"weight must be bf16/fp16/fp32, got {w.dtype}")
    n, k = w.shape
    nb, kb = cdiv(n, block), cdiv(k, block)
    wf = w.float()
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = wf
    blocks = padded.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = _round_scale(_amax_to_scale(amax), ue8m0)
    if not torch.isfinite(scale).all():
        raise ValueError("weight has non-finite values (inf/nan): cannot quantize")
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nb * block, kb * block)[:n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul (SwiGLU) as vLLM's native ``SiluAndMul``: ``silu(x[..., :d]) * x[..., d:]``
    in x's dtype (silu computed in fp32 and rounded, the product rounded)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def quantize_activation(x: torch.Tensor, group: int = BLOCK, ue8m0: bool = False):
    """[..., K] -> (float8_e4m3fn [..., K], fp32 scale [..., ceil(K/128)]); per token, per group."""
    check_block_size(group, "group")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"activation must be bf16/fp16/fp32, got {x.dtype}")
    k = x.shape[-1]
    kb = cdiv(k, group)
    xf = x.float()
    if kb * group != k:
        xf = torch.nn.functional.pad(xf, (0, kb * group - k))
    groups = xf.unflatten(-1, (kb, group))
    amax = groups.abs().amax(dim=-1)
    scale = _round_scale(_amax_to_scale(amax), ue8m0)
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :k]
    return q.to(FP8_DTYPE).contiguous(), scale.contiguous()


def has_row_scales(w_scale: torch.Tensor, n: int) -> bool:
    """True for per-row weight scales [N, Kb], False for 128x128 block scales.

    With N <= 1 both layouts are one row that means the same: reported as blocks.
    """
    return w_scale.shape[0] == n and n != cdiv(n, BLOCK)


def expand_weight_scale(w_scale: torch.Tensor, n: int) -> torch.Tensor:
    """Block scales [ceil(N/128), Kb] -> per-row [N, Kb] (exact); per-row passes through."""
    if w_scale.shape[0] == n:
        return w_scale
    return w_scale.repeat_interleave(BLOCK, dim=0)[:n]


def weight_scale_shapes(n: int, k: int) -> tuple[tuple, tuple]:
    """The two accepted scale shapes of an [N, K] weight: (128x128 blocks, per row)."""
    kb = cdiv(k, BLOCK)
    return (cdiv(n, BLOCK), kb), (n, kb)


def check_weight_scale_shape(w_shape, s_shape, name: str = "weight") -> None:
    """Metadata only: ``name``'s scale must have exactly one of the two shapes."""
    n, k = w_shape
    blocks, rows = weight_scale_shapes(n, k)
    if tuple(s_shape) not in (blocks, rows):
        raise ValueError(f"{name}_scale_inv has shape {tuple(s_shape)} but {name} is "
                         f"[{n}, {k}]: expected {blocks} for 128x128 blocks or {rows} per row")


def check_scale_values(scale: torch.Tensor, name: str = "weight_scale_inv") -> None:
    """Scales must be finite and positive (a dequant multiplier of 0 or below is corrupt).

    Reads the data (one host sync): run once when weights load, never per call.
    """
    scale = scale.detach()
    require_values(torch.isfinite(scale), scale, name, "non-finite values",
                   "the checkpoint is corrupt or was quantized from weights holding inf/nan")
    require_values(scale > 0, scale, name, "a non-positive value",
                   "weight scales must be positive and finite")


def require_values(ok: torch.Tensor, t: torch.Tensor, name: str, what: str, tail: str) -> None:
    """A ValueError naming ``name``, the first element where ``ok`` is False and its value,
    unless ``ok`` holds everywhere (one host sync)."""
    if not bool(ok.all()):
        idx = tuple(int(i) for i in (~ok).nonzero()[0].tolist())
        raise ValueError(f"{name} has {what} (first at index {idx}, value {float(t[idx])}): "
                         f"{tail}")


def dequantize_weight(w_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32,
                      name: str = "weight"):
    """float8 [N, K] x scale (block [ceil(N/128), Kb] or per-row [N, Kb]) -> dtype [N, K].

    The scale's shape and values are checked (a ValueError naming ``name``): a wrong shape
    would otherwise broadcast silently or fail deep inside torch.
    """
    if w_fp8.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, K], got shape {tuple(w_fp8.shape)}")
    check_weight_scale_shape(w_fp8.shape, scale_inv.shape, name)
    check_scale_values(scale_inv, f"{name}_scale_inv")
    n, k = w_fp8.shape
    rows = expand_weight_scale(scale_inv.float(), n)
    cols = rows.repeat_interleave(BLOCK, dim=1)[:, :k]
    return (w_fp8.float() * cols).to(dtype)


def dequantize_activation(x_fp8: torch.Tensor, scale: torch.Tensor, dtype=torch.float32):
    k = x_fp8.shape[-1]
    cols = scale.float().repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (x_fp8.float() * cols).to(dtype)


def reference_gemm(a_fp8, a_scale, w_fp8, w_scale, bias=None, out=None,
                   out_dtype=torch.bfloat16):
    """The definition: per 128-wide K block, fp32 partial product x a_scale x w_scale."""
    m, k = a_fp8.shape
    n = w_fp8.shape[0]
    ws = expand_weight_scale(w_scale.float(), n)
    acc = torch.zeros(m, n, dtype=torch.float32, device=a_fp8.device)
    for kb in range(cdiv(k, BLOCK)):
        sl = slice(kb * BLOCK, min(k, (kb + 1) * BLOCK))
        part = a_fp8[:, sl].float() @ w_fp8[:, sl].float().t()
        acc += part * a_scale[:, kb:kb + 1].float() * ws[:, kb][None, :]
    if bias is not None:
        acc += bias.float()
    if out is None:
        return acc.to(out_dtype)
    out.copy_(acc)
    return out
