"""Just-in-time build of the sm_90a extension (csrc/) and its on-disk cache.

``load()`` returns the compiled module (functions ``gemm``, ``quant``, ``decode``, ...), built
on first use with ``torch.utils.cpp_extension.load`` (ninja compiles the .cu translation units
in parallel; MAX_JOBS caps it) into ``<root>/<key>/``, where ``root`` is ``FP8LINEAR_CACHE`` or
``~/.cache/fp8linear`` and ``key`` hashes every source file, the flags, the GPU arch and the
torch / CUDA / Python versions (``cache_key``). A file lock per key makes concurrent processes
(vLLM tensor-parallel workers) wait for one build instead of building over each other.

``FP8LINEAR_PREBUILT=<dir>`` holding ``<key>/`` (same layout as a cache root, e.g. made by
``scripts/prebuild_device_ext.sh``) is loaded as is: no compiler needed.

``available()`` is the cheap, cached yes/no the dispatcher asks; on "no" it warns once, naming
what is missing. ``precompile()`` backs the ``fp8linear build`` command (no GPU needed).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from ... import knobs

EXT_NAME = "fp8linear_sm90_C"
ARCH = "sm_90a"  # wgmma / TMA / setmaxnreg exist only on the arch-specific sm_90a target
_GENCODE = {"sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}

# Flags for the .cu translation units (torch adds its own -D__CUDA_NO_HALF_* defines, see
# torch_nvcc_flags). -Xptxas -v puts registers/smem/spills of every kernel into the build log.
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
PTXAS_VERBOSE = ["-Xptxas", "-v"]
CXX_FLAGS = ["-O3"]  # bindings.cpp: torch supplies -std and -fPIC
SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".hpp", ".inl", ".def")
# Bump when the build recipe changes in a way the flags above do not show.
_RECIPE_VERSION = 1
_MARKER = "build.json"
_LOG = "build.log"

# The defines torch.utils.cpp_extension puts on every nvcc command line (COMMON_NVCC_FLAGS),
# used where torch's own list cannot be imported: scripts/check_kernels.py must compile the
# kernels exactly as the JIT build will.
_TORCH_NVCC_FLAGS_FALLBACK = [
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


class BuildError(RuntimeError):
    """The extension could not be built or loaded."""


class ToolkitMissingError(BuildError):
    """No CUDA toolkit (nvcc) to compile with."""


# ----------------------------------------------------------------------------- sources
def source_dir() -> Path:
    """The CUDA sources: package data ``fp8linear/csrc`` when installed, else the checkout's csrc/."""
    try:
        from importlib import resources
        p = resources.files("fp8linear.csrc")
        if isinstance(p, Path) and (p / "bindings.cpp").is_file():
            return p
        spec = importlib.util.find_spec("fp8linear.csrc")  # namespace package: no __init__.py
        for loc in (spec.submodule_search_locations or []) if spec else []:
            if (Path(loc) / "bindings.cpp").is_file():
                return Path(loc)
    except (ImportError, TypeError, ValueError):
        pass
    repo = Path(__file__).resolve().parents[3] / "csrc"
    if (repo / "bindings.cpp").is_file():
        return repo
    raise BuildError(f"fp8linear: CUDA sources not found (no fp8linear/csrc package data and no "
                     f"{repo}); reinstall fp8linear")


def source_files(src: Path) -> list[Path]:
    """Every file whose content goes into the build (and so into the key), sorted."""
    return sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES
                  and "__pycache__" not in p.parts)


def translation_units(src: Path) -> list[Path]:
    # bindings.cpp is the one torch-header TU; all kernels are .cu TUs compiled in parallel.
    return [src / "bindings.cpp"] + sorted(src.rglob("*.cu"))


