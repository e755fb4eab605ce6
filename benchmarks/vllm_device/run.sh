#!/usr/bin/env bash
# The vLLM plugin on the GPU device (vLLM 0.24.0 installed per ../shared/vllm-device/README.md
# into /tmp/vllm-site). Run from the repository root, one step per device call:
#
#   bash benchmarks/vllm_device/run.sh setup     # install fp8linear (+ entry point), build kernels
#   bash benchmarks/vllm_device/run.sh engines   # graphs/compile vs eager, kernels, MoE, weights
#   bash benchmarks/vllm_device/run.sh memory    # peak GPU memory of online quantization
#   bash benchmarks/vllm_device/run.sh tp2       # on nvidia-h200-x2: TP=2 vs TP=1
#
# Several steps may be given in one call (setup runs first whenever fp8linear is missing).
# Logs and tables go to $OUT (default /tmp/fp8lv-out); models to $FP8LV_WORK (/tmp/fp8lv).
# Measured budget per step on an H100 (first call on a fresh machine): see README.md here.
set -uo pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/fp8lv-out}; W=${FP8LV_WORK:-/tmp/fp8lv}; SITE=${FP8LINEAR_SITE:-/tmp/fp8linear-site}
mkdir -p "$O" "$W"
export PYTHONPATH=$SITE:/tmp/vllm-site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/vllm-site/bin:/usr/local/cuda/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_USE_DEEP_GEMM=0
# the compiled kernels live with the machine: keep them beside the other /tmp state
export FP8LINEAR_CACHE=${FP8LINEAR_CACHE:-/tmp/fp8linear-cache}

log() { echo "== $*" | tee -a "$O/run.log"; }

has_plugin() {
  python3 - <<'EOF' 2>/dev/null
from importlib.metadata import entry_points
import fp8linear, fp8linear_vllm
assert any(e.name == "fp8_blockgemm" for e in entry_points(group="vllm.general_plugins"))
EOF
}

setup() {
  if [ ! -f /tmp/vllm-site/vllm/__init__.py ]; then
    log "vLLM is not installed in /tmp/vllm-site: run the six transfers of shared/vllm-device first"
    return 1
  fi
  local s=$(date +%s)
  # offline, no dependencies (the machine has torch; vLLM sits in /tmp/vllm-site): a plain
  # install into its own folder, so that the entry-point metadata exists
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" --upgrade . \
    > "$O/setup.log" 2>&1 || { log "pip install failed:"; tail -20 "$O/setup.log"; return 1; }
  has_plugin || { log "fp8linear_vllm or its entry point not importable after install"; return 1; }
  log "installed fp8linear + plugin into $SITE in $(( $(date +%s)-s ))s"
  s=$(date +%s)
  python3 -m fp8linear.cli build >> "$O/setup.log" 2>&1 || { log "kernel build failed:"; tail -30 "$O/setup.log"; return 1; }
  log "sm90 kernels built in $(( $(date +%s)-s ))s"
  python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())" | tee -a "$O/run.log"
}

rc=0
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(setup engines)
for step in "${steps[@]}"; do
  if [ "$step" != setup ] && ! has_plugin; then setup || exit 1; fi
  s=$(date +%s)
  case "$step" in
    setup) setup || rc=1 ;;
    engines|memory|tp2)
      timeout "${STEP_TIMEOUT:-560}" python3 benchmarks/vllm_device/device_check.py "$step" "$W" "$O" \
        2>&1 | tee "$O/$step.out"; r=${PIPESTATUS[0]}
      [ "$r" -ne 0 ] && rc=1
      log "$step rc=$r wall=$(( $(date +%s)-s ))s" ;;
    *) log "unknown step $step (setup|engines|memory|tp2)"; rc=2 ;;
  esac
done
exit $rc
