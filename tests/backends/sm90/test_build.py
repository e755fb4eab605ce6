"""fp8linear/backends/sm90/build.py and library.py on the CPU: the cache key, where the kernel
library comes from (FP8LINEAR_PREBUILT, the wheel's prebuilt copy, the cache, or a build now),
the inter-process lock, real nvcc builds of a tiny stand-in csrc (one that fails, one that
library.Library loads with ctypes), and the fallback to Triton where the kernels cannot run.

The real kernels are compiled by tests/test_wheel.py (the platform wheel) and run on a GPU in
tests/backends/test_gemm_gpu.py and sm90/test_gemm.py.
"""
from __future__ import annotations

import ctypes
import fcntl
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from expect import raises_exactly
from fp8linear.backends import dispatch
from fp8linear.backends.sm90 import build, library

REPO = Path(__file__).resolve().parents[3]
HAVE_NVCC = build.find_cuda_home() is not None
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
CXX = shutil.which("c++") or shutil.which("g++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler")
FALLBACK = "; falling back to the Triton path"
NVCC_MISSING = "fp8linear: nvcc not found (set CUDA_HOME or install the CUDA toolkit)"


def make_csrc(root: Path) -> Path:
    """A csrc/ laid out as the real one (the content is never compiled)."""
    src = root / "csrc"
    (src / "sm90").mkdir(parents=True)
    (src / "common").mkdir()
    (src / "capi.cpp").write_text("// entry points\n")
    (src / "sm90" / "gemm.cu").write_text("__global__ void k() {}\n")
    (src / "sm90" / "quant.cu").write_text("__global__ void q() {}\n")
    (src / "sm90" / "tables.def").write_text("FP8L_LIMIT(kX, 1)\n")
    (src / "common" / "util.cuh").write_text("#pragma once\n")
    return src


