#!/usr/bin/env bash
# The one command sent to the GPU machine: environment report, extension build, GPU tests,
# compute-sanitizer, GEMM benchmark; logs, JSON, PNGs and the JIT caches go to $OUT.
#
#   bash benchmarks/device_run.sh [bench_gemm.py args...]
#
# Steps (comma list in STEPS; default env,build,test,sanitize,bench):
#   env       nvidia-smi, python/torch/triton/nvcc/deep_gemm versions          (~10 s)
#   build     python -m fp8linear.cli build  (precompiles our CUDA extension)   BUILD_TIMEOUT=300
#   test      pytest -m gpu tests (-n TEST_WORKERS=8 with pytest-xdist)  TEST_TIMEOUT=240
#   sanitize  compute-sanitizer memcheck on tests/backends/sm90/sanitize_gemm.py       SAN_TIMEOUT=180
#             (--configs all: also every large-M configuration forced)
#   racecheck compute-sanitizer racecheck on sanitize_gemm.py --quick --configs all (not by default)
#                                                                               RACE_TIMEOUT=300
#   bench     python benchmarks/bench_gemm.py --out $OUT/bench.json "$@"       BENCH_TIMEOUT=540
#   script    bash $SCRIPT (a dev sweep, e.g. scripts/dev_neighbour_sweep.sh) with this
#             environment; it writes its logs under $OUT                       SCRIPT_TIMEOUT=540
# Each step runs under `timeout`, capped by what is left of DEADLINE (default 560 s from the
# start; the device allows 600 s a command) minus RESERVE (25 s) for collecting the outputs;
# a step that would start with < 15 s left is skipped. The bench gets --budget-s (time left
# minus BENCH_MARGIN=60 s) so it stops starting new shapes in time to finish the shape in
# hand and write its JSON and plots (it rewrites the JSON after every shape anyway).
#
# Carry (ignored folders, name them in the call's carry list):
#   .deepgemm   from scripts/prepare_deepgemm.sh (DeepGEMM of vLLM 0.24.0, ~29 MB); it is
#               copied to /tmp/fp8l_dg (a fixed path: DeepGEMM's JIT cache key contains the
#               include path) and put first on PYTHONPATH.
#   optional    .deepgemm/jit_cache.tgz: a jit_cache.tgz an earlier run returned (DeepGEMM
#               kernels, and Triton's with COLLECT_TRITON=1): unpacked into /tmp/fp8l_jit,
#               saving their JIT time (keyed by the include path, hence the fixed paths).
#               .deepgemm/vllm_w8a8 (vLLM's Triton block-FP8 GEMM, extracted from the same
#               wheel) gives the bench its vllm_triton method without a vLLM install.
# An installed vLLM (in /tmp/vllm-site by ../shared/vllm-device/ on this warm machine) is
# found, appended to PYTHONPATH and preferred.
# Typical calls: STEPS=env,build,test,sanitize (no carry needed);
#                STEPS=env,bench ... --quick | --shapes ds | --shapes llama8b,llama70b | --decode
#
# $OUT (at most 8 files come back): device_run.log, junit.xml, bench.json,
# bench_speedup.png, bench_floor.png, jit_cache.tgz (COLLECT_CACHE=0 to skip).
# Other knobs: PYTEST_ARGS (e.g. "-k sm90"), TEST_PATHS, TEST_WORKERS (0: no xdist), MAXFAIL,
# SAN_ARGS (e.g. --quick), PYTHON, FP8LINEAR_* (passed through to everything).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/fp8linear-out}
mkdir -p "$OUT"
LOG=$OUT/device_run.log
STEPS=${STEPS:-env,build,test,sanitize,bench}
DEADLINE=${DEADLINE:-560}
RESERVE=${RESERVE:-25}
T0=$(date +%s)
SUMMARY=()
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

