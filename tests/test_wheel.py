"""The wheels (issue 41), built from a copy of the checkout's tracked files (the checkout stays
as it is).

``FP8LINEAR_BUILD_KERNELS=1 python -m build --wheel`` compiles every kernel with nvcc (no GPU
needed; a few minutes on two cores) into a py3-none-manylinux_2_34 wheel that carries the
library prebuilt: it must hold only the package, depend on nothing of CUDA, torch or Python,
export exactly the C entry points, and, once installed, be what fp8linear loads with
nothing to compile. Plain ``python -m build --wheel`` is the pure wheel: no binary at all.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from fp8linear.backends.sm90 import build

REPO = Path(__file__).resolve().parents[1]
PRE = "fp8linear/backends/sm90/prebuilt/"
ENTRY_POINTS = {"fp8l_abi_version", "fp8l_arg_size", "fp8l_quant", "fp8l_gemm", "fp8l_decode"}
# what a self-contained library may need: the C/C++ runtime of the system, nothing else
SYSTEM_LIBS = re.compile(r"(libc|libm|libgcc_s|libstdc\+\+|libdl|libpthread|librt)\.so\.\d+"
                         r"|ld-linux-x86-64\.so\.2")
GLIBC_OF_THE_TAG = (2, 34)  # manylinux_2_34


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [f for f in out.stdout.decode().split("\0") if f]


def build_wheel(tmp: Path, kernels: bool) -> Path:
    """Copies the tracked files to tmp/src and builds a wheel there; the wheel's path."""
    src = tmp / "src"
    for f in tracked_files():
        if (REPO / f).is_file():  # (a tracked file deleted in the work tree is left out)
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    env = {k: v for k, v in os.environ.items()
           if k not in ("FP8LINEAR_BUILD_KERNELS", "FP8LINEAR_PREBUILT", "FP8LINEAR_CACHE")}
    if kernels:
        env["FP8LINEAR_BUILD_KERNELS"] = "1"
    p = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                        str(tmp / "dist"), str(src)], cwd=src, env=env, capture_output=True,
                       text=True)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    wheels = sorted((tmp / "dist").iterdir())
    assert len(wheels) == 1, wheels
    return wheels[0]


def wheel_meta(zf: zipfile.ZipFile) -> tuple[str, list[str]]:
    """(the version, the WHEEL file's lines)."""
    info = [n for n in zf.namelist() if re.fullmatch(r"fp8linear-[^/]+\.dist-info/WHEEL", n)]
    assert len(info) == 1, info
    version = info[0][len("fp8linear-"):-len(".dist-info/WHEEL")]
    return version, zf.read(info[0]).decode().splitlines()


def check_layout(names: list[str], version: str) -> None:
    """Only the two packages and the dist-info; no tests, benchmarks, build leftovers."""
    assert {n.split("/")[0] for n in names} == {
        "fp8linear", "fp8linear_vllm", f"fp8linear-{version}.dist-info"}
    stray = [n for n in names if set(n.split("/")) & {"tests", "benchmarks", ".dev", "scripts",
                                                     "docs", "build", "__pycache__"}
             or n.endswith((".o", ".pyc", "build.log", ".lock", ".tmp"))]
    assert stray == []
    tracked = tracked_files()
    # the Python modules, and the CUDA sources the JIT build compiles from
    want = ({f for f in tracked if f.startswith("fp8linear/") and f.endswith(".py")}
            | {"fp8linear_vllm/" + f[len("integrations/vllm/"):] for f in tracked
               if f.startswith("integrations/vllm/") and f.endswith(".py")}
            | {"fp8linear/" + f for f in tracked if f.startswith("csrc/")})
    have = {n for n in names if not n.startswith((f"fp8linear-{version}.dist-info/", PRE))}
    assert have == want


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", *args], capture_output=True, text=True,
                          check=True).stdout


def needed(lib: Path) -> list[str]:
    if shutil.which("readelf"):
        return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", str(lib)))
    out = subprocess.run(["objdump", "-p", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"^\s*NEEDED\s+(\S+)$", out, re.M)


def exported(lib: Path) -> dict[str, tuple[str, str]]:
    """Defined dynamic symbols: name -> (type, binding)."""
    if shutil.which("readelf"):
        syms = {}
        for line in readelf("--dyn-syms", "-W", str(lib)).splitlines():
            cols = line.split()
            if len(cols) >= 8 and cols[0].endswith(":") and cols[6] != "UND":
                syms[cols[7].split("@")[0]] = (cols[3], cols[4])
        return syms
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                         text=True, check=True).stdout
    return {c[2].split("@")[0]: ({"T": "FUNC"}.get(c[1], c[1]), "GLOBAL")
            for c in (ln.split() for ln in out.splitlines()) if len(c) == 3}


