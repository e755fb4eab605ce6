#!/usr/bin/env bash
# Device side of recut.sh: run from the repository root in every chunk call (each carrying
# .vllm-wheels/d<k>); collects the chunks in /tmp/vllm-p7 and installs vLLM 0.24.0 into
# /tmp/vllm-site once all are there (the machine keeps /tmp only while it stays warm:
# ~30 s between calls). Then run.sh / e2e_device.sh find it as with the shared recipe.
set -euo pipefail
P=/tmp/vllm-p7; S=${VLLM_SITE:-/tmp/vllm-site}; N=${VLLM_PARTS:-7}
mkdir -p $P; cp -n .vllm-wheels/d*/p* $P/ 2>/dev/null || true
have=$(ls $P/p* | wc -l); echo "parts: $have of $N"
[ "$have" -eq "$N" ] || exit 0
[ -f $S/vllm/__init__.py ] && { echo "already installed in $S"; exit 0; }
rm -rf /tmp/vllm-wheels; mkdir -p /tmp/vllm-wheels
cat $P/p* | tar -C /tmp/vllm-wheels -xf -
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S /tmp/vllm-wheels/*.whl
echo "installed vLLM into $S"
