"""The JIT build machinery, on CPU: cache key, cache location, prebuilt dir, the inter-process
lock, and the fallback when there is no toolkit or no Hopper GPU.

Compiling the real extension needs a CUDA build of torch (scripts/prebuild_device_ext.sh does
it on CPU); here the compile step is replaced by a tiny plain-C Python extension with the same
module name, so everything around it runs for real: the lock, the marker, the import.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from fp8linear.backends import dispatch
from fp8linear.backends.sm90 import build

REPO = Path(__file__).resolve().parents[3]
CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler to build the stand-in extension")

_EXT_C = """
#include <Python.h>
static PyObject* answer(PyObject* self, PyObject* args) { return PyLong_FromLong(ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&def); }
"""


def compile_standin(build_dir: Path, answer: int) -> None:
    """Writes build_dir/EXT_NAME.so: a module whose answer() returns `answer`."""
    src = build_dir / "standin.c"
    src.write_text(_EXT_C.replace("NAME", build.EXT_NAME))
    subprocess.run([CC, "-shared", "-fPIC", f"-DANSWER={answer}",
                    f"-I{sysconfig.get_paths()['include']}", str(src), "-o",
                    str(build_dir / f"{build.EXT_NAME}.so")], check=True)


def make_csrc(root: Path) -> Path:
    src = root / "csrc"
    (src / "sm90").mkdir(parents=True)
    (src / "common").mkdir()
    (src / "bindings.cpp").write_text("// glue\n")
    (src / "sm90" / "gemm.cu").write_text("__global__ void k() {}\n")
    (src / "sm90" / "quant.cu").write_text("__global__ void q() {}\n")
    (src / "common" / "util.cuh").write_text("#pragma once\n")
    return src


def key_of(src: Path, **over) -> str:
    kw = dict(arch="sm_90a", torch_version="2.11.0+cu130", cuda_version="13.0", python="3.12")
    kw.update(over)
    return build.cache_key(src, **kw)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fake csrc, a private cache root, no prebuilt dir, a pretend Hopper arch."""
    src = make_csrc(tmp_path)
    monkeypatch.setattr(build, "source_dir", lambda: src)
    monkeypatch.setattr(build, "device_arch", lambda index=None: build.ARCH)
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setenv("FP8LINEAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FP8LINEAR_PREBUILT", raising=False)
    build.available.cache_clear()
    yield src
    build.available.cache_clear()
    dispatch._cuda_default.cache_clear()


# ----------------------------------------------------------------------------- key
def test_key_is_stable_and_location_independent(tmp_path):
    a = make_csrc(tmp_path / "a")
    b = make_csrc(tmp_path / "b")
    assert key_of(a) == key_of(a) == key_of(b)  # a checkout and an installed copy agree
    assert key_of(a).startswith("sm_90a-torch2.11.0+cu130-cu13.0-py3.12-")


def test_key_changes_with_every_source_file(tmp_path):
    src = make_csrc(tmp_path)
    k0 = key_of(src)
    (src / "common" / "util.cuh").write_text("#pragma once\n// edited\n")
    k1 = key_of(src)
    (src / "sm90" / "decode.cu").write_text("__global__ void d() {}\n")
    k2 = key_of(src)
    (src / "sm90" / "decode.cu").rename(src / "sm90" / "decode2.cu")
    k3 = key_of(src)
    assert len({k0, k1, k2, k3}) == 4
    (src / "README.md").write_text("not a source")  # not compiled: no rebuild
    assert key_of(src) == k3


@pytest.mark.parametrize("field,value", [("torch_version", "2.12.0+cu130"),
                                         ("cuda_version", "12.8"), ("python", "3.11"),
                                         ("arch", "sm_100a")])
def test_key_changes_with_versions(tmp_path, field, value):
    src = make_csrc(tmp_path)
    assert key_of(src) != key_of(src, **{field: value})


def test_key_uses_running_torch_and_python(env):
    k = build.current_key()
    assert k == build.cache_key(env, arch="sm_90a", torch_version=torch.__version__,
                                cuda_version=torch.version.cuda,
                                python=f"{sys.version_info.major}.{sys.version_info.minor}")


def test_translation_units_are_bindings_then_cu(env):
    assert [p.relative_to(env).as_posix() for p in build.translation_units(env)] == \
        ["bindings.cpp", "sm90/gemm.cu", "sm90/quant.cu"]


def test_repo_sources_are_found():
    # the checkout's csrc/, or an installed fp8linear/csrc with the same content
    src = build.source_dir()
    assert (src / "bindings.cpp").is_file() and build.translation_units(src)[1:]
    assert key_of(src) == key_of(REPO / "csrc")


# ----------------------------------------------------------------------------- cache dir
def test_cache_root_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8LINEAR_CACHE", str(tmp_path / "c"))
    assert build.cache_root() == (tmp_path / "c").resolve()
    monkeypatch.delenv("FP8LINEAR_CACHE")
    assert build.cache_root() == Path.home() / ".cache" / "fp8linear"