say() { echo "$@" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) - RESERVE )); }
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# step NAME LIMIT CMD...: runs CMD under timeout (LIMIT capped by the deadline), output to
# the log and the terminal, records status and duration.
step() {
  local name=$1 lim=$2
  shift 2
  want "$name" || return 0
  local l
  l=$(left)
  if [ "$l" -lt 15 ]; then
    SUMMARY+=("$(printf '%-10s %-12s %5s' "$name" "SKIPPED" "-") (deadline)")
    say "=== [$name] skipped: ${l}s left before the deadline"
    return 0
  fi
  [ "$lim" -gt "$l" ] && lim=$l
  say "=== [$name] $(date -u +%H:%M:%S) limit ${lim}s: $*"
  local t rc status
  t=$(date +%s)
  timeout --kill-after=10 "$lim" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  status="rc=$rc"
  [ "$rc" -eq 124 ] && status="TIMEOUT"
  [ "$rc" -eq 137 ] && status="KILLED"
  SUMMARY+=("$(printf '%-10s %-12s %4ss' "$name" "$status" $(( $(date +%s) - t )))")
  say "=== [$name] $status after $(( $(date +%s) - t ))s"
}

# ------------------------------------------------------------------------ environment
if [ -z "${CUDA_HOME:-}" ]; then
  if command -v nvcc >/dev/null 2>&1; then
    CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
  elif [ -x /usr/local/cuda/bin/nvcc ]; then
    CUDA_HOME=/usr/local/cuda
  fi
fi
if [ -n "${CUDA_HOME:-}" ] && [ -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
  export CUDA_HOME
  export PATH=$CUDA_HOME/bin:$PATH
else
  unset CUDA_HOME   # let torch / DeepGEMM find it their own way
fi
PP=$ROOT
if [ -d .deepgemm/deep_gemm ]; then
  rm -rf /tmp/fp8l_dg && mkdir -p /tmp/fp8l_dg && cp -r .deepgemm/deep_gemm /tmp/fp8l_dg/
  PP=/tmp/fp8l_dg:$PP
fi
export PYTHONPATH=$PP${PYTHONPATH:+:$PYTHONPATH}
if [ -d /tmp/vllm-site/vllm ] && [[ ":$PYTHONPATH:" != *":/tmp/vllm-site:"* ]]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/vllm-site
fi
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# JIT caches at fixed paths, seeded from a carried archive
JIT=/tmp/fp8l_jit
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$JIT/deep_gemm}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$JIT/triton}
mkdir -p "$DG_JIT_CACHE_DIR" "$TRITON_CACHE_DIR"
CACHE_TGZ=${JIT_CACHE_TGZ:-.deepgemm/jit_cache.tgz}
if [ -f "$CACHE_TGZ" ]; then
  tar -C "$JIT" -xzf "$CACHE_TGZ" && say "unpacked $CACHE_TGZ ($(du -sh "$CACHE_TGZ" | cut -f1)) into $JIT"
fi

say "device_run.sh: steps=$STEPS deadline=${DEADLINE}s out=$OUT bench args: $*"
say "PYTHONPATH=$PYTHONPATH CUDA_HOME=${CUDA_HOME:-unset}"

envreport() {
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit,memory.used,memory.total --format=csv
  echo "cpus $(nproc), $(free -g | awk '/Mem:/{print $2}') GiB RAM, /tmp free $(df -h /tmp | awk 'NR==2{print $4}')"
  command -v nvcc >/dev/null && nvcc --version | tail -2
  command -v compute-sanitizer >/dev/null && compute-sanitizer --version | head -2 | tail -1
  "$PY" - <<'EOF'
import importlib, os, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0), "cc", torch.cuda.get_device_capability(0))
p = torch.cuda.get_device_properties(0)
print("SMs", p.multi_processor_count, "L2", getattr(p, "L2_cache_size", "?"),
      "mem", round(p.total_memory / 2**30, 1), "GiB")
for mod in ("triton", "deep_gemm", "vllm", "matplotlib", "pytest"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod} {getattr(m, '__version__', '?')} ({os.path.dirname(m.__file__)})")
    except Exception as e:
        print(f"{mod}: not importable ({type(e).__name__}: {str(e)[:200]})")
print("FP8LINEAR_*:", {k: v for k, v in os.environ.items() if k.startswith("FP8LINEAR")})
EOF
}

