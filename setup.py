"""Packaging beyond pyproject.toml: the platform wheel with the Hopper kernels prebuilt.

``python -m build --wheel`` makes the pure wheel (kernels compiled on first use, or by
``fp8linear build``). ``FP8LINEAR_BUILD_KERNELS=1 python -m build --wheel`` also compiles the
kernel library (needs nvcc, no GPU) into the package and tags the wheel for the platform only:
the library depends on neither Python nor torch, so one wheel serves CPython 3.10-3.13.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

KERNELS = os.environ.get("FP8LINEAR_BUILD_KERNELS") == "1"
# glibc the library needs (its newest versioned symbol, built on this project's CI image)
PLATFORM = "manylinux_2_34_x86_64"


def _build_module(build_lib: Path):
    # the package's build.py on its own: importing fp8linear would need torch at build time
    path = build_lib / "fp8linear" / "backends" / "sm90" / "build.py"
    spec = importlib.util.spec_from_file_location("fp8linear_build", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPy(build_py):
    def run(self):
        super().run()
        if KERNELS:
            b = _build_module(Path(self.build_lib))
            lib = b.build_into(b.PREBUILT_DIR, b.current_key(), verbose=False)
            (lib.parent / "build.log").unlink()  # (ptxas's report: not for the wheel)
            print(f"fp8linear: kernel library {lib} ({lib.stat().st_size >> 20} MB)")


class BdistWheel(bdist_wheel):
    def get_tag(self):
        return ("py3", "none", PLATFORM) if KERNELS else super().get_tag()


class PlatformDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel: everything at its root (platlib)
        return KERNELS


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel},
      distclass=PlatformDistribution)