# ----------------------------------------------------------------------------- the key
def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def cache_key(src: Path, *, arch: str, torch_version: str, cuda_version: str | None,
              python: str) -> str:
    """Names one build: readable versions, then a hash of sources, flags and versions.

    The sole key function: the JIT build, ``precompile`` and the prebuild script all use it, so
    an extension built on a CPU machine against the device's torch is found on the device.
    Paths enter relative to ``src``: a checkout and an installed copy give the same key.
    """
    h = hashlib.sha256()
    meta = {"recipe": _RECIPE_VERSION, "arch": arch, "torch": torch_version,
            "cuda": cuda_version, "python": python, "nvcc": NVCC_FLAGS, "cxx": CXX_FLAGS,
            "name": EXT_NAME}
    h.update(json.dumps(meta, sort_keys=True).encode())
    for f in source_files(src):
        rel = f.relative_to(src).as_posix().encode()
        data = f.read_bytes()
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return f"{arch}-torch{torch_version}-cu{cuda_version or 'none'}-py{python}-{h.hexdigest()[:16]}"


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


def current_key(arch: str | None = None) -> str:
    import torch
    return cache_key(source_dir(), arch=arch or device_arch(), torch_version=torch.__version__,
                     cuda_version=torch.version.cuda, python=python_version())


def cache_root() -> Path:
    env = knobs.get(knobs.CACHE)
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "fp8linear"


