#!/usr/bin/env bash
# Build the sm_90a extension HERE (CPU machine) for the GPU device, so the device loads it
# instead of spending its own time compiling.
#
# The device runs Python 3.12 + torch 2.11.0+cu130; the extension is built against exactly
# those (a python3.12 venv with the same torch wheel from PyPI), under the cache key that
# fp8linear.backends.sm90.build computes there (one key function: build.cache_key), into
#   <out>/<key>/fp8linear_sm90_C.so   (default <repo>/.prebuilt, git-ignored)
# On the device: carry [".prebuilt"] and set FP8LINEAR_PREBUILT=.prebuilt; build.load() then
# imports it with no compiler (and compiles itself, with a warning, if the key differs).
#
# Usage: scripts/prebuild_device_ext.sh [out_dir]
#   PREBUILD_HOME  venv + wheel cache (default ~/.cache/fp8linear-prebuild; ~5 GB, outside
#                  the repo so it can never be carried by accident)
#   MAX_JOBS       parallel compile jobs (default: all cores)
#   VERBOSE=1      stream the ninja/nvcc/ptxas output

set -euo pipefail

TORCH_VERSION=2.11.0
TORCH_CUDA=cu130
PY_MM=3.12
ARCH=sm_90a

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(realpath -m "${1:-$REPO/.prebuilt}")"
HOME_DIR="${PREBUILD_HOME:-$HOME/.cache/fp8linear-prebuild}"
VENV="$HOME_DIR/venv-py$PY_MM-torch$TORCH_VERSION-$TORCH_CUDA"
WHEELS="$HOME_DIR/wheels"
PY="$VENV/bin/python"
say() { echo "prebuild: $*" >&2; }
die() { echo "prebuild: ERROR: $*" >&2; exit 1; }

find_python() {
  local c
  for c in python$PY_MM "$HOME"/.pyenv/versions/$PY_MM*/bin/python$PY_MM \
           /usr/bin/python$PY_MM /usr/local/bin/python$PY_MM; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c "import sys, venv; assert '%d.%d' % sys.version_info[:2] == '$PY_MM'" 2>/dev/null
    then
      command -v "$c"; return 0
    fi
  done
  # Last resort: uv's managed Pythons. uv comes from PyPI (into our own dir, not the system
  # Python); the interpreter itself comes from GitHub releases, which may be unreachable.
  local uv="$HOME_DIR/tools/bin/uv"
  [ -x "$uv" ] || python3 -m pip install -q --target "$HOME_DIR/tools" uv >&2 || return 1
  "$uv" python install "$PY_MM" >&2 && "$uv" python find "$PY_MM"
}

torch_ok() {  # the venv imports the right torch (cpp_extension needs a working import)
  [ -x "$PY" ] && "$PY" -W ignore -c "import torch, sys
sys.exit(torch.__version__ != '$TORCH_VERSION+$TORCH_CUDA' or torch.version.cuda is None)" \
    >/dev/null 2>&1
}

