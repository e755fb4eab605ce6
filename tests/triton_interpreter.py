"""The Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1): how the
CPU tests of fp8linear/backends/triton run them (tests/backends/triton/test_gemm.py,
tests/test_norm_quant.py, tests/test_swiglu_quant.py).

TRITON_INTERPRET must be set before a kernel is defined (``triton.jit`` reads it), and the
test processes import the kernels compiled, so each check runs in a subprocess:
``run(script)`` executes the test file as a script under TRITON_INTERPRET=1; its
``__main__`` block calls ``start()``, runs its checks (assertions) and ends with
``passed(count)``. A missing triton fails the test (triton is in the dev extra).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PASSED = "interpreter checks passed"


def run(script, timeout: int = 600) -> str:
    """Run ``script`` (a test file) under the interpreter; assert that all its checks passed.
    Returns its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("FP8LINEAR_TRITON_MODE", None)
    # this checkout's fp8linear, and tests/ for fp64_reference and this module
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert PASSED in r.stdout, r.stdout[-4000:]
    return r.stdout


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def start() -> None:
    """In the script: check that it is interpreting, patch the interpreter, let the checks
    switch FP8LINEAR_* knobs between calls."""
    assert interpreting(), "run this through triton_interpreter.run"
    from fp8linear import knobs
    knobs.CACHE_VALUES = False
    patch()


def passed(n_checks: int) -> None:
    print(f"{PASSED} ({n_checks})", flush=True)


def patch() -> None:
    """Work around three limitations of Triton's CPU interpreter (not of the kernels), seen
    since Triton 3.6: its fp32 -> fp8/bf16 casts round without carrying into the exponent
    (31.3 -> 16), its bf16 dot multiplies the raw uint16 storage, and with numpy >= 2.3 a
    loop bound computed from program_id is a 1-element array that int() rejects. The casts
    are replaced by torch's (correctly rounded, as the GPU's are)."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as ti

    conv = ti._convert_float

    def convert(data, src, dst, rounding):
        if src == tl.float32 and dst in (tl.float8e4nv, tl.bfloat16):
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            if dst == tl.float8e4nv:
                return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return conv(data, src, dst, rounding)

    ti._convert_float = convert

    patch_tensor = ti._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patch_lang_tensor

    dot = ti.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, precision, imprecise):
        def f32(h):
            if h.dtype.scalar == tl.bfloat16:
                return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32),
                                       tl.float32)
            return h
        return dot(self, f32(a), f32(b), d, precision, imprecise)

    ti.InterpreterBuilder.create_dot = create_dot
