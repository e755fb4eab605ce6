"""An independent fp64 formulation of the block-FP8 numerics, for the tests.

Written from the definition (DeepSeek-V3 block scaling, OCP float8 e4m3fn), not from
fp8linear.quant: loops over blocks, its own e4m3 rounding, its own scale expansion.
"""
import math

import torch

B = 128
E4M3_MAX = 448.0
EPS = 1e-10
# half an ulp, relative: the most that rounding a value to the dtype can change it
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Round fp64 values (|v| <= 448) to the nearest e4m3fn value, ties to even.

    e4m3fn: 3 mantissa bits, exponent bias 7, smallest normal 2^-6 (below it the
    subnormal spacing 2^-9).
    """
    v = v.double()
    a = v.abs()
    _, exp = torch.frexp(a.clamp(min=2.0 ** -6))  # a = m * 2^exp, m in [0.5, 1)
    step = torch.exp2((exp - 1 - 3).double())
    q = (torch.round(a / step) * step).clamp(max=E4M3_MAX)  # torch.round: half to even
    return torch.sign(v) * q


def block_scale(amax: float, ue8m0: bool) -> float:
    s = max(amax, EPS) / E4M3_MAX
    if ue8m0:
        s = 2.0 ** math.ceil(math.log2(s))
    return s


def weight_scales(w: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """Ideal fp64 scales [ceil(N/128), ceil(K/128)]: amax of each (possibly partial) block."""
    w = w.double()
    n, k = w.shape
    nb, kb = -(-n // B), -(-k // B)
    s = torch.empty(nb, kb, dtype=torch.float64)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * B:(i + 1) * B, j * B:(j + 1) * B]
            s[i, j] = block_scale(float(blk.abs().max()), ue8m0)
    return s


def activation_scales(x: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """Ideal fp64 scales [..., ceil(K/128)] per token per 128 channels."""
    x2 = x.double().reshape(-1, x.shape[-1])
    k = x2.shape[1]
    kb = -(-k // B)
    s = torch.empty(x2.shape[0], kb, dtype=torch.float64)
    for m in range(x2.shape[0]):
        for j in range(kb):
            s[m, j] = block_scale(float(x2[m, j * B:(j + 1) * B].abs().max()), ue8m0)
    return s.reshape(*x.shape[:-1], kb)


def per_element(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[N, K] fp64 multipliers from block [ceil(N/128), Kb] or per-row [N, Kb] scales."""
    s = scale.double()
    rows = torch.tensor([r if s.shape[0] == n else r // B for r in range(n)])
    cols = torch.tensor([c // B for c in range(k)])
    return s[rows][:, cols]


def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 [..., K] with scales (weight blocks, per-row, or activation groups) -> fp64."""
    q2 = q.double().reshape(-1, q.shape[-1])
    n, k = q2.shape
    s2 = scale.double().reshape(-1, scale.shape[-1])
    return (q2 * per_element(s2, n, k)).reshape(q.shape)


def gemm(a_fp8, a_scale, w_fp8, w_scale, bias=None) -> torch.Tensor:
    """fp64 C = dequant(A) @ dequant(W)^T (+ bias): what every backend must approximate."""
    c = dequant(a_fp8, a_scale) @ dequant(w_fp8, w_scale).t()
    if bias is not None:
        c = c + bias.double()
    return c


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref|| in fp64."""
    out, ref = out.detach().double(), ref.detach().double()
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref))


def random_matrix(n: int, k: int, gen: torch.Generator, dtype=torch.float32,
                  spread: float = 4.0) -> torch.Tensor:
    """Fresh random data, never zeros: normal values whose magnitude varies by up to
    e^(+-spread) between 32x32 tiles, so blocks get very different scales."""
    tiles = torch.exp((torch.rand(-(-n // 32), -(-k // 32), generator=gen) * 2 - 1) * spread)
    mag = tiles.repeat_interleave(32, 0).repeat_interleave(32, 1)[:n, :k]
    x = torch.randn(n, k, generator=gen) * mag
    x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
    return x.to(dtype)


def moe(xq, xs, dtype, w13, s13, w2, s2, weights, ids) -> torch.Tensor:
    """The block-FP8 MoE layer (fp8linear/moe.py's numerics) on quantized activations xq, xs,
    each (token, slot) on its own, in fp64: dequantized operands; the intermediate rounded to
    ``dtype``, SiLU-and-mul in ``dtype``, quantized per 128 channels with fp64 e4m3 rounding;
    each expert's output rounded to ``dtype``."""
    xd = dequant(xq, xs)
    out = torch.zeros(xq.shape, dtype=torch.float64, device=xq.device)
    inter = w13.shape[1] // 2
    used = {int(e) for e in ids.flatten()}
    d13 = {e: dequant(w13[e], s13[e]) for e in used}
    d2 = {e: dequant(w2[e], s2[e]) for e in used}
    for t in range(xq.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = (xd[t:t + 1] @ d13[e].t()).to(dtype)
            g = gu[:, :inter].float()
            h = ((g / (1 + torch.exp(-g))).to(dtype) * gu[:, inter:]).double()
            hs = activation_scales(h)
            hd = e4m3_round(h / per_element(hs, 1, inter)) * per_element(hs, 1, inter)
            out[t] += float(weights[t, j]) * (hd @ d2[e].t()).to(dtype).double()[0]
    return out
