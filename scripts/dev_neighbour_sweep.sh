#!/usr/bin/env bash
# Device sweep (through benchmarks/device_run.sh's script step): which sm90 plan wins for
# fp8_linear at decode sizes depending on the kernel before the GEMM, the three kinds of
# benchmarks/neighbour.py. First a check that the PDL norm kernel computes an RMSNorm.
#   STEPS=env,build,script SCRIPT=scripts/dev_neighbour_sweep.sh bash benchmarks/device_run.sh
# Knobs: SHAPES, MS, BETWEEN (comma list of neighbour kinds; b2b: none), VARIANTS, CONFIGS, REPLAYS,
# LINEAR (1: fp8_linear from bf16, 0: block_fp8_gemm), DG (1: DeepGEMM too), WITH_GEMM (1: with
# LINEAR=1, block_fp8_gemm too: each variant's hop).
set -uo pipefail
OUT=${OUT:-/tmp/fp8linear-out}
SHAPES=${SHAPES:-6144x4096,4096x4096,28672x4096,4096x14336}
MS=${MS:-4,8,16,32,64}
BETWEEN=${BETWEEN:-norm_pdl,elem}
VARIANTS=${VARIANTS:-"base:;dec:FP8LINEAR_SM90_DECODE_MAX_M=64"}
CONFIGS=${CONFIGS-1,6,7,8,9}   # (set empty: no forced configs)
REPLAYS=${REPLAYS:-10}
python3 - <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
import neighbour
x = torch.randn(16, 4096, device="cuda").bfloat16()
g = torch.randn(4096, device="cuda").bfloat16()
for kind in neighbour.KINDS:
    if kind.startswith("fused_"):  # (fp8 outputs; tests/test_norm_quant.py, test_swiglu_quant.py)
        continue
    o = torch.full_like(x, float("nan"))
    neighbour.make(kind, x, g, o)()
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-6) * g.float()
    if kind == "elem":
        ref = xf * g.float()
    err = float((o.float() - ref).norm() / ref.norm())
    print(f"neighbour {kind}: rel err {err:.2e}")
    assert err < 1e-2, kind
PY
for kind in ${BETWEEN//,/ }; do
  for lin in ${LINEAR:-1}; do
    name=$kind$([ "$lin" = 1 ] && echo _linear)
    echo "## $name: dev_variants --shapes $SHAPES --m $MS --between $kind (b2b: none)" \
         "$([ "$lin" = 1 ] && echo --linear) --variants $VARIANTS --configs $CONFIGS"
    python3 scripts/dev_variants.py --shapes "$SHAPES" --m "$MS" \
      $([ "$kind" = b2b ] || echo --between "$kind") \
      $([ "$lin" = 1 ] && echo --linear) $([ "${DG:-0}" = 1 ] || echo --no-dg) \
      $([ "$lin" = 1 ] && [ "${WITH_GEMM:-0}" = 1 ] && echo --with-gemm) \
      --replays "$REPLAYS" --variants "$VARIANTS" --configs "$CONFIGS" \
      --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  done
done