@needs_cc
def test_load_builds_once_into_the_cache(env, tmp_path, monkeypatch):
    calls = []

    def fake_compile(src, build_dir, arch, log_path, verbose):
        calls.append(build_dir)
        compile_standin(build_dir, 42)

    monkeypatch.setattr(build, "_compile", fake_compile)
    assert build.load().answer() == 42
    key = build.current_key()
    assert calls == [tmp_path / "cache" / key]
    assert (tmp_path / "cache" / key / "build.json").is_file()
    monkeypatch.setattr(build, "_module", None)  # as a new process would: cached, no compile
    assert build.load().answer() == 42
    assert len(calls) == 1


@needs_cc
def test_failed_build_leaves_no_marker(env, tmp_path, monkeypatch):
    def broken(src, build_dir, arch, log_path, verbose):
        raise build.BuildError("fp8linear: building the sm90 extension failed")

    monkeypatch.setattr(build, "_compile", broken)
    with pytest.raises(build.BuildError, match="failed"):
        build.load()
    assert not (tmp_path / "cache" / build.current_key() / "build.json").exists()
    # the next attempt compiles again instead of trusting the half-built dir
    monkeypatch.setattr(build, "_compile", lambda s, d, a, lg, v: compile_standin(d, 5))
    assert build.load().answer() == 5


@pytest.mark.skipif(build.find_cuda_home() is None, reason="nvcc not found")
def test_real_compile_failure_is_reported_with_its_log(env, tmp_path):
    # The real child build (torch's cpp_extension + ninja). Here the sources cannot build: a
    # CPU torch has no CUDA support at all, and a CUDA torch stops at the #error.
    (env / "bindings.cpp").write_text("#error deliberate\n")
    key = build.current_key()
    with pytest.raises(build.BuildError, match="building the sm90 extension failed") as ei:
        build.build(key, tmp_path / "cache", arch=build.ARCH)
    log = tmp_path / "cache" / key / "build.log"
    assert f"(full log: {log})" in str(ei.value)
    assert log.read_text().startswith("# fp8linear build:")
    assert not (tmp_path / "cache" / key / "build.json").exists()


# ----------------------------------------------------------------------------- prebuilt
def _no_compile(*args):
    raise AssertionError("compiled although a prebuilt extension was given")


@needs_cc
def test_prebuilt_dir_loads_without_compiling(env, tmp_path, monkeypatch):
    key = build.current_key()
    monkeypatch.setattr(build, "_compile", lambda s, d, a, lg, v: compile_standin(d, 7))
    build.build(key, tmp_path / "prebuilt", arch=build.ARCH)  # as the prebuild script does
    monkeypatch.setattr(build, "_compile", _no_compile)
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)  # no toolkit needed
    monkeypatch.setenv("FP8LINEAR_PREBUILT", str(tmp_path / "prebuilt"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build.load().answer() == 7
    assert not (tmp_path / "cache").exists()


@needs_cc
def test_precompile_uses_the_prebuilt_build(env, tmp_path, monkeypatch, capsys):
    # `fp8linear build` on a machine carrying FP8LINEAR_PREBUILT: nothing to compile (and no
    # toolkit needed), it names the prebuilt extension that load() will import
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")  # (CPU torch)
    key = build.current_key()
    monkeypatch.setattr(build, "_compile", lambda s, d, a, lg, v: compile_standin(d, 5))
    so = build.build(key, tmp_path / "prebuilt", arch=build.ARCH)
    monkeypatch.setattr(build, "_compile", _no_compile)
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    monkeypatch.setenv("FP8LINEAR_PREBUILT", str(tmp_path / "prebuilt"))
    assert build.precompile() == so
    assert "FP8LINEAR_PREBUILT has it" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()


@needs_cc
def test_prebuilt_for_another_key_warns_and_compiles(env, tmp_path, monkeypatch):
    (tmp_path / "prebuilt" / "sm_90a-some-other-key").mkdir(parents=True)
    monkeypatch.setenv("FP8LINEAR_PREBUILT", str(tmp_path / "prebuilt"))
    monkeypatch.setattr(build, "_compile", lambda s, d, a, lg, v: compile_standin(d, 9))
    with pytest.warns(UserWarning, match=re.escape(f"no build for key {build.current_key()}")):
        assert build.load().answer() == 9


# ----------------------------------------------------------------------------- the lock
_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[4])
    if sys.argv[5] == "fcntl":
        sys.modules["filelock"] = None  # force the fcntl fallback
    from fp8linear.backends.sm90 import build
    sys.path.insert(0, str(Path(sys.argv[4]) / "tests"))
    from backends.sm90.test_build import compile_standin
    src, log = Path(sys.argv[1]), Path(sys.argv[2])
    build.source_dir = lambda: src
    build.device_arch = lambda index=None: build.ARCH

    def slow_compile(s, build_dir, arch, log_path, verbose):
        with open(log, "a") as f:
            f.write(f"start {time.time()}\\n")
        time.sleep(1.0)  # long enough that the other process surely arrives meanwhile
        compile_standin(build_dir, int(sys.argv[3]))
        with open(log, "a") as f:
            f.write(f"end {time.time()}\\n")

    build._compile = slow_compile
    print(build.load().answer())
""")


@needs_cc
@pytest.mark.parametrize("lock", ["filelock", "fcntl"])
def test_lock_makes_concurrent_processes_build_once(tmp_path, lock):
    if lock == "filelock":
        pytest.importorskip("filelock")
    src = make_csrc(tmp_path)
    log = tmp_path / "builds.log"
    env = dict(os.environ, FP8LINEAR_CACHE=str(tmp_path / "cache"))
    env.pop("FP8LINEAR_PREBUILT", None)
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(log), str(answer),
                               str(REPO), lock], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for answer in (11, 22)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    answers = {int(out.strip().splitlines()[-1]) for out, _ in outs}
    events = [line.split()[0] for line in log.read_text().splitlines()]
    # one build (whoever got the lock first); the other process waited and loaded its result
    assert events == ["start", "end"], events
    assert len(answers) == 1 and answers <= {11, 22}


@pytest.mark.parametrize("lock", ["filelock", "fcntl"])
def test_file_lock_excludes(tmp_path, monkeypatch, lock):
    if lock == "fcntl":
        monkeypatch.setitem(sys.modules, "filelock", None)
    else:
        pytest.importorskip("filelock")
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        if {lock!r} == "fcntl":
            sys.modules["filelock"] = None
        from pathlib import Path
        from fp8linear.backends.sm90.build import file_lock
        with file_lock(Path({str(tmp_path / 'x.lock')!r})):
            print("child got it", flush=True)
    """)
    with build.file_lock(tmp_path / "x.lock"):
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        time.sleep(3.0)  # the child is importing and then blocked on the lock we hold
        assert child.poll() is None
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and "child got it" in out