# ----------------------------------------------------------------------------- toolchain
def _has_toolkit(home: Path) -> bool:
    # A bin/nvcc alone is not enough: /usr/local/bin/nvcc is often a wrapper script, and
    # /usr/local has no CUDA headers.
    return (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime.h").is_file()


def find_cuda_home() -> Path | None:
    """The CUDA toolkit to compile with: CUDA_HOME / CUDA_PATH, nvcc on PATH, /usr/local/cuda,
    then torch's guess; None when there is none."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    cands.append("/usr/local/cuda")
    for c in cands:
        if c and _has_toolkit(Path(c)):
            return Path(c)
    try:
        from torch.utils import cpp_extension
        if cpp_extension.CUDA_HOME and _has_toolkit(Path(cpp_extension.CUDA_HOME)):
            return Path(cpp_extension.CUDA_HOME)
    except Exception:  # noqa: BLE001  (torch's probe can fail in odd ways; it is a last guess)
        pass
    return None


def _ninja_bin_dir() -> str | None:
    """Directory to put on PATH for ninja; '' when already on PATH, None when absent."""
    if shutil.which("ninja"):
        return ""
    try:
        import ninja  # the PyPI wheel ships the binary; its bin dir may not be on PATH
        return ninja.BIN_DIR
    except (ImportError, AttributeError):
        return None


def require_toolchain() -> dict[str, str]:
    """Environment for the build process; ToolkitMissingError naming what is missing."""
    home = find_cuda_home()
    if home is None:
        raise ToolkitMissingError(
            "fp8linear: nvcc not found (set CUDA_HOME or install the CUDA toolkit)")
    ninja_dir = _ninja_bin_dir()
    if ninja_dir is None:
        raise ToolkitMissingError("fp8linear: ninja not found (pip install ninja)")
    env = dict(os.environ, CUDA_HOME=str(home))
    path = [str(home / "bin")] + ([ninja_dir] if ninja_dir else [])
    env["PATH"] = os.pathsep.join(path + [env.get("PATH", "")])
    return env


def wheel_include_dirs() -> list[str]:
    """Header dirs of the nvidia-* wheels that CUDA builds of torch depend on.

    torch's ATen/cuda headers include cuBLAS/cuSPARSE headers, which a minimal CUDA toolkit
    (nvcc + cudart only) lacks; the wheels next to torch carry them. Passed to the host
    compiler as -idirafter, so a full toolkit's own headers always win.
    """
    spec = importlib.util.find_spec("nvidia")
    locs = list(spec.submodule_search_locations or []) if spec else []
    return sorted(str(d) for loc in locs for d in Path(loc).glob("*/include") if d.is_dir())


def torch_nvcc_flags() -> list[str]:
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
        return list(COMMON_NVCC_FLAGS)
    except Exception:  # noqa: BLE001  (no torch, or a torch that renamed it)
        return list(_TORCH_NVCC_FLAGS_FALLBACK)


def nvcc_flags(arch: str = ARCH) -> list[str]:
    """Our flags for the .cu TUs (torch's defines come on top in the JIT build)."""
    if arch not in _GENCODE:
        raise ValueError(f"fp8linear: unsupported arch {arch!r}; supported: {sorted(_GENCODE)}")
    return [_GENCODE[arch]] + NVCC_FLAGS


# ----------------------------------------------------------------------------- build
# Run in a child interpreter: the ninja/nvcc/ptxas output lands in the build log without
# touching the parent's stdout (vLLM workers log there), and torch imports the result once,
# which proves it links (RTLD_NOW) before anyone waits on it.
_CHILD = r"""
import json, sys
cfg = json.loads(sys.argv[1])
from torch.utils import cpp_extension
cpp_extension.load(name=cfg["name"], sources=cfg["sources"], extra_cflags=cfg["cxx"],
                   extra_cuda_cflags=cfg["nvcc"], extra_include_paths=[cfg["include"]],
                   build_directory=cfg["build_dir"], with_cuda=True, verbose=True)
"""


def _compile(src: Path, build_dir: Path, arch: str, log_path: Path, verbose: bool) -> None:
    """Builds ``build_dir/EXT_NAME.so`` from ``src``; BuildError with the log's errors."""
    env = require_toolchain()
    if not verbose:  # a minute-long pause on first use deserves one line of explanation
        print(f"fp8linear: compiling the sm90 kernels into {build_dir} (first use; takes a "
              f"minute or two, then cached)", file=sys.stderr, flush=True)
    cxx = CXX_FLAGS + [f"-idirafter{d}" for d in wheel_include_dirs()]
    cfg = {"name": EXT_NAME, "sources": [str(p) for p in translation_units(src)],
           "cxx": cxx, "nvcc": nvcc_flags(arch) + PTXAS_VERBOSE, "include": str(src),
           "build_dir": str(build_dir)}
    with open(log_path, "w") as log:
        log.write(f"# fp8linear build: {json.dumps(cfg)}\n# CUDA_HOME={env['CUDA_HOME']}\n")
        log.flush()
        # the context manager closes the pipe (no leaked file descriptor per build) and waits
        with subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(cfg)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace") as proc:
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    sys.stdout.write(line)
                    sys.stdout.flush()
        rc = proc.returncode
    if rc != 0:
        raise BuildError(f"fp8linear: building the sm90 extension failed (full log: {log_path})"
                         f"\n{_error_summary(log_path.read_text(errors='replace'))}")


def _error_summary(text: str, limit: int = 40) -> str:
    lines = text.splitlines()
    errs = [ln for ln in lines if "error" in ln.lower() and not ln.startswith("#")]
    return "\n".join((errs or lines)[-limit:])


def _drop_intermediates(build_dir: Path) -> None:
    # Object files are dead weight once linked (a keyed dir never rebuilds incrementally), and
    # a prebuilt dir has to travel in a size-capped copy.
    for p in build_dir.glob("*.o"):
        p.unlink()


@contextlib.contextmanager
def file_lock(path: Path):
    """Exclusive inter-process lock; released by the OS if the holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import filelock
    except ImportError:
        filelock = None
    if filelock is not None:
        with filelock.FileLock(str(path)):
            yield
        return
    import fcntl
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _built(d: Path, key: str) -> Path | None:
    """The .so in ``d`` if it holds a finished build of ``key``."""
    try:
        meta = json.loads((d / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    so = d / meta.get("so", "")
    return so if meta.get("key") == key and so.is_file() else None


def _import(so: Path, name: str = EXT_NAME):
    # torch first: the extension resolves libtorch/libc10/libcudart from the loaded process.
    # (A second build loaded under the same module name is not a second module: Python hands
    # back the first one. Dev variants are built under their own name, see
    # scripts/prebuild_device_ext.sh.)
    import torch  # noqa: F401
    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    spec = importlib.util.spec_from_file_location(name, str(so), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def build(key: str, root: Path, *, arch: str, verbose: bool = False) -> Path:
    """Builds ``root/<key>/`` unless it is already complete; returns the .so path.

    Holds ``root/<key>.lock`` throughout, so concurrent callers build once and the others find
    the finished build when they get the lock.
    """
    d = root / key
    with file_lock(root / f"{key}.lock"):
        so = _built(d, key)
        if so is not None:
            return so
        d.mkdir(parents=True, exist_ok=True)
        (d / _MARKER).unlink(missing_ok=True)
        t0 = time.time()
        _compile(source_dir(), d, arch, d / _LOG, verbose)
        so = d / f"{EXT_NAME}.so"
        if not so.is_file():
            raise BuildError(f"fp8linear: the build finished but {so} is missing (log: {d / _LOG})")
        _drop_intermediates(d)
        meta = {"key": key, "so": so.name, "arch": arch, "seconds": round(time.time() - t0, 1)}
        tmp = d / (_MARKER + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, d / _MARKER)  # the marker appears only once the build is whole
        return so


def _load_prebuilt(key: str):
    """(module, .so path) from FP8LINEAR_PREBUILT/<key>/, or (None, None) with a warning
    saying why."""
    env = knobs.get(knobs.PREBUILT)
    if not env:
        return None, None
    base = Path(env).expanduser().resolve()
    so = _built(base / key, key)
    if so is None:
        have = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
        warnings.warn(f"fp8linear: FP8LINEAR_PREBUILT={env} has no build for key {key} (it has "
                      f"{have or 'nothing'}); compiling instead", stacklevel=4)
        return None, None
    try:
        return _import(so), so
    except ImportError as e:  # e.g. built against another glibc/libstdc++ than this machine's
        warnings.warn(f"fp8linear: prebuilt {so} does not load ({e}); compiling instead",
                      stacklevel=4)
        return None, None


_module = None
_module_lock = threading.Lock()


def load():
    """The compiled extension module: prebuilt, cached, or built now (then cached).

    Fast after the first call (the hot path calls it per launch).
    """
    global _module
    if _module is not None:
        return _module
    with _module_lock:
        if _module is None:
            key = current_key()
            mod, _ = _load_prebuilt(key)
            if mod is None:
                so = build(key, cache_root(), arch=ARCH)
                try:
                    mod = _import(so)
                except ImportError as e:
                    raise BuildError(f"fp8linear: {so} does not load ({e}); delete "
                                     f"{so.parent} to rebuild it") from e
            _module = mod
    return _module


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when the sm90 kernels can run here; else False with one warning saying why."""
    import torch
    try:
        if not torch.cuda.is_available():
            raise BuildError("fp8linear: no CUDA device")
        device_arch()
        load()
        return True
    except Exception as e:  # noqa: BLE001  (any failure means: use the portable path)
        head, _, detail = str(e).partition("\n")  # the verdict first, a build log after
        warnings.warn(f"{head}; falling back to the Triton path" + (f"\n{detail}" if detail
                                                                       else ""), stacklevel=2)
        return False


def precompile(verbose: bool = True, arch: str = ARCH) -> Path:
    """Builds the extension for ``arch`` into the cache without needing a GPU; returns the .so.
    Where FP8LINEAR_PREBUILT holds a build for this key that loads, returns that one instead
    (what load() will import; nothing to compile, no toolkit needed).

    Raises ToolkitMissingError when there is no CUDA toolkit, BuildError on compile errors.
    """
    import torch
    nvcc_flags(arch)  # validates arch
    if torch.version.cuda is None:
        raise BuildError(f"fp8linear: torch {torch.__version__} is a CPU-only build; the CUDA "
                         f"kernels need a CUDA build of torch")
    key = current_key(arch)
    mod, so = _load_prebuilt(key) if arch == ARCH else (None, None)
    if mod is not None:
        # what load() will use: nothing to compile (a fresh GPU machine carrying a build made
        # elsewhere, e.g. by scripts/prebuild_device_ext.sh)
        if verbose:
            print(f"fp8linear: key {key}\nfp8linear: FP8LINEAR_PREBUILT has it: {so}",
                  flush=True)
        return so
    require_toolchain()
    root = cache_root()
    if verbose:
        print(f"fp8linear: key {key}\nfp8linear: cache {root / key}", flush=True)
    so = build(key, root, arch=arch, verbose=verbose)
    if verbose:
        print(f"fp8linear: built {so}", flush=True)
    return so
