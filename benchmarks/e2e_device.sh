#!/usr/bin/env bash
# Issue 6 on the GPU device, one call: the plain-PyTorch decoder benchmark, then the vLLM
# engines, all inside one time box. Run after the six vLLM transfers of
# ../shared/vllm-device/README.md (vLLM 0.24.0 in /tmp/vllm-site on this warm machine):
#
#   bash benchmarks/e2e_device.sh [TOTAL_S] [e2e_vllm.py args...]
#   e.g. bash benchmarks/e2e_device.sh 540
#        bash benchmarks/e2e_device.sh 540 --configs +online        # + online quantization
#        STEPS=vllm bash benchmarks/e2e_device.sh 400 --b256          # vLLM only, batch 256 too
#
# TOTAL_S (default 540; the device allows 600 s a command) bounds everything; RESERVE (15 s)
# is kept for collecting the outputs. Steps (STEPS, default setup,decoder,vllm):
#   setup    pip install of this checkout (fp8linear + its vLLM plugin, entry point vllm.general_plugins) into
#            /tmp/fp8linear-site unless importable already (e.g. after
#            benchmarks/vllm_device/run.sh setup on this machine); then, in parallel:
#            the fp8linear kernels (prebuilt from a carried .prebuilt, or the cache, or
#            `python -m fp8linear.cli build`) and `e2e_vllm.py --stage models` (BF16 + FP8
#            checkpoints, vLLM registry warm-up). Both finish before anything is timed.
#   decoder  benchmarks/e2e_decoder.py (time box DECODER_S=150, budget 125 s)
#   vllm     benchmarks/e2e_vllm.py --stage engines (what is left of TOTAL_S)
# $OUT (at most 8 files come back): e2e_device.log (everything, with the build, model and
# per-step output), <date>_e2e_decoder_<gpu>.json/.png, <date>_e2e_vllm_<gpu>.json/.png,
# vllm_engines.log (the engine logs, each cut to its last ENGINE_LOG_LINES=400 lines).
# Knobs: LAYERS (8), E2E_WORK (/tmp/e2e_vllm), VLLM_SITE (/tmp/vllm-site), FP8LINEAR_SITE,
# FP8LINEAR_CACHE, FP8LINEAR_PREBUILT (set to $PWD/.prebuilt when a .prebuilt was carried),
# DECODER_ARGS, MODELS_ARGS (extra args of the models stage), DG_VLLM_JIT_CACHE (below).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
TOTAL=${1:-540}
[ $# -gt 0 ] && shift
OUT=${OUT:-/tmp/e2e-out}
W=${E2E_WORK:-/tmp/e2e_vllm}
SITE=${FP8LINEAR_SITE:-/tmp/fp8linear-site}
VS=${VLLM_SITE:-/tmp/vllm-site}
RESERVE=${RESERVE:-15}
STEPS=${STEPS:-setup,decoder,vllm}
LAYERS=${LAYERS:-8}
mkdir -p "$OUT" "$W"
LOG=$OUT/e2e_device.log
T0=$(date +%s)
SUMMARY=()

export PYTHONPATH=$SITE:$VS${PYTHONPATH:+:$PYTHONPATH}
export PATH=$VS/bin:/usr/local/cuda/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export FP8LINEAR_CACHE=${FP8LINEAR_CACHE:-/tmp/fp8linear-cache}
if [ -z "${FP8LINEAR_PREBUILT:-}" ] && [ -d .prebuilt ]; then
  export FP8LINEAR_PREBUILT=$ROOT/.prebuilt     # absolute: the engine workers run elsewhere
fi
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

say() { echo "$@" | tee -a "$LOG"; }
left() { echo $(( TOTAL - ($(date +%s) - T0) - RESERVE )); }
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
cap() { local a=$1 b=$2; [ "$a" -gt "$b" ] && a=$b; [ "$a" -lt 10 ] && a=10; echo "$a"; }
record() { SUMMARY+=("$(printf '%-9s %-10s %4ss' "$1" "$2" "$3")"); }

has_vllm() { [ -f "$VS/vllm/__init__.py" ]; }
has_plugin() {
  python3 - <<'EOF' 2>/dev/null
from importlib.metadata import entry_points
import fp8linear, fp8linear_vllm
assert any(e.name == "fp8_blockgemm" for e in entry_points(group="vllm.general_plugins"))
EOF
}

say "e2e_device.sh: total ${TOTAL}s, steps $STEPS, out $OUT, work $W, layers $LAYERS, $(date -u +%FT%TZ)"
say "PYTHONPATH=$PYTHONPATH FP8LINEAR_CACHE=$FP8LINEAR_CACHE FP8LINEAR_PREBUILT=${FP8LINEAR_PREBUILT:-unset}"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$LOG"
has_vllm || say "WARNING: vLLM is not in $VS (run the six transfers first): vLLM part skipped"
# DG_VLLM_JIT_CACHE=<a .tgz of an earlier machine's ~/.cache/vllm/deep_gemm> (e.g. a carried
# .deepgemm/vllm_jit_cache.tgz): vLLM's DeepGEMM engine then starts warm instead of JIT-
# compiling its kernels (~3-6 min); its start time is then not the cold one
if [ -n "${DG_VLLM_JIT_CACHE:-}" ] && [ -f "$DG_VLLM_JIT_CACHE" ]; then
  mkdir -p "$HOME/.cache/vllm/deep_gemm" && tar xzf "$DG_VLLM_JIT_CACHE" -C "$HOME/.cache/vllm/deep_gemm" \
    && say "DeepGEMM JIT cache restored from $DG_VLLM_JIT_CACHE (vLLM's fp8_deepgemm starts warm)"
fi

# ------------------------------------------------------------------------------- setup
if want setup; then
  s=$(date +%s)
  if has_plugin; then
    say "=== [install] fp8linear + plugin already importable"
  else
    say "=== [install] pip install --no-deps --no-build-isolation --no-index --target $SITE ."
    timeout 120 python3 -m pip install -q --no-deps --no-build-isolation --no-index \
      --target "$SITE" --upgrade . >> "$LOG" 2>&1 || say "pip install failed (see above)"
    has_plugin && say "plugin entry point fp8_blockgemm installed" \
      || say "WARNING: fp8linear_vllm / its entry point not importable: fp8_blockgemm configs will fail"
  fi
  record install done $(( $(date +%s) - s ))
  s=$(date +%s)
  if [ -n "${FP8LINEAR_PREBUILT:-}" ]; then
    KCMD=(python3 -c "import time; t=time.time(); from fp8linear.backends.sm90 import library; m=library.load(); print('fp8linear kernels ready:', m.path, f'({time.time()-t:.1f} s)')")
  else
    KCMD=(python3 -m fp8linear.cli build)
  fi
  ( timeout "$(cap "$(left)" 300)" "${KCMD[@]}" > "$OUT/.kernels.log" 2>&1; echo "rc=$?" >> "$OUT/.kernels.log" ) &
  KPID=$!
  MPID=""
  if want vllm && has_vllm; then
    ( timeout "$(cap "$(left)" 240)" python3 benchmarks/e2e_vllm.py --stage models --work "$W" \
        --layers "$LAYERS" ${MODELS_ARGS:-} > "$OUT/.models.log" 2>&1; echo "rc=$?" >> "$OUT/.models.log" ) &
    MPID=$!
  fi
  wait $KPID
  say "=== [kernels] $(tail -3 "$OUT/.kernels.log" | tr '\n' ' ')"
  cat "$OUT/.kernels.log" >> "$LOG"
  record kernels "$(tail -1 "$OUT/.kernels.log")" $(( $(date +%s) - s ))
  if [ -n "$MPID" ]; then
    wait $MPID
    say "=== [models] $(grep -E 'models:|rc=' "$OUT/.models.log" | tr '\n' ' ')"
    cat "$OUT/.models.log" >> "$LOG"
    record models "$(tail -1 "$OUT/.models.log")" $(( $(date +%s) - s ))
  fi
  rm -f "$OUT/.kernels.log" "$OUT/.models.log"
fi

# ----------------------------------------------------------------------------- decoder
if want decoder; then
  l=$(left)
  if [ "$l" -lt 40 ]; then
    say "=== [decoder] skipped: ${l}s left"; record decoder SKIPPED 0
  else
    lim=$(cap "$l" "${DECODER_S:-150}")
    s=$(date +%s)
    say "=== [decoder] $(date -u +%T) limit ${lim}s"
    timeout --kill-after=5 "$lim" python3 benchmarks/e2e_decoder.py --out "$OUT" \
      --layers "$LAYERS" --budget-s $(( lim - 25 )) ${DECODER_ARGS:-} 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    record decoder "rc=$rc" $(( $(date +%s) - s ))
  fi
fi

# -------------------------------------------------------------------------------- vLLM
if want vllm && has_vllm; then
  l=$(left)
  if [ "$l" -lt 80 ]; then
    say "=== [vllm] skipped: ${l}s left"; record vllm SKIPPED 0
  else
    s=$(date +%s)
    say "=== [vllm] $(date -u +%T) budget ${l}s: e2e_vllm.py --stage engines $*"
    timeout --kill-after=10 $(( l + 5 )) python3 benchmarks/e2e_vllm.py --stage engines \
      --work "$W" --layers "$LAYERS" --budget-s "$l" --out "$OUT" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    record vllm "rc=$rc" $(( $(date +%s) - s ))
  fi
  # engine logs, one file, each cut to its tail
  if ls "$W"/logs/*.log >/dev/null 2>&1; then
    for f in "$W"/logs/*.log; do
      echo "===== $(basename "$f") ($(wc -l < "$f") lines, last ${ENGINE_LOG_LINES:-400})"
      tail -n "${ENGINE_LOG_LINES:-400}" "$f"
    done > "$OUT/vllm_engines.log"
  fi
fi

# ----------------------------------------------------------------------------- summary
say "=== steps ($(( $(date +%s) - T0 ))s total)"
for x in "${SUMMARY[@]}"; do say "  $x"; done
ls -la "$OUT" >> "$LOG"
for j in "$OUT"/*_e2e_decoder_*.json; do
  [ -f "$j" ] && python3 benchmarks/e2e_decoder.py --table "$j" 2>&1 | tee -a "$LOG"
done
for j in "$OUT"/*_e2e_vllm_*.json; do
  [ -f "$j" ] && python3 benchmarks/e2e_vllm.py --table "$j" 2>&1 | tee -a "$LOG"
done
exit 0
