#!/usr/bin/env bash
# Device sweep (device_run.sh's script step), session 18: how many of the large-M kernel's
# first weight stages to request before griddepcontrol.wait (FP8LINEAR_SM90_GEMM_EARLY_STAGES
# with FP8LINEAR_SM90_GEMM_EARLY_B=1) after the kernels a model puts before its GEMMs:
# block_fp8_gemm after our fused norm / SiLU-and-mul and back to back, fp8_linear after an
# elementwise kernel. Each kind runs through scripts/dev_neighbour_sweep.sh; logs in one
# archive, $OUT/probe.tgz.
#   STEPS=env,script SCRIPT=scripts/dev_gemm_early_stages.sh bash benchmarks/device_run.sh
# Knobs: VARIANTS (dev_variants.py syntax), SHAPES, MS, KINDS (neighbour kinds or b2b; a
# _linear suffix times fp8_linear), REPLAYS.
set -uo pipefail
E=FP8LINEAR_SM90_GEMM_EARLY_B S=FP8LINEAR_SM90_GEMM_EARLY_STAGES
export VARIANTS=${VARIANTS:-"base:;eb1:$E=1;e2:$E=1,$S=2;e4:$E=1,$S=4;e8:$E=1,$S=8;off:$E=0;base2:"}
export SHAPES=${SHAPES:-6144x4096,4096x7168,4096x4096,4096x14336,28672x4096,2112x7168,7168x2048,10240x8192,8192x8192}
export MS=${MS:-8,16,32,64,128} REPLAYS=${REPLAYS:-12} CONFIGS="" DG=0
FINAL=${OUT:-/tmp/fp8linear-out}
export OUT=$FINAL/p
mkdir -p "$OUT"
for kind in ${KINDS:-fused_norm fused_silu b2b elem_linear}; do
  BETWEEN=${kind%_linear} LINEAR=$([ "$kind" = "${kind%_linear}" ] && echo 0 || echo 1) \
    bash scripts/dev_neighbour_sweep.sh | grep -v "^\["
done
tar -C "$FINAL" -czf "$FINAL/probe.tgz" p && rm -rf "$OUT"