export -f envreport
export PY
step env 60 bash -c envreport
step build "${BUILD_TIMEOUT:-300}" "$PY" -m fp8linear.cli build
# pytest-xdist spreads the tests (and above all their Triton JIT compiles) over processes;
# pytest-timeout turns a hung kernel into one failed test instead of a dead step.
XDIST=""
TEST_THREADS=""
if want test; then
  if "$PY" -c "import xdist" 2>/dev/null && [ "${TEST_WORKERS:-8}" != 0 ]; then
    XDIST="-n ${TEST_WORKERS:-8}"
    # each worker's torch would start a CPU thread per core for the tests' fp64 references:
    # the cores shared out instead of workers x cores threads contending for them
    T=$(( $(nproc) / ${TEST_WORKERS:-8} )); TEST_THREADS="OMP_NUM_THREADS=$(( T > 0 ? T : 1 ))"
  fi
  "$PY" -c "import pytest_timeout" 2>/dev/null && \
    XDIST="$XDIST --timeout=${TEST_CASE_TIMEOUT:-150} --timeout-method=thread"
fi
step test "${TEST_TIMEOUT:-240}" env $TEST_THREADS "$PY" -m pytest -m gpu -q ${TEST_PATHS:-tests} \
  -p no:cacheprovider --junitxml="$OUT/junit.xml" -rfEs --tb=short $XDIST \
  --maxfail="${MAXFAIL:-40}" --durations=15 ${PYTEST_ARGS:-}
step sanitize "${SAN_TIMEOUT:-180}" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 30 \
  "$PY" tests/backends/sm90/sanitize_gemm.py ${SAN_ARGS:---configs all}
step racecheck "${RACE_TIMEOUT:-300}" compute-sanitizer --tool racecheck --error-exitcode 9 \
  --print-limit 30 "$PY" tests/backends/sm90/sanitize_gemm.py --quick --configs all
if want bench; then
  B=$(( $(left) - ${BENCH_MARGIN:-60} ))
  [ "$B" -lt 30 ] && B=30
  step bench "${BENCH_TIMEOUT:-540}" "$PY" benchmarks/bench_gemm.py --out "$OUT/bench.json" \
    --budget-s "$B" "$@"
fi

if want script; then
  [ -f "${SCRIPT:-}" ] || { say "script step: SCRIPT=${SCRIPT:-} is not a file"; exit 2; }
  export OUT
  step script "${SCRIPT_TIMEOUT:-540}" bash "$SCRIPT"
fi

# ------------------------------------------------------------------------------ collect
# DeepGEMM's kernels (~3 s of nvcc each, small cubins) by default; Triton's cache is larger
# (IR files of every specialisation) and its compiles run in parallel anyway: COLLECT_TRITON=1.
if [ "${COLLECT_CACHE:-1}" = 1 ]; then
  parts=""
  [ "$(ls "$JIT/deep_gemm/cache" 2>/dev/null | wc -l)" -gt 0 ] && parts="deep_gemm/cache"
  [ "${COLLECT_TRITON:-0}" = 1 ] && [ -d "$JIT/triton" ] && parts="$parts triton"
  if [ -n "$parts" ]; then
    (cd "$JIT" && tar -czf "$OUT/jit_cache.tgz" $parts) && say "jit_cache.tgz ($parts):" \
      "$(du -sh "$OUT/jit_cache.tgz" | cut -f1), $(ls "$JIT/deep_gemm/cache" 2>/dev/null | wc -l)" \
      "DeepGEMM kernels; carry it as .deepgemm/jit_cache.tgz"
  fi
fi
if [ -f "$OUT/bench.json" ]; then
  "$PY" benchmarks/plot.py "$OUT/bench.json" --no-plot --table 2>&1 | tee -a "$LOG" | tail -n "${TABLE_LINES:-70}"
fi
say "=== steps ($(( $(date +%s) - T0 ))s total)"
for s in "${SUMMARY[@]}"; do say "  $s"; done
ls -la "$OUT" | tee -a "$LOG" >/dev/null