def newest_glibc(lib: Path) -> tuple[int, ...]:
    if shutil.which("readelf"):
        text = readelf("-V", "-W", str(lib))
    else:
        text = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True,
                              check=True).stdout
    versions = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_(\d+(?:\.\d+)+)",
                                                                       text)}
    assert versions
    return max(versions)


@pytest.fixture(scope="module")
def platform_wheel(tmp_path_factory):
    if build.find_cuda_home() is None:
        pytest.skip("nvcc not found: the platform wheel compiles the kernels")
    tmp = tmp_path_factory.mktemp("platform_wheel")
    had_build_dir = (REPO / "build").exists()
    wheel = build_wheel(tmp, kernels=True)
    assert (REPO / "build").exists() == had_build_dir  # built in the copy, not the checkout
    unpacked = tmp / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    return wheel, unpacked


def check_tag(wheel, tag: str, purelib: bool):
    """The wheel's file name and WHEEL metadata carry ``tag``; -> (version, file names)."""
    with zipfile.ZipFile(wheel) as zf:
        version, meta = wheel_meta(zf)
        names = zf.namelist()
    assert wheel.name == f"fp8linear-{version}-{tag}.whl"
    assert [ln for ln in meta if ln.startswith(("Tag:", "Root-Is-Purelib:"))] == [
        f"Root-Is-Purelib: {str(purelib).lower()}", f"Tag: {tag}"]
    return version, names


def test_platform_wheel_tag_and_contents(platform_wheel):
    wheel, unpacked = platform_wheel
    version, names = check_tag(wheel, "py3-none-manylinux_2_34_x86_64", purelib=False)
    check_layout(names, version)
    assert sorted(n for n in names if n.startswith(PRE)) == [PRE + "build.json",
                                                              PRE + build.LIB_NAME]
    marker = json.loads((unpacked / PRE / "build.json").read_text())
    assert marker.pop("seconds") > 0
    # built from the sources the wheel carries: an installed wheel finds it matching
    assert marker == {"key": build.cache_key(unpacked / "fp8linear" / "csrc"),
                      "lib": build.LIB_NAME, "arch": "sm_90a"}


def test_platform_wheel_library_is_self_contained(platform_wheel):
    lib = platform_wheel[1] / PRE / build.LIB_NAME
    libs = needed(lib)
    assert "libc.so.6" in libs
    assert [n for n in libs if not SYSTEM_LIBS.fullmatch(n)] == []  # no torch, Python, cudart
    assert newest_glibc(lib) <= GLIBC_OF_THE_TAG
    syms = exported(lib)
    assert {s for s in syms if s.startswith("fp8l_")} == ENTRY_POINTS
    assert {syms[s] for s in ENTRY_POINTS} == {("FUNC", "GLOBAL")}


def test_platform_wheel_installs_and_loads_with_nothing_to_compile(platform_wheel, tmp_path):
    wheel, _ = platform_wheel
    target = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                        "--target", str(target), str(wheel)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8LINEAR_")}
    env.update(PYTHONPATH=str(target), FP8LINEAR_CACHE=str(tmp_path / "cache"))
    code = textwrap.dedent("""
        import json
        import fp8linear
        from fp8linear.backends.sm90 import build, library
        path = build.library_path()
        lib = library.Library(path)
        print(json.dumps({"package": fp8linear.__file__, "sources": str(build.source_dir()),
                          "path": str(path), "loaded": str(lib.path),
                          "load": str(library.load().path)}))
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=run_dir, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    prebuilt = target / PRE / build.LIB_NAME
    assert json.loads(p.stdout) == {
        "package": str(target / "fp8linear" / "__init__.py"),
        "sources": str(target / "fp8linear" / "csrc"),
        "path": str(prebuilt), "loaded": str(prebuilt), "load": str(prebuilt)}
    assert p.stderr == ""                       # no "compiling the sm90 kernels" line
    p = subprocess.run([sys.executable, "-m", "fp8linear.cli", "build"], cwd=run_dir, env=env,
                       capture_output=True, text=True, timeout=300)
    assert (p.returncode, p.stdout, p.stderr) == (
        0, f"fp8linear build: nothing to compile, the kernels are ready: {prebuilt}\n", "")
    assert not (tmp_path / "cache").exists()    # nothing built, nothing cached


def test_pure_wheel(tmp_path):
    wheel = build_wheel(tmp_path, kernels=False)
    version, names = check_tag(wheel, "py3-none-any", purelib=True)
    check_layout(names, version)
    assert [n for n in names if n.startswith(PRE) or n.endswith(".so")] == []
