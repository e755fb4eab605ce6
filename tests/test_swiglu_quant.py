"""fp8linear.swiglu_quant: SiLU-and-mul with the fp8 quantization of its output in one kernel.
CPU: the reference path (quantize_activation of the product, checked against an fp64
SiLU-and-mul; its equality with vLLM's own SiluAndMul is tested where vLLM is installed,
tests/integrations/vllm/test_vllm_native_numerics.py), the validation, the custom op in a
compiled graph, and the Triton kernel under Triton's interpreter (small shapes); GPU (gpu
marker): the Triton kernel at model sizes. The kernel checks (``check_kernel``) are the same
on both."""
from __future__ import annotations

import operator
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (also as the interpreter script)
import fp64_reference as R  # noqa: E402
import triton_interpreter  # noqa: E402
from expect import raises_exactly  # noqa: E402

import fp8linear  # noqa: E402
from fp8linear import norm_quant as nq  # noqa: E402
from fp8linear import swiglu_quant as smq  # noqa: E402
from fp8linear.quant import scale_view  # noqa: E402

CUDA = torch.cuda.is_available()


def _data(m, d, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(m, 2 * d, generator=g, device=device) * 4).to(dtype)


@pytest.mark.parametrize("m,d,dtype", [(1, 128, torch.bfloat16), (7, 384, torch.float16),
                                       (5, 256, torch.bfloat16), (0, 256, torch.bfloat16)])
def test_reference_path_quantizes_silu_and_mul(m, d, dtype):
    """The CPU path: its fp8 values and scales are exactly quantize_activation of its product
    (laid out in scale_t), and that product is silu(gate) * up within the two roundings the
    definition makes (silu to x's dtype, then the product)."""
    x = _data(m, d, dtype)
    q, scale_t = fp8linear.silu_mul_quant(x)
    y = smq.silu_mul_reference(x)
    qq, ss = fp8linear.quantize_activation(y)
    assert q.shape == (m, d) and q.dtype == fp8linear.FP8_DTYPE
    assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8))
    assert scale_t.shape == (d // 128, (m + 3) // 4 * 4)
    assert torch.equal(scale_view(scale_t, m), ss)
    gate, up = x[:, :d].double(), x[:, d:].double()
    y64 = gate / (1 + torch.exp(-gate)) * up
    assert y.dtype == dtype
    bound = 2 * R.UNIT_ROUNDOFF[dtype] * 1.01
    assert ((y.double() - y64).abs() <= bound * y64.abs() + 1e-30).all()


def test_bad_inputs_are_named():
    x = _data(4, 256)
    with raises_exactly(ValueError, "x has 384 channels: SiLU-and-mul + quantization needs a "
                                    "multiple of 256 (two halves of whole 128-channel groups)"):
        fp8linear.silu_mul_quant(x[:, :384].contiguous())
    with raises_exactly(ValueError, "x must be bf16 or fp16, got torch.float32"):
        fp8linear.silu_mul_quant(x.float())
    with raises_exactly(ValueError, "x must be contiguous, got strides (1024, 2)"):
        fp8linear.silu_mul_quant(torch.cat([x, x], 1)[:, ::2])
    with raises_exactly(ValueError, "x must be a 2-D [M, 2 * d] tensor, got shape (512,)"):
        fp8linear.silu_mul_quant(x[0])
    with raises_exactly(ValueError, "x must be a 2-D [M, 2 * d] tensor, got list"):
        fp8linear.silu_mul_quant([1.0])


def test_gemm_on_the_scale_buffer_equals_fp8_linear():
    x = _data(6, 256, seed=3)
    wq, ws = fp8linear.quantize_weight(torch.randn(384, 256).bfloat16())
    q, scale_t = fp8linear.silu_mul_quant(x)
    got = torch.ops.fp8linear.block_fp8_gemm_scale_t(q, scale_t, wq, ws, None, torch.bfloat16)
    assert torch.equal(got, fp8linear.fp8_linear(smq.silu_mul_reference(x), wq, ws))


def test_compiled_call_uses_the_custom_op():
    """Under torch.compile silu_mul_quant is one opaque custom op (what the vLLM fusion pass
    puts in graphs), not its traced reference path."""
    x = _data(5, 256, seed=4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    f = torch.compile(lambda t: fp8linear.silu_mul_quant(t), backend=backend, fullgraph=True)
    q, scale_t = f(x)
    (gm,) = graphs
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.fp8linear.silu_mul_quant.default) == 1, calls
    # nothing else but taking its outputs apart: no traced arithmetic of the reference path
    assert set(calls) - {torch.ops.fp8linear.silu_mul_quant.default, operator.getitem} \
        == set(), calls
    q0, s0 = fp8linear.silu_mul_quant(x)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    assert torch.equal(scale_view(scale_t, 5), scale_view(s0, 5))


# ---------------------------------------------------------------- the Triton kernel
def check_kernel(m, d, dtype, groups=None, device="cuda", pdl=True):
    """The kernel's fp8 values and scales are exactly quantize_activation of its own product,
    which is the reference's within one rounding step (the GPU's exp differs from the CPU's
    in the last fp32 bit); the scale buffer's padding columns are never read. Returns x and
    the kernel's (q, scale_t)."""
    from fp8linear.backends.triton import swiglu_quant as triton_swiglu_quant
    x = _data(m, d, dtype, device=device, seed=m + d)
    q, scale_t = nq._buffers(x[:, :d])
    q.fill_(float("nan"))
    scale_t.fill_(float("nan"))
    y = torch.full((m, d), float("nan"), dtype=dtype, device=device)
    triton_swiglu_quant.launch(x, q, scale_t, y=y, pdl=pdl, groups=groups)
    if device == "cuda":
        torch.cuda.synchronize()
    what = f"m={m} d={d} {dtype} groups={groups}"
    qq, ss = fp8linear.quantize_activation(y)
    assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8)), what
    assert torch.equal(scale_view(scale_t, m), ss), what
    ref = smq.silu_mul_reference(x)            # torch's silu and multiply on that device
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-3, (what, err)
    assert (y != ref).float().mean().item() < 0.01, what   # an occasional last-bit difference
    return x, q, scale_t


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 200, 700])   # (700: bigger programs)
@pytest.mark.parametrize("d,dtype", [(14336, torch.bfloat16), (640, torch.float16),
                                     (1536, torch.bfloat16)])
def test_triton_kernel(m, d, dtype):
    x, q, scale_t = check_kernel(m, d, dtype)
    # the public entry point (PDL as configured) gives the same bits
    q2, s2 = fp8linear.silu_mul_quant(x)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scale_view(s2, m), scale_view(scale_t, m))


# (m, d, dtype, groups): below 32 rows 4 groups a program (masked groups where d < 512, two
# programs a row where d > 512), a forced 2, from 32 rows 4-8 groups
INTERPRETED = [(3, 384, torch.bfloat16, None), (2, 640, torch.float16, None),
               (1, 128, torch.bfloat16, None), (4, 512, torch.bfloat16, 2),
               (33, 256, torch.float16, None)]


@pytest.mark.skipif(triton_interpreter.interpreting(), reason="already interpreting")
def test_triton_kernel_interpreted():
    """The Triton kernel on the CPU through Triton's interpreter (tests/triton_interpreter.py):
    the same checks as on the GPU, on small shapes."""
    triton_interpreter.run(__file__)


if __name__ == "__main__":
    triton_interpreter.start()
    for case in INTERPRETED:
        check_kernel(*case, device="cpu", pdl=False)
    triton_interpreter.passed(len(INTERPRETED))
