"""The sm_90a kernel library (csrc/): where it comes from, and its build.

The kernels and their C entry points (csrc/capi.cpp) build into one shared library that
depends on neither torch nor Python (the CUDA runtime linked statically), so one build serves
every torch and Python version. ``library_path()`` finds it, first match wins:

1. ``FP8LINEAR_PREBUILT=<dir>`` holding ``<key>/`` (a cache root's layout, made elsewhere);
2. the copy a platform wheel carries (``prebuilt/`` beside this file), if its key matches;
3. the cache ``<FP8LINEAR_CACHE or ~/.cache/fp8linear>/<key>/``;
4. otherwise it is built now, with one line on stderr saying why, into the cache.

``key`` hashes every source file, the flags and the arch (``cache_key``). A file lock per key
makes concurrent processes (vLLM's tensor-parallel workers) wait for one build. ``library.py``
loads the result; ``precompile()`` backs ``fp8linear build`` (no GPU needed).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

LIB_NAME = "libfp8linear_sm90.so"
ARCH = "sm_90a"  # wgmma / TMA / setmaxnreg exist only on the arch-specific sm_90a target
_GENCODE = {"sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}

# Flags for every translation unit. The defines keep half/bfloat16 types free of implicit
# conversions (torch's extension builds set them; the kernels were written and tuned with
# them). -Xptxas -v puts registers/smem/spills of every kernel into the build log.
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo",
              "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
              "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]
PTXAS_VERBOSE = ["-Xptxas", "-v"]
# position-independent, only the C entry points exported
HOST_FLAGS = ["-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden"]
# static CUDA runtime: the library needs nothing of the environment but the driver
LINK_FLAGS = ["-shared", "--cudart", "static"]
SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".hpp", ".inl", ".def")
# Bump when the build recipe changes in a way the flags above do not show.
_RECIPE_VERSION = 2
_MARKER = "build.json"
_LOG = "build.log"
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"


class BuildError(RuntimeError):
    """The kernel library could not be built or loaded."""


class ToolkitMissingError(BuildError):
    """No CUDA toolkit (nvcc) to compile with."""


# ----------------------------------------------------------------------------- sources
def source_dir() -> Path:
    """The CUDA sources: package data ``fp8linear/csrc`` when installed, else the checkout's."""
    installed = Path(__file__).resolve().parents[2] / "csrc"
    repo = Path(__file__).resolve().parents[3] / "csrc"
    for d in (installed, repo):
        if (d / "capi.cpp").is_file():
            return d
    raise BuildError(f"fp8linear: CUDA sources not found (neither {installed} nor {repo}); "
                     f"reinstall fp8linear")


def source_files(src: Path) -> list[Path]:
    """Every file whose content goes into the build (and so into the key), sorted."""
    return sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES
                  and "__pycache__" not in p.parts)


def translation_units(src: Path) -> list[Path]:
    return [src / "capi.cpp"] + sorted(src.rglob("*.cu"))


def cache_key(src: Path, *, arch: str = ARCH) -> str:
    """Names one build: the arch, then a hash of sources, flags and recipe. Paths enter
    relative to ``src``: a checkout, an installed copy and a wheel give the same key."""
    h = hashlib.sha256()
    meta = {"recipe": _RECIPE_VERSION, "arch": arch, "nvcc": NVCC_FLAGS, "host": HOST_FLAGS,
            "link": LINK_FLAGS, "name": LIB_NAME}
    h.update(json.dumps(meta, sort_keys=True).encode())
    for f in source_files(src):
        rel = f.relative_to(src).as_posix().encode()
        data = f.read_bytes()
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return f"{arch}-{h.hexdigest()[:16]}"


@functools.lru_cache(maxsize=None)
def current_key(arch: str = ARCH) -> str:
    return cache_key(source_dir(), arch=arch)


def device_arch(index: int | None = None) -> str:
    """The build arch for the current CUDA device; BuildError unless it is Hopper (sm_90)."""
    import torch
    if not torch.cuda.is_available():
        raise BuildError("fp8linear: no CUDA device")
    idx = torch.cuda.current_device() if index is None else index
    major, minor = torch.cuda.get_device_capability(idx)
    if (major, minor) != (9, 0):
        raise BuildError(f"fp8linear: the CUDA kernels need an sm_90 (Hopper) GPU, this one is "
                         f"sm_{major}{minor}")
    return ARCH


def cache_root() -> Path:
    from ... import knobs  # (here, not at the top: setup.py loads this file on its own)
    env = knobs.get(knobs.CACHE)
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "fp8linear"


