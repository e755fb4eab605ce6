#!/usr/bin/env bash
# Device sweep (device_run.sh's script step), session 17: the large-M kernel's early weight
# stages (FP8LINEAR_SM90_GEMM_EARLY_B) and the fused quantization kernels' early PDL trigger
# (FP8LINEAR_FUSED_QUANT_EARLY_TRIGGER), each on (the heuristic's rule) and forced off, after
# the kernels a model puts before its GEMMs: block_fp8_gemm after our fused norm (qkv,
# gate_up), after our fused SiLU-and-mul (down_proj) and back to back; fp8_linear after an
# ordinary elementwise kernel (o_proj after attention). Optional memcheck of the early path
# first (MEMCHECK_CONFIGS="8 1": forced large-M configs, early loads on). Logs in one
# archive, $OUT/sweep.tgz (the device returns at most 8 files).
#   STEPS=env,script SCRIPT=scripts/dev_gemm_early_lean.sh bash benchmarks/device_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/fp8linear-out}
for cfg in ${MEMCHECK_CONFIGS-}; do
  echo "## memcheck, config $cfg, early weights"
  FP8LINEAR_SM90_GEMM_CONFIG=$cfg FP8LINEAR_SM90_GEMM_EARLY_B=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    python3 tests/kernels/sanitize_gemm.py 2>&1 | tail -4
  echo "memcheck config $cfg rc=${PIPESTATUS[0]}"
done
E=FP8LINEAR_SM90_GEMM_EARLY_B T=FP8LINEAR_FUSED_QUANT_EARLY_TRIGGER
V="rule:;no_early:$E=0;no_trig:$T=0;off:$E=0,$T=0"
export SHAPES=${SHAPES:-6144x4096,4096x4096,4096x14336,28672x4096,2112x7168,4096x7168,7168x2048}
export MS=${MS:-1,4,8,16,32,64,128} VARIANTS=${VARIANTS:-$V} CONFIGS="" REPLAYS=${REPLAYS:-20}
FINAL=$OUT
export OUT=$FINAL/sweep
mkdir -p "$OUT"
BETWEEN=${BETWEEN:-fused_norm,fused_silu,b2b} LINEAR=0 bash scripts/dev_neighbour_sweep.sh
BETWEEN=${LINEAR_BETWEEN:-elem} LINEAR=1 bash scripts/dev_neighbour_sweep.sh
tar -C "$FINAL" -czf "$FINAL/sweep.tgz" sweep && rm -rf "$OUT"