setup_venv() {
  local py312 whl
  py312="$(find_python)" || die "no python$PY_MM here (tried PATH, pyenv, uv); install one"
  say "python $PY_MM: $py312"
  mkdir -p "$WHEELS"
  whl="$(ls "$WHEELS"/torch-$TORCH_VERSION-cp${PY_MM/./}-*manylinux_2_28_x86_64.whl 2>/dev/null \
         | head -1 || true)"
  if [ -z "$whl" ]; then
    say "downloading torch $TORCH_VERSION for cp${PY_MM/./} (~530 MB)"
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$PY_MM" \
      --platform manylinux_2_28_x86_64 "torch==$TORCH_VERSION" -d "$WHEELS" >&2
    whl="$(ls "$WHEELS"/torch-$TORCH_VERSION-cp${PY_MM/./}-*manylinux_2_28_x86_64.whl | head -1)"
  fi
  # PyPI's default torch build has changed CUDA versions over releases: check, not assume.
  python3 - "$whl" "$TORCH_VERSION+$TORCH_CUDA" <<'EOF' || die "$whl is not the $TORCH_CUDA build"
import re, sys, zipfile
src = zipfile.ZipFile(sys.argv[1]).read("torch/version.py").decode()
v = re.search(r"__version__ = '([^']+)'", src).group(1)
print(f"prebuild: wheel is torch {v}", file=sys.stderr)
sys.exit(v != sys.argv[2])
EOF
  rm -rf "$VENV"
  "$py312" -m venv "$VENV"
  # With its dependencies: `import torch` (which cpp_extension does) loads libtorch_cuda.so,
  # whose DT_NEEDED cuBLAS/cuDNN/NCCL/... come from the nvidia-* wheels. Their headers also
  # fill in what a minimal CUDA toolkit lacks (cusparse.h etc., see build.wheel_include_dirs).
  say "installing it into $VENV (with its nvidia-* dependencies, ~4.6 GB)"
  "$PY" -m pip install -q "$whl" ninja >&2
  torch_ok || die "torch does not import in $VENV"
}

main() {
  local t0 key so needed bad glibc
  t0=$(date +%s)
  torch_ok || setup_venv

  # Never let git see (or a device call carry by accident) anything but what is asked for.
  if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1 && [[ "$OUT" == "$REPO"/* ]]; then
    local ex rel="${OUT#"$REPO"/}/"
    ex="$(git -C "$REPO" rev-parse --git-path info/exclude)"
    [[ "$ex" = /* ]] || ex="$REPO/$ex"
    mkdir -p "$(dirname "$ex")"
    grep -qxF "$rel" "$ex" 2>/dev/null || echo "$rel" >> "$ex"
  fi

  # One key only: older builds would bloat what the device call carries (64 MiB cap).
  rm -rf "$OUT"
  mkdir -p "$OUT"
  # this checkout's fp8linear on the path: its build module, and the sources it finds are this
  # checkout's csrc/, as on the device
  FP8LINEAR_CACHE="$OUT" PYTHONPATH="$REPO" "$PY" -W ignore - "$ARCH" "${VERBOSE:-0}" <<'EOF'
import sys
from fp8linear.backends.sm90 import build
so = build.precompile(verbose=sys.argv[2] == "1", arch=sys.argv[1])
mod = build._import(so)  # links against torch 2.11's libs here, as it will on the device
print(f"prebuild: imports fine: {sorted(n for n in dir(mod) if not n.startswith('_'))}",
      file=sys.stderr)
EOF

  so="$(ls "$OUT"/*/fp8linear_sm90_C*.so)"
  key="$(basename "$(dirname "$so")")"
  # Every library the .so needs must exist on the device: torch's own libs (loaded by
  # `import torch` first), libcudart from torch's nvidia wheel, and the C/C++ runtime.
  needed="$(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p')"
  bad="$(echo "$needed" | grep -vE '^(libc10(_cuda)?|libtorch(_cpu|_cuda|_python)?)\.so$|^libcudart\.so\.13$|^(libstdc\+\+\.so\.6|libgcc_s\.so\.1|libc\.so\.6|libm\.so\.6|ld-linux-x86-64\.so\.2)$' || true)"
  [ -z "$bad" ] || die "$so needs libraries the device may lack: $bad"
  glibc="$(objdump -T "$so" | grep -oE 'GLIBC_[0-9.]+' | sort -uV | tail -1)"
  say "NEEDED: $(echo $needed)"
  say "needs $glibc and $(objdump -T "$so" | grep -oE 'GLIBCXX_[0-9.]+' | sort -uV | tail -1) (device: ldd --version)"
  say "key $key"
  say "$(du -sh "$OUT" | cut -f1) in $OUT; $(( $(date +%s) - t0 )) s"
  say "on the device: carry [\"${OUT#"$REPO"/}\"], env FP8LINEAR_PREBUILT=${OUT#"$REPO"/}"
  echo "$OUT/$key"
}

main "$@"
