#!/usr/bin/env bash
# Put DeepGEMM onto the offline GPU machine: the copy vLLM 0.24.0's wheel vendors under
# vllm/third_party/deep_gemm (DeepGEMM 2.5.0: Python package, a prebuilt _C extension built
# against torch 2.11 / CUDA 13, and the CUDA headers its JIT compiles kernels from).
#
# Run on the CPU machine from anywhere inside the repository. Writes .deepgemm/deep_gemm
# (about 29 MB; only the cpython-312 _C is kept, the device runs Python 3.12), ignored through
# .git/info/exclude, so the lead carries `.deepgemm` with a device call. The device side
# (benchmarks/device_run.sh) copies it to a fixed path and puts that on PYTHONPATH: DeepGEMM's
# JIT cache key contains the include path, and a fixed path lets a carried cache hit.
#
# Idempotent; the wheel (279 MB) is downloaded once into .deepgemm-dl/ (also ignored), or
# taken from .vllm-wheels/dl/ when ../shared/vllm-device/prepare.sh already fetched it.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
V=${VLLM_VERSION:-0.24.0}
PYV=${DEVICE_PYTHON:-312}            # cpython tag of the device's Python (3.12)
DL=.deepgemm-dl
DST=.deepgemm
EXCL=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCL")"
for p in "/$DST/" "/$DL/"; do
  grep -qxF "$p" "$EXCL" 2>/dev/null || echo "$p" >> "$EXCL"
done

whl=$(ls "$DL"/vllm-"$V"-*.whl .vllm-wheels/dl/vllm-"$V"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  mkdir -p "$DL"
  # vLLM publishes one abi3 wheel; its manylinux tag has moved between releases, and pip
  # matches manylinux_2_N exactly, so offer several.
  plats=""
  for n in 28 31 34 35 17; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $plats -d "$DL" "vllm==$V"
  whl=$(ls "$DL"/vllm-"$V"-*.whl | head -1)
fi
echo "wheel: $whl"

rm -rf "$DST/deep_gemm"
mkdir -p "$DST"
python3 - "$whl" "$DST" "$PYV" <<'EOF'
import os, re, sys, zipfile
whl, dst, pyv = sys.argv[1:]
prefix = "vllm/third_party/deep_gemm/"
n = size = 0
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        name = info.filename
        if not name.startswith(prefix) or name.endswith("/"):
            continue
        rel = name[len(prefix):]
        m = re.match(r"_C\.cpython-(\d+)-", rel)
        if m and m.group(1) != pyv:          # the extension for other Pythons is dead weight
            continue
        if "__pycache__" in rel:
            continue
        out = os.path.join(dst, "deep_gemm", rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(info) as src, open(out, "wb") as f:
            f.write(src.read())
        os.chmod(out, 0o755 if rel.endswith(".so") else 0o644)
        n += 1
        size += info.file_size
if n == 0:
    sys.exit(f"no {prefix} in {whl}: this vLLM wheel does not vendor DeepGEMM")
print(f"extracted {n} files, {size / 2**20:.1f} MiB into {dst}/deep_gemm")
EOF

# vLLM's Triton block-FP8 GEMM (the `vllm_triton` anchor of benchmarks/bench_gemm.py) without
# installing vLLM (340 MB over six transfers): the three functions of
# vllm/model_executor/layers/quantization/utils/fp8_utils.py that run it, extracted verbatim
# (by their line ranges), plus vLLM's tuned H100/H200 configs. The benchmark executes them
# with small shims for vLLM's logger/platform (bench_gemm.load_extracted_vllm_triton); a real
# vLLM install, when present, is preferred. Ignored folder, never committed.
rm -rf "$DST/vllm_w8a8"
python3 - "$whl" "$DST/vllm_w8a8" "$V" <<'EOF2'
import ast, os, re, sys, zipfile
whl, dst, ver = sys.argv[1:]
src_name = "vllm/model_executor/layers/quantization/utils/fp8_utils.py"
cfg_prefix = "vllm/model_executor/layers/quantization/utils/configs/"
want = ["_w8a8_triton_block_scaled_mm", "get_w8a8_block_fp8_configs",
        "w8a8_triton_block_scaled_mm"]
os.makedirs(os.path.join(dst, "configs"), exist_ok=True)
with zipfile.ZipFile(whl) as z:
    src = z.read(src_name).decode()
    ncfg = 0
    for name in z.namelist():
        base = name[len(cfg_prefix):]
        if name.startswith(cfg_prefix) and re.search(r"H[12]00", base) and \
                "dtype=fp8_w8a8,block_shape=[128,128]" in base:
            with open(os.path.join(dst, "configs", base), "wb") as f:
                f.write(z.read(name))
            ncfg += 1
lines = src.splitlines(keepends=True)
defs = {n.name: n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}
missing = [w for w in want if w not in defs]
if missing:
    sys.exit(f"{src_name} of vllm {ver} lacks {missing}: update bench_gemm's vllm_triton")
out = [f"# Extracted verbatim from vllm {ver} ({src_name}), Apache-2.0, by\n"
       "# scripts/prepare_deepgemm.sh, for benchmarking only; executed by\n"
       "# benchmarks/bench_gemm.py with shims for torch/triton/tl/logger/current_platform.\n"]
for w in want:
    n = defs[w]
    start = min([d.lineno for d in n.decorator_list] + [n.lineno]) - 1
    out.append("\n\n" + "".join(lines[start:n.end_lineno]))
with open(os.path.join(dst, "fp8_utils.py"), "w") as f:
    f.write("".join(out))
print(f"vllm_w8a8: {', '.join(want)} + {ncfg} H100/H200 configs -> {dst}")
EOF2

# What it needs at run time (checked here so the device call does not find out):
#  - imports: torch only (relative imports inside the package; no vllm import);
#  - _C links libtorch*/libc10* (loaded by `import torch`), libcudart.so.13, libnvrtc.so.13;
#  - JIT: nvcc from $CUDA_HOME, else `which nvcc`, else /usr/local/cuda; cache in
#    $DG_JIT_CACHE_DIR (default ~/.deep_gemm).
so=$(ls "$DST"/deep_gemm/_C.cpython-"$PYV"-*.so)
if grep -rqE "^\s*(from|import) vllm" "$DST/deep_gemm" --include=*.py; then
  echo "WARNING: the vendored deep_gemm imports vllm" >&2
fi
if command -v readelf >/dev/null; then
  echo "_C needs: $(readelf -d "$so" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
fi
grep -h "__version__" "$DST/deep_gemm/__init__.py" || true
du -sh "$DST"
echo "carry: .deepgemm   (device: benchmarks/device_run.sh sets PYTHONPATH itself)"
