"""CI kernel guard under pytest: every csrc/**/*.cu compiles for sm_90a without local-memory
spills or wgmma serialisation (scripts/check_kernels.py), and no source includes torch or
Python headers (the kernel library serves every torch and Python version).

Needs nvcc, not a GPU. Skips only when nvcc is absent or csrc/ has no .cu yet.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "csrc"
SCRIPT = REPO / "scripts" / "check_kernels.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("check_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


ck = _load_script()
NVCC = ck.build.find_cuda_home()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME)")


def test_kernel_sources_do_not_include_torch_or_python():
    assert (CSRC / "capi.cpp").is_file()
    assert ck.torch_includes(CSRC) == []


def test_torch_include_detector(tmp_path):
    (tmp_path / "capi.cpp").write_text("#include <torch/extension.h>\n")
    (tmp_path / "ok.cuh").write_text("#include <cuda_runtime.h>\n// torch/extension.h\n")
    (tmp_path / "bad.cu").write_text('#include "common/x.cuh"\n  #  include <ATen/ATen.h>\n')
    (tmp_path / "bad.h").write_text("#include <c10/util/Half.h>\n#include <Python.h>\n")
    assert ck.torch_includes(tmp_path) == ["bad.cu:2: #  include <ATen/ATen.h>",
                                           "bad.h:1: #include <c10/util/Half.h>",
                                           "bad.h:2: #include <Python.h>",
                                           "capi.cpp:1: #include <torch/extension.h>"]


@needs_nvcc
def test_all_kernels_compile_without_spills():
    if not list(CSRC.rglob("*.cu")):
        pytest.skip("csrc/ has no .cu translation unit yet")
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    print(p.stdout)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    assert "spill" in p.stdout and "FAIL" not in p.stderr  # the table was printed, clean


_SPILL = """
// 64 live accumulators under a 32-register cap (1024 threads x 2 blocks/SM): ptxas spills.
__global__ void __launch_bounds__(1024, 2) spilly(const float* x, float* y, int n) {
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = x[threadIdx.x + i * n];
  for (int r = 0; r < n; ++r) {
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = acc[i] * acc[(i + 7) % 64] + x[r + i];
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += acc[i];
  y[threadIdx.x] = s;
}
"""
_CLEAN = "__global__ void clean(float* y) { y[threadIdx.x] = 1.f; }\n"


@needs_nvcc
def test_guard_fails_on_spills_and_compile_errors(tmp_path):
    (tmp_path / "sm90").mkdir()
    (tmp_path / "sm90" / "clean.cu").write_text(_CLEAN)
    (tmp_path / "sm90" / "spill.cu").write_text(_SPILL)
    (tmp_path / "sm90" / "broken.cu").write_text("__global__ void b() { undeclared(); }\n")
    p = subprocess.run([sys.executable, str(SCRIPT), "--csrc", str(tmp_path)],
                       capture_output=True, text=True)
    assert p.returncode == 1
    fails = [ln for ln in p.stderr.splitlines() if ln.startswith("FAIL")]
    assert fails[0] == "FAIL sm90/broken.cu: compile error (nvcc exit 2):"
    assert len(fails) == 2 and fails[1].startswith("FAIL sm90/spill.cu: spilly spills to "
                                                   "local memory (")
    assert "undeclared" in p.stderr
    row = next(ln for ln in p.stdout.splitlines() if ln.startswith("sm90/clean.cu"))
    cols = row.split()  # TU kernel regs smem stack spills seconds
    assert cols[1] == "clean" and int(cols[2]) > 0 and cols[3:6] == ["0", "0", "0/0"]


_PTXAS_CLEAN = """ptxas info    : Compiling entry function '_Z5cleanPf' for 'sm_90a'
ptxas info    : Function properties for _Z5cleanPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 6 registers, used 0 barriers, 16 bytes smem, 360 bytes cmem[0]
ptxas info    : Function properties for _Z6helperv
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""


def test_ptxas_parser():
    f = {x.name: x for x in ck.parse_ptxas(_PTXAS_CLEAN)}
    assert (f["_Z5cleanPf"].regs, f["_Z5cleanPf"].smem, f["_Z5cleanPf"].stack) == (6, 16, 0)
    assert (f["_Z6helperv"].spill_st, f["_Z6helperv"].spill_ld, f["_Z6helperv"].stack) == (4, 4, 8)


def test_nvcc_command_matches_the_library_build():
    cmd = ck.nvcc_command("nvcc", CSRC / "sm90" / "x.cu", CSRC)
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd
    for flag in ck.build.NVCC_FLAGS:
        assert flag in cmd  # what the library build passes, or CI checks another program
    assert cmd[-4:] == ["-c", str(CSRC / "sm90" / "x.cu"), "-o", "/dev/null"]


def test_guard_fails_on_wgmma_serialisation(tmp_path):
    # ptxas's note when it serialises wgmmas (e.g. an accumulator touched before wgmma.wait)
    out = _PTXAS_CLEAN + (
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to non wgmma instructions reading accumulator registers of  a wgmma "
        "between start and end of the pipeline stage in the function '_Z5cleanPf'\n")
    (tmp_path / "k.cu").write_text(_CLEAN)
    res = ck.Result(tmp_path / "k.cu", 0, 0.1, out, ck.parse_ptxas(out))
    fails = ck.report([res], tmp_path)
    assert [f for f in fails if "wgmma" in f] == [
        f"k.cu: {ck.short(ck.demangle(['_Z5cleanPf'])['_Z5cleanPf'], 200)}: wgmma serialised "
        f"by ptxas (C7514)"]
    clean = ck.Result(tmp_path / "k.cu", 0, 0.1, _PTXAS_CLEAN, ck.parse_ptxas(_PTXAS_CLEAN))
    assert not any("wgmma" in f for f in ck.report([clean], tmp_path))