# A stand-in for csrc/capi.cpp: the entry points and nothing else, its argument structs the
# sizes tables.def's layouts take. fp8l_decode answers with an error text, to see it come
# back through ctypes.
STUB_CAPI = """\
#define EXPORT extern "C" __attribute__((visibility("default")))
int hidden_helper() { return ABI; }  // -fvisibility=hidden: not exported
EXPORT int fp8l_abi_version() { return hidden_helper(); }
EXPORT int fp8l_arg_size(int e) { return e == 0 ? SIZE0 : e == 1 ? SIZE1 : SIZE2; }
EXPORT const char* fp8l_quant(const void*) { return nullptr; }
EXPORT const char* fp8l_gemm(const void*) { return nullptr; }
EXPORT const char* fp8l_decode(const void*) { return "fp8linear decode: stub refuses"; }
""".replace("SIZE0", str(-(-library._QUANT.size // 8) * 8)).replace(
    "SIZE1", str(-(-library._GEMM.size // 8) * 8)).replace(
    "SIZE2", str(-(-library._DECODE.size // 8) * 8))


def make_stub_csrc(root: Path, abi: int = library.ABI_VERSION) -> Path:
    src = root / "csrc"
    src.mkdir(parents=True)
    (src / "capi.cpp").write_text(STUB_CAPI.replace("ABI", str(abi)))
    (src / "stub.cu").write_text("__global__ void stub_kernel() {}\n")
    return src


def use_sources(monkeypatch, src: Path) -> None:
    monkeypatch.setattr(build, "source_dir", lambda: src)
    build.current_key.cache_clear()  # (memoized per arch)


def finished(d: Path, key: str, content: bytes = b"lib") -> Path:
    """A finished build of `key` in `d`, as build_into leaves one."""
    d.mkdir(parents=True, exist_ok=True)
    (d / build.LIB_NAME).write_bytes(content)
    (d / "build.json").write_text(json.dumps({"key": key, "lib": build.LIB_NAME}))
    return d / build.LIB_NAME


class FakeCompile:
    """Stands in for nvcc: records its arguments, writes the library file."""

    def __init__(self, error: str | None = None):
        self.calls, self.error = [], error

    def __call__(self, src, out_dir, arch, log_path, verbose):
        self.calls.append((src, out_dir, arch, log_path, verbose))
        if self.error:
            raise build.BuildError(self.error)
        (out_dir / build.LIB_NAME).write_bytes(b"built")
        return out_dir / build.LIB_NAME


def no_compile(*args):
    raise AssertionError("compiled although it should not have")


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fake csrc, a private cache root, no FP8LINEAR_PREBUILT, an empty wheel prebuilt dir,
    no library loaded yet."""
    src = make_csrc(tmp_path)
    use_sources(monkeypatch, src)
    monkeypatch.setenv("FP8LINEAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FP8LINEAR_PREBUILT", raising=False)
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path / "wheel" / "prebuilt")
    monkeypatch.setattr(library, "_library", None)
    library.available.cache_clear()
    dispatch._cuda_default.cache_clear()
    yield src
    build.current_key.cache_clear()
    library.available.cache_clear()
    dispatch._cuda_default.cache_clear()


# ----------------------------------------------------------------------------- key
def test_key_is_stable_and_location_independent(tmp_path):
    a = make_csrc(tmp_path / "a")
    b = make_csrc(tmp_path / "b")
    k = build.cache_key(a)
    assert re.fullmatch(r"sm_90a-[0-9a-f]{16}", k)
    # a checkout, an installed copy and a wheel's copy give the same key
    assert build.cache_key(a) == k == build.cache_key(b) == build.cache_key(a, arch="sm_90a")


def test_key_changes_with_every_source_file(tmp_path):
    src = make_csrc(tmp_path)
    keys = [build.cache_key(src)]
    for edit in (lambda: (src / "common" / "util.cuh").write_text("#pragma once\n// x\n"),
                 lambda: (src / "sm90" / "tables.def").write_text("FP8L_LIMIT(kX, 2)\n"),
                 lambda: (src / "capi.cpp").write_text("// entry points, edited\n"),
                 lambda: (src / "sm90" / "api.h").write_text("#pragma once\n"),
                 lambda: (src / "sm90" / "decode.cu").write_text("__global__ void d() {}\n"),
                 lambda: (src / "sm90" / "decode.cu").rename(src / "sm90" / "decode2.cu"),
                 lambda: (src / "sm90" / "decode2.cu").rename(src / "common" / "decode2.cu")):
        edit()
        keys.append(build.cache_key(src))
    assert len(set(keys)) == len(keys) == 8
    # neither other files nor build leftovers go into the key
    for name in ("README.md", "notes.txt", "x.py", "capi.cpp.o", "build.log", "build.json"):
        (src / name).write_text("not a source")
    assert build.cache_key(src) == keys[-1]


def test_key_keeps_file_boundaries(tmp_path):
    # names and contents run together the same way in both, yet the sources differ: an empty
    # capi.cpp beside an empty x.cu, and a capi.cpp holding the text "x.cu"
    one, two = tmp_path / "one" / "csrc", tmp_path / "two" / "csrc"
    one.mkdir(parents=True)
    (one / "capi.cpp").write_text("")
    (one / "x.cu").write_text("")
    two.mkdir(parents=True)
    (two / "capi.cpp").write_text("x.cu")
    assert build.cache_key(one) != build.cache_key(two)


def test_key_changes_with_arch(tmp_path):
    src = make_csrc(tmp_path)
    k90, k100 = build.cache_key(src), build.cache_key(src, arch="sm_100a")
    assert k100.startswith("sm_100a-") and k90[len("sm_90a-"):] != k100[len("sm_100a-"):]


def test_key_ignores_torch_and_python_versions(tmp_path, monkeypatch):
    src = make_csrc(tmp_path)
    k = build.cache_key(src)
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "9.9.9+cu999")
        m.setattr(torch.version, "cuda", "99.9")
        m.setattr(sys, "version_info", (3, 99, 0, "final", 0))
        m.setattr(sys, "version", "3.99.0")
        k_other = build.cache_key(src)
    assert k_other == k
    # build.py on its own (as setup.py loads it), torch unimportable: the same key
    code = textwrap.dedent(f"""
        import importlib.util, sys
        from pathlib import Path
        sys.modules["torch"] = None
        spec = importlib.util.spec_from_file_location("b", {str(build.__file__)!r})
        b = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(b)
        print(b.cache_key(Path({str(src)!r})))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"{k}\n"


def test_current_key_is_the_key_of_the_sources(env):
    assert build.current_key() == build.cache_key(env)
    assert build.current_key("sm_100a") == build.cache_key(env, arch="sm_100a")


# ----------------------------------------------------------------------------- sources
def test_source_files_and_translation_units(env):
    (env / "common" / "extra.cu").write_text("\n")
    (env / "README.md").write_text("\n")
    assert [p.relative_to(env).as_posix() for p in build.source_files(env)] == \
        ["capi.cpp", "common/extra.cu", "common/util.cuh", "sm90/gemm.cu", "sm90/quant.cu",
         "sm90/tables.def"]
    # capi.cpp first, then every .cu in path order; headers and tables are included, not built
    assert [p.relative_to(env).as_posix() for p in build.translation_units(env)] == \
        ["capi.cpp", "common/extra.cu", "sm90/gemm.cu", "sm90/quant.cu"]


def test_repo_sources_are_found():
    assert build.source_dir() == REPO / "csrc"
    assert [p.relative_to(REPO / "csrc").as_posix()
            for p in build.translation_units(build.source_dir())] == \
        ["capi.cpp", "sm90/decode.cu", "sm90/gemm.cu", "sm90/moe.cu", "sm90/quant.cu"]


def _standalone_build_module(root: Path):
    """build.py copied to root/fp8linear/backends/sm90/ and loaded from there."""
    d = root / "fp8linear" / "backends" / "sm90"
    d.mkdir(parents=True)
    shutil.copy(build.__file__, d / "build.py")
    spec = importlib.util.spec_from_file_location("fp8linear_build_copy", d / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_source_dir_prefers_the_installed_copy(tmp_path):
    b = _standalone_build_module(tmp_path)
    installed, checkout = tmp_path / "fp8linear" / "csrc", tmp_path / "csrc"
    for d in (installed, checkout):
        d.mkdir()
        (d / "capi.cpp").write_text("\n")
    assert b.source_dir() == installed           # package data of an installed fp8linear
    (installed / "capi.cpp").unlink()
    assert b.source_dir() == checkout            # a checkout's csrc/
    (checkout / "capi.cpp").unlink()
    with raises_exactly(b.BuildError, f"fp8linear: CUDA sources not found (neither "
                                      f"{installed} nor {checkout}); reinstall fp8linear"):
        b.source_dir()


# ----------------------------------------------------------------------------- cache root
def test_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FP8LINEAR_CACHE", str(tmp_path / "c" / ".." / "c2"))
    assert build.cache_root() == tmp_path / "c2"
    monkeypatch.setenv("FP8LINEAR_CACHE", "~/kernels")
    assert build.cache_root() == tmp_path / "home" / "kernels"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FP8LINEAR_CACHE", "rel")
    assert build.cache_root() == tmp_path / "rel"
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("FP8LINEAR_CACHE")
        else:
            monkeypatch.setenv("FP8LINEAR_CACHE", unset)
        assert build.cache_root() == tmp_path / "home" / ".cache" / "fp8linear"


# ----------------------------------------------------------------------------- library_path
def test_finished_build_needs_its_marker_key_and_library(tmp_path):
    d = tmp_path / "d"
    lib = finished(d, "k1")
    assert build.built(d, "k1") == lib
    assert build.built(d, "k2") is None                      # another key
    (d / "build.json").write_text("{not json")
    assert build.built(d, "k1") is None                      # a torn marker
    finished(d, "k1")
    lib.unlink()
    assert build.built(d, "k1") is None                      # the library gone
    finished(d, "k1")
    (d / "build.json").unlink()
    assert build.built(d, "k1") is None                      # no marker: unfinished
    assert build.built(tmp_path / "missing", "k1") is None


@pytest.mark.parametrize("have,want", [
    (("env", "wheel", "cache"), "env"),
    (("wheel", "cache"), "wheel"),
    (("env", "cache"), "env"),
    (("cache",), "cache"),
])
def test_library_path_order(env, tmp_path, monkeypatch, capsys, have, want):
    """FP8LINEAR_PREBUILT/<key>/, then the wheel's prebuilt/ (if its key matches), then the
    cache; none of them compiles or says anything."""
    monkeypatch.setattr(build, "_compile", no_compile)
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)  # no toolkit needed
    key = build.current_key()
    dirs = {"env": tmp_path / "pre" / key, "wheel": build.PREBUILT_DIR,
            "cache": tmp_path / "cache" / key}
    libs = {name: finished(dirs[name], key, name.encode()) for name in have}
    if "env" in have:
        monkeypatch.setenv("FP8LINEAR_PREBUILT", str(tmp_path / "pre"))
    assert build.library_path() == libs[want]
    assert capsys.readouterr().err == ""


def test_prebuilt_for_other_keys_is_passed_over(env, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build, "_compile", no_compile)
    key = build.current_key()
    finished(tmp_path / "pre" / key, "sm_90a-0000000000000000")   # a key dir, a stale marker
    finished(tmp_path / "pre" / "sm_90a-0000000000000000", "sm_90a-0000000000000000")
    finished(build.PREBUILT_DIR, "sm_90a-0000000000000000")       # a wheel for other sources
    monkeypatch.setenv("FP8LINEAR_PREBUILT", str(tmp_path / "pre"))
    cached = finished(tmp_path / "cache" / key, key)
    assert build.library_path() == cached
    assert capsys.readouterr().err == ""


def _wheel_for_other_sources(tmp_path, monkeypatch):
    finished(build.PREBUILT_DIR, "sm_90a-0000000000000000")
    return "the wheel's prebuilt kernels are for other sources (csrc/ changed)"


def _env_without_the_key(tmp_path, monkeypatch):
    finished(tmp_path / "pre" / "sm_90a-0000000000000000", "sm_90a-0000000000000000")
    monkeypatch.setenv("FP8LINEAR_PREBUILT", str(tmp_path / "pre"))
    return f"FP8LINEAR_PREBUILT={tmp_path / 'pre'} has no build for key {build.current_key()}"


def _source_install(tmp_path, monkeypatch):
    return "no prebuilt kernels (a source install)"


@pytest.mark.parametrize("setup", [_source_install, _wheel_for_other_sources,
                                   _env_without_the_key],
                         ids=["source install", "wheel for other sources",
                              "FP8LINEAR_PREBUILT without the key"])
def test_library_path_builds_now_with_one_line_saying_why(env, tmp_path, monkeypatch, capsys,
                                                          setup):
    why = setup(tmp_path, monkeypatch)
    fake = FakeCompile()
    monkeypatch.setattr(build, "_compile", fake)
    key = build.current_key()
    d = tmp_path / "cache" / key
    assert build.library_path() == d / build.LIB_NAME
    assert capsys.readouterr().err == (f"fp8linear: compiling the sm90 kernels into {d}: {why} "
                                       f"(a minute or two, once)\n")
    assert fake.calls == [(env, d, "sm_90a", d / "build.log", False)]
    meta = json.loads((d / "build.json").read_text())
    assert meta.pop("seconds") >= 0
    assert meta == {"key": key, "lib": build.LIB_NAME, "arch": "sm_90a"}
    assert sorted(os.listdir(tmp_path / "cache")) == [key, f"{key}.lock"]
    # the next process finds it in the cache: no compile, nothing said
    build.current_key.cache_clear()
    assert build.library_path() == d / build.LIB_NAME
    assert capsys.readouterr().err == "" and len(fake.calls) == 1


def test_library_path_verbose_streams_the_build_instead(env, tmp_path, monkeypatch, capsys):
    fake = FakeCompile()
    monkeypatch.setattr(build, "_compile", fake)
    d = tmp_path / "cache" / build.current_key()
    assert build.library_path(verbose=True) == d / build.LIB_NAME
    assert capsys.readouterr().err == ""
    assert fake.calls == [(env, d, "sm_90a", d / "build.log", True)]


# ----------------------------------------------------------------------------- failures
def test_failed_build_leaves_no_marker(env, tmp_path, monkeypatch, capsys):
    msg = "fp8linear: building the sm90 kernels failed (full log: x)\nerror: boom"
    monkeypatch.setattr(build, "_compile", FakeCompile(error=msg))
    key = build.current_key()
    with raises_exactly(build.BuildError, msg):
        build.library_path()
    assert not (tmp_path / "cache" / key / "build.json").exists()
    assert build.built(tmp_path / "cache" / key, key) is None
    # the next attempt compiles again instead of trusting the half-built dir
    fake = FakeCompile()
    monkeypatch.setattr(build, "_compile", fake)
    assert build.library_path() == tmp_path / "cache" / key / build.LIB_NAME
    assert len(fake.calls) == 1


def test_rebuilding_drops_the_old_marker_first(env, tmp_path, monkeypatch):
    # setup.py builds into the fixed prebuilt/ dir: a failed rebuild must not leave the old
    # marker vouching for the old library
    d = tmp_path / "prebuilt"
    finished(d, "old")
    monkeypatch.setattr(build, "_compile", FakeCompile(error="fp8linear: failed"))
    with raises_exactly(build.BuildError, "fp8linear: failed"):
        build.build_into(d, "new")
    assert not (d / "build.json").exists() and build.built(d, "old") is None
    # an unchanged key builds nothing
    lib = finished(d, "new")
    monkeypatch.setattr(build, "_compile", no_compile)
    assert build.build_into(d, "new") == lib


def test_compile_command():
    nvcc, src = Path("/cuda/bin/nvcc"), Path("/s")
    assert build.compile_command(nvcc, src / "sm90" / "gemm.cu", src, Path("/o/g.o")) == [
        "/cuda/bin/nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
        "--expt-relaxed-constexpr", "-lineinfo", "-D__CUDA_NO_HALF_OPERATORS__",
        "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__", "-Xptxas", "-v", "-Xcompiler", "-fPIC", "-Xcompiler",
        "-fvisibility=hidden", "-I", "/s", "-c", "/s/sm90/gemm.cu", "-o", "/o/g.o"]


@needs_nvcc
def test_real_compile_failure_is_reported_with_its_log(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "capi.cpp").write_text("#error deliberate\n")
    use_sources(monkeypatch, src)
    key = build.current_key()
    d = tmp_path / "cache" / key
    log = d / "build.log"
    try:
        with pytest.raises(build.BuildError) as ei:
            build.build(key, tmp_path / "cache")
    finally:
        build.current_key.cache_clear()
    head, *summary = str(ei.value).splitlines()
    assert head == f"fp8linear: building the sm90 kernels failed (full log: {log})"
    # the summary: the compiler's error lines, the #error among them
    assert f"{src / 'capi.cpp'}:1:2: error: #error deliberate" in summary
    assert summary and all("error" in line.lower() for line in summary)
    text = log.read_text()
    assert text.startswith("# fp8linear build: 1 translation units, ")
    assert f"{src / 'capi.cpp'}:1:2: error: #error deliberate" in text
    assert re.search(r"^# rc=[1-9]\d*$", text, re.M) and "# rc=0" not in text
    assert " -shared " not in text                           # no link after a failed compile
    assert sorted(os.listdir(d)) == ["build.log"]            # no marker, no objects


@needs_nvcc
def test_real_build_of_a_stub_library_loads_with_ctypes(env, tmp_path, monkeypatch, capsys):
    src = make_stub_csrc(tmp_path / "stub")
    use_sources(monkeypatch, src)
    monkeypatch.setenv("MAX_JOBS", "2")
    key = build.current_key()
    d = tmp_path / "cache" / key
    t0 = time.perf_counter()
    path = build.library_path()
    seconds = time.perf_counter() - t0
    print(f"stub library built in {seconds:.1f} s")  # (reported with -s; no bound asserted)
    assert path == d / build.LIB_NAME
    assert capsys.readouterr().err == (
        f"fp8linear: compiling the sm90 kernels into {d}: no prebuilt kernels (a source "
        f"install) (a minute or two, once)\n")
    assert sorted(os.listdir(d)) == ["build.json", "build.log", build.LIB_NAME]  # objects gone
    log = (d / "build.log").read_text()
    assert log.startswith("# fp8linear build: 2 translation units, 2 jobs\n")
    assert log.count("# rc=0\n") == 3                        # two compiles and the link
    assert "ptxas info    : Compiling entry function '_Z11stub_kernelv' for 'sm_90a'" in log

    lib = library.Library(path)
    assert lib.path == path
    zeros = bytes(library._GEMM.size)  # (any argument struct: the stub reads none)
    assert lib._quant(zeros) is None and lib._gemm(zeros) is None
    with raises_exactly(library.KernelError, "fp8linear decode: stub refuses"):
        library._check(lib._decode(zeros))
    with pytest.raises(AttributeError):
        ctypes.CDLL(str(path)).hidden_helper                 # only the entry points exported
    # the CUDA runtime is linked in: the library needs nothing of CUDA but the driver
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                            check=True).stdout
    assert "(NEEDED)" in needed and "libcudart" not in needed
    # load(): the same library, loaded once
    assert library.load().path == path and library.load() is library.load()


def _shared_library(tmp_path: Path, abi: int) -> Path:
    (tmp_path / "capi.cpp").write_text(STUB_CAPI.replace("ABI", str(abi)))
    out = tmp_path / build.LIB_NAME
    subprocess.run([CXX, "-shared", "-fPIC", "-fvisibility=hidden", str(tmp_path / "capi.cpp"),
                    "-o", str(out)], check=True)
    return out


@needs_cxx
def test_library_refuses_another_interface_version(tmp_path):
    other = library.ABI_VERSION + 1  # (a library built from other sources)
    (tmp_path / "other").mkdir()
    (tmp_path / "ours").mkdir()
    path = _shared_library(tmp_path / "other", abi=other)
    with raises_exactly(build.BuildError, f"fp8linear: {path} has interface version {other}, "
                                          f"expected {library.ABI_VERSION}; delete it to "
                                          f"rebuild"):
        library.Library(path)
    ok = _shared_library(tmp_path / "ours", abi=library.ABI_VERSION)
    assert library.Library(ok).path == ok


@needs_cxx
def test_library_refuses_argument_structs_of_another_size(tmp_path):
    (tmp_path / "capi.cpp").write_text(STUB_CAPI.replace("ABI", str(library.ABI_VERSION))
                                       .replace("e == 0 ? ", "e == 0 ? 8 + "))
    path = tmp_path / build.LIB_NAME
    subprocess.run([CXX, "-shared", "-fPIC", str(tmp_path / "capi.cpp"), "-o", str(path)],
                   check=True)
    size = -(-library._QUANT.size // 8) * 8
    with raises_exactly(build.BuildError, f"fp8linear: {path}: fp8l_quant's arguments take "
                                          f"{size + 8} bytes, tables.def's "
                                          f"{library._QUANT.size}"):
        library.Library(path)


def test_packed_fields_follow_tables_def():
    # the order the Python side packs in is checked against tables.def when it is built
    names = tuple(n for _, n in library.ENTRY_ARGS["quant"])
    assert library._layout("quant", names).size == library._QUANT.size
    with pytest.raises(AssertionError, match=r"fp8l_quant: fields \('m', 'k'\) differ"):
        library._layout("quant", ("m", "k"))


def test_load_reports_a_library_that_does_not_load(env, tmp_path, monkeypatch):
    key = build.current_key()
    path = finished(tmp_path / "cache" / key, key, b"not an ELF file")
    with pytest.raises(OSError) as dl:
        ctypes.CDLL(str(path))
    with raises_exactly(build.BuildError, f"fp8linear: {path} does not load ({dl.value}); "
                                          f"delete {path.parent} to rebuild it"):
        library.load()
    assert library._library is None


# ----------------------------------------------------------------------------- the lock
def _build_in_child(role, src, cache, compiling, queued, log):
    """One process calling library_path(); the first compiles until the second is queued on
    the lock (the second's own non-blocking try failed)."""
    os.environ["FP8LINEAR_CACHE"] = cache
    os.environ.pop("FP8LINEAR_PREBUILT", None)
    build.source_dir = lambda: Path(src)
    build.PREBUILT_DIR = Path(cache) / "no-wheel"

    def note(line):
        with open(log, "a") as f:
            f.write(line + "\n")

    def compile_(s, out_dir, arch, log_path, verbose):
        note(f"compile {role}")
        if role == "first":
            compiling.set()
            if not queued.wait(120):
                raise build.BuildError("the second process never queued on the lock")
        else:  # (a second build means the lock failed: let the first one finish too)
            queued.set()
        (out_dir / build.LIB_NAME).write_text(role)
        return out_dir / build.LIB_NAME

    build._compile = compile_
    if role == "second":
        real = fcntl.flock

        def flock(fd, op):
            if op == fcntl.LOCK_EX:
                try:
                    real(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    queued.set()     # the first process holds it: wait for it
                    return real(fd, op)
                note("second got the lock at once")
                queued.set()
                return None
            return real(fd, op)

        fcntl.flock = flock
    lib = build.library_path()
    note(f"{role} has {lib.read_text()} at {lib}")


def test_concurrent_processes_build_once(tmp_path):
    src = make_csrc(tmp_path)
    log = tmp_path / "events.log"
    ctx = multiprocessing.get_context("spawn")
    compiling, queued = ctx.Event(), ctx.Event()
    args = (str(src), str(tmp_path / "cache"), compiling, queued, str(log))
    procs = [ctx.Process(target=_build_in_child, args=("first",) + args)]
    procs[0].start()
    try:
        assert compiling.wait(120), "the first process never started its build"
        procs.append(ctx.Process(target=_build_in_child, args=("second",) + args))
        procs[1].start()
        for p in procs:
            p.join(300)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    lib = tmp_path / "cache" / build.cache_key(src) / build.LIB_NAME
    lines = log.read_text().splitlines()
    # one build; the second process waited on the lock and took the first one's library
    assert lines[0] == "compile first"
    assert sorted(lines[1:]) == [f"first has first at {lib}", f"second has first at {lib}"]


def _hold_lock(path, held, release):
    with build.file_lock(Path(path)):
        held.set()
        release.wait(300)


def _try_lock(path: Path) -> bool:
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True


def test_file_lock_excludes_and_is_released(tmp_path):
    path = tmp_path / "sub" / "k.lock"
    with build.file_lock(path):       # creates its directory
        assert not _try_lock(path)
    assert _try_lock(path)
    with pytest.raises(KeyError):     # released on an exception too
        with build.file_lock(path):
            raise KeyError
    assert _try_lock(path)


def test_file_lock_of_a_killed_process_is_released(tmp_path):
    path = tmp_path / "k.lock"
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_lock, args=(str(path), held, release))
    p.start()
    try:
        assert held.wait(120), "the child never took the lock"
        assert not _try_lock(path)
    finally:
        p.kill()
        p.join()
    assert p.exitcode == -9 and _try_lock(path)


# ----------------------------------------------------------------------------- fallback
def _one_warning(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        results = [fn(), fn()]  # asked twice, warned once
    assert [w.category for w in rec] == [UserWarning], [str(w.message) for w in rec]
    return results, str(rec[0].message)


def _fake_hopper(monkeypatch, cap=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)


def test_available_without_a_gpu(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(library, "load", no_compile)
    results, msg = _one_warning(library.available)
    assert results == [False, False]
    assert msg == "fp8linear: no CUDA device" + FALLBACK


def test_available_without_nvcc(env, tmp_path, monkeypatch, capsys):
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    results, msg = _one_warning(library.available)
    assert results == [False, False]
    assert msg == NVCC_MISSING + FALLBACK
    d = tmp_path / "cache" / build.current_key()
    assert capsys.readouterr().err == (f"fp8linear: compiling the sm90 kernels into {d}: no "
                                       f"prebuilt kernels (a source install) (a minute or two, "
                                       f"once)\n")
    assert not (d / "build.json").exists()


def test_available_on_a_non_hopper_gpu(env, monkeypatch):
    _fake_hopper(monkeypatch, cap=(8, 9))
    monkeypatch.setattr(library, "load", no_compile)  # not even tried
    results, msg = _one_warning(library.available)
    assert results == [False, False]
    assert msg == ("fp8linear: the CUDA kernels need an sm_90 (Hopper) GPU, this one is sm_89"
                   + FALLBACK)


def test_available_puts_the_build_log_after_the_verdict(env, monkeypatch):
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(build, "_compile", FakeCompile(
        error="fp8linear: building the sm90 kernels failed (full log: L)\na.cu:1: error: x"))
    results, msg = _one_warning(library.available)
    assert results == [False, False]
    assert msg == ("fp8linear: building the sm90 kernels failed (full log: L)" + FALLBACK
                   + "\na.cu:1: error: x")


def test_available_on_hopper_with_the_library(env, monkeypatch):
    _fake_hopper(monkeypatch)
    loads = []
    monkeypatch.setattr(library, "load", lambda: loads.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert library.available() is True and library.available() is True
    assert loads == [1]


def test_find_cuda_home_honours_cuda_home(tmp_path, monkeypatch):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert build.find_cuda_home() != home  # nvcc without headers is no toolkit
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    assert build.find_cuda_home() == home
    assert build.require_nvcc() == home / "bin" / "nvcc"


def test_dispatch_falls_back_to_triton_without_nvcc(env, monkeypatch, capsys):
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    with pytest.warns(UserWarning, match=rf"\A{re.escape(NVCC_MISSING + FALLBACK)}\Z"):
        assert dispatch._cuda_default(0) == "triton"


def test_dispatch_skips_the_build_on_other_gpus(env, monkeypatch):
    _fake_hopper(monkeypatch, cap=(8, 0))
    from fp8linear.backends.sm90 import backend as sm90
    monkeypatch.setattr(sm90, "available", no_compile)  # not even asked
    assert dispatch._cuda_default(0) == "triton"


# ----------------------------------------------------------------------------- precompile
def test_precompile_errors(env, monkeypatch):
    with raises_exactly(ValueError, "fp8linear: unsupported arch 'sm_80'; supported: "
                                    "['sm_90a']"):
        build.precompile(arch="sm_80")
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    monkeypatch.setattr(build, "_compile", no_compile)
    with raises_exactly(build.ToolkitMissingError, NVCC_MISSING):
        build.precompile(verbose=False)
    assert not (env.parent / "cache").exists()   # nothing made on the way


@pytest.mark.parametrize("where", ["env", "wheel", "cache"])
def test_precompile_finds_a_finished_build_without_nvcc(env, tmp_path, monkeypatch, capsys,
                                                        where):
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    monkeypatch.setattr(build, "_compile", no_compile)
    key = build.current_key()
    d = {"env": tmp_path / "pre" / key, "wheel": build.PREBUILT_DIR,
         "cache": tmp_path / "cache" / key}[where]
    lib = finished(d, key)
    monkeypatch.setenv("FP8LINEAR_PREBUILT", str(tmp_path / "pre"))
    assert build.precompile() == (lib, False)
    assert capsys.readouterr() == ("", "")


def test_precompile_compiles_into_the_cache(env, tmp_path, monkeypatch, capsys):
    fake = FakeCompile()
    monkeypatch.setattr(build, "_compile", fake)
    d = tmp_path / "cache" / build.current_key()
    assert build.precompile() == (d / build.LIB_NAME, True)
    assert fake.calls == [(env, d, "sm_90a", d / "build.log", True)]  # verbose by default
    assert capsys.readouterr() == ("", "")
    assert build.precompile(verbose=False) == (d / build.LIB_NAME, False)
    assert len(fake.calls) == 1