# ----------------------------------------------------------------------------- toolchain
def _has_toolkit(home: Path) -> bool:
    # A bin/nvcc alone is not enough: /usr/local/bin/nvcc is often a wrapper script, and
    # /usr/local has no CUDA headers.
    return (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime.h").is_file()


def find_cuda_home() -> Path | None:
    """The CUDA toolkit to compile with: CUDA_HOME / CUDA_PATH, nvcc on PATH, /usr/local/cuda;
    None when there is none."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    cands.append("/usr/local/cuda")
    for c in cands:
        if c and _has_toolkit(Path(c)):
            return Path(c)
    return None


def require_nvcc() -> Path:
    home = find_cuda_home()
    if home is None:
        raise ToolkitMissingError(
            "fp8linear: nvcc not found (set CUDA_HOME or install the CUDA toolkit)")
    return home / "bin" / "nvcc"


def nvcc_flags(arch: str = ARCH) -> list[str]:
    """The flags of every translation unit (compile only)."""
    if arch not in _GENCODE:
        raise ValueError(f"fp8linear: unsupported arch {arch!r}; supported: {sorted(_GENCODE)}")
    return [_GENCODE[arch]] + NVCC_FLAGS


def compile_command(nvcc: Path, tu: Path, src: Path, obj: Path, arch: str = ARCH) -> list[str]:
    return ([str(nvcc)] + nvcc_flags(arch) + PTXAS_VERBOSE + HOST_FLAGS
            + ["-I", str(src), "-c", str(tu), "-o", str(obj)])


# ----------------------------------------------------------------------------- build
def _compile(src: Path, out_dir: Path, arch: str, log_path: Path, verbose: bool) -> Path:
    """Builds ``out_dir/LIB_NAME`` from ``src``; BuildError with the log's errors."""
    nvcc = require_nvcc()
    tus = translation_units(src)
    objs = [out_dir / (tu.relative_to(src).as_posix().replace("/", "_") + ".o") for tu in tus]
    cmds = [compile_command(nvcc, tu, src, obj, arch) for tu, obj in zip(tus, objs)]
    link = [str(nvcc), _GENCODE[arch]] + LINK_FLAGS + [str(o) for o in objs] + [
        "-o", str(out_dir / LIB_NAME)]
    jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)

    def run(cmd):
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        return cmd, p.returncode, p.stdout + p.stderr

    with open(log_path, "w") as log:
        log.write(f"# fp8linear build: {len(tus)} translation units, {jobs} jobs\n")
        with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
            results = list(ex.map(run, cmds))
        if all(rc == 0 for _, rc, _ in results):
            results.append(run(link))
        for cmd, rc, text in results:
            log.write(f"$ {' '.join(cmd)}\n{text}# rc={rc}\n")
            if verbose:
                sys.stdout.write(text)
        failed = [r for r in results if r[1] != 0]
    for obj in objs:  # dead weight once linked: a keyed dir never rebuilds incrementally
        obj.unlink(missing_ok=True)
    if failed:
        raise BuildError(f"fp8linear: building the sm90 kernels failed (full log: {log_path})"
                         f"\n{_error_summary(failed[0][2])}")
    return out_dir / LIB_NAME


def _error_summary(text: str, limit: int = 40) -> str:
    lines = text.splitlines()
    errs = [ln for ln in lines if "error" in ln.lower()]
    return "\n".join((errs or lines)[-limit:])


@contextlib.contextmanager
def file_lock(path: Path):
    """Exclusive inter-process lock; released by the OS if the holder dies."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def built(d: Path, key: str) -> Path | None:
    """The library in ``d`` if it holds a finished build of ``key``."""
    try:
        meta = json.loads((d / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    lib = d / meta.get("lib", "")
    return lib if meta.get("key") == key and lib.is_file() else None


def build_into(d: Path, key: str, *, arch: str = ARCH, verbose: bool = False) -> Path:
    """Builds the library into ``d`` (with its marker) unless it holds ``key`` already."""
    lib = built(d, key)
    if lib is not None:
        return lib
    d.mkdir(parents=True, exist_ok=True)
    (d / _MARKER).unlink(missing_ok=True)
    t0 = time.time()
    lib = _compile(source_dir(), d, arch, d / _LOG, verbose)
    meta = {"key": key, "lib": lib.name, "arch": arch, "seconds": round(time.time() - t0, 1)}
    tmp = d / (_MARKER + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, d / _MARKER)  # the marker appears only once the build is whole
    return lib


def build(key: str, root: Path, *, arch: str = ARCH, verbose: bool = False) -> Path:
    """Builds ``root/<key>/`` under ``root/<key>.lock`` (concurrent callers build once)."""
    with file_lock(root / f"{key}.lock"):
        return build_into(root / key, key, arch=arch, verbose=verbose)


def _prebuilt(key: str) -> tuple[Path | None, str]:
    """(library, "") from FP8LINEAR_PREBUILT or the wheel, else (None, why not)."""
    from ... import knobs
    env = knobs.get(knobs.PREBUILT)
    if env:
        lib = built(Path(env).expanduser().resolve() / key, key)
        if lib is not None:
            return lib, ""
    lib = built(PREBUILT_DIR, key)
    if lib is not None:
        return lib, ""
    if (PREBUILT_DIR / _MARKER).is_file():
        return None, "the wheel's prebuilt kernels are for other sources (csrc/ changed)"
    return None, ("no prebuilt kernels (a source install)" if not env else
                  f"FP8LINEAR_PREBUILT={env} has no build for key {key}")


def library_path(arch: str = ARCH, verbose: bool = False) -> Path:
    """The library for the current sources: prebuilt, cached, or built now (then cached)."""
    key = current_key(arch)
    lib, why = _prebuilt(key)
    if lib is not None:
        return lib
    root = cache_root()
    lib = built(root / key, key)
    if lib is not None:
        return lib
    if not verbose:  # a minute-long pause on first use deserves one line of explanation
        print(f"fp8linear: compiling the sm90 kernels into {root / key}: {why} (a minute or "
              f"two, once)", file=sys.stderr, flush=True)
    return build(key, root, arch=arch, verbose=verbose)


def precompile(verbose: bool = True, arch: str = ARCH) -> tuple[Path, bool]:
    """``fp8linear build``: (the library load() will use, whether it was compiled now).
    Needs no GPU; ToolkitMissingError without nvcc, BuildError on compile errors."""
    nvcc_flags(arch)  # validates arch
    key = current_key(arch)
    lib, _ = _prebuilt(key)
    if lib is not None:
        return lib, False
    lib = built(cache_root() / key, key)
    if lib is not None:
        return lib, False
    require_nvcc()
    return build(key, cache_root(), arch=arch, verbose=verbose), True
