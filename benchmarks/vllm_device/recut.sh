#!/usr/bin/env bash
# CPU side. The shared recipe (../shared/vllm-device/prepare.sh) cuts vLLM's wheels into six
# chunks of 60 MB; a device call carries the working tree plus one chunk and refuses more than
# 64 MiB in all, so once the repository's tracked files pass ~7 MB (benchmark results) the
# 60 MB chunks no longer fit. This re-cuts the same bytes into .vllm-wheels/d0 ... d6 (50 MB
# each, ignored like the rest of .vllm-wheels); benchmarks/vllm_device/install_parts.sh
# installs them on the device, one call per chunk:
#   bash benchmarks/vllm_device/recut.sh                       # here, after prepare.sh
#   run: bash benchmarks/vllm_device/install_parts.sh           # carry .vllm-wheels/d0, then d1 ...
set -euo pipefail
cd "$(dirname "$0")/../.."
W=.vllm-wheels
ls $W/c*/part-* > /dev/null 2>&1 || { echo "no $W/c*/part-*: run ../shared/vllm-device/prepare.sh first"; exit 1; }
rm -rf $W/d? && mkdir -p $W/recut
# CHUNK_MB (default 50): lower it as the tracked tree grows (tree + one chunk <= 64 MiB),
# and pass the chunk count it prints as VLLM_PARTS to install_parts.sh
cat $W/c*/part-* | split -b "${CHUNK_MB:-50}000000" -d -a 2 - $W/recut/p
n=0
for f in $W/recut/p*; do mkdir -p $W/d$n && mv "$f" $W/d$n/; n=$((n + 1)); done
rmdir $W/recut
echo "$n chunks: $(du -sh $W/d* | tr '\n' ' ')"
echo "$n" > $W/recut_count