# ----------------------------------------------------------------------------- fallback
def _one_warning(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        results = [fn(), fn()]  # asked twice, warned once
    assert len(rec) == 1, [str(w.message) for w in rec]
    return results, str(rec[0].message)


def _fake_hopper(monkeypatch, cap=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)


def test_available_without_gpu(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results, msg = _one_warning(build.available)
    assert results == [False, False]
    assert "no CUDA device" in msg and "falling back to the Triton path" in msg


def test_available_without_nvcc(env, monkeypatch):
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    results, msg = _one_warning(build.available)
    assert results == [False, False]
    assert msg == ("fp8linear: nvcc not found (set CUDA_HOME or install the CUDA toolkit); "
                   "falling back to the Triton path")


def test_available_without_ninja(env, tmp_path, monkeypatch):
    _fake_hopper(monkeypatch)
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "bin" / "nvcc").write_text("")
    (home / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setattr(build, "_ninja_bin_dir", lambda: None)
    results, msg = _one_warning(build.available)
    assert results == [False, False] and "ninja not found (pip install ninja)" in msg


def test_available_on_a_non_hopper_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "_module", None)
    build.available.cache_clear()
    _fake_hopper(monkeypatch, cap=(8, 9))
    try:
        results, msg = _one_warning(build.available)
    finally:
        build.available.cache_clear()
    assert results == [False, False] and "sm_89" in msg and "sm_90 (Hopper)" in msg


def test_find_cuda_home_honours_cuda_home(tmp_path, monkeypatch):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert build.find_cuda_home() != home  # nvcc without headers is no toolkit
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    assert build.find_cuda_home() == home


def test_precompile_errors(monkeypatch):
    with pytest.raises(ValueError, match="unsupported arch 'sm_80'"):
        build.precompile(arch="sm_80")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(build.BuildError, match="CPU-only build"):
        build.precompile(verbose=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    with pytest.raises(build.ToolkitMissingError, match="nvcc not found"):
        build.precompile(verbose=False)


def test_dispatch_falls_back_to_triton_without_nvcc(env, monkeypatch):
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    dispatch._cuda_default.cache_clear()
    with pytest.warns(UserWarning, match="nvcc not found"):
        assert dispatch._cuda_default(0) == "triton"


def test_dispatch_skips_the_build_on_other_gpus(env, monkeypatch):
    _fake_hopper(monkeypatch, cap=(8, 0))
    from fp8linear.backends.sm90 import backend as sm90
    monkeypatch.setattr(sm90, "available", _no_compile)  # not even asked
    dispatch._cuda_default.cache_clear()
    assert dispatch._cuda_default(0) == "triton"
