#!/usr/bin/env bash
# On the device, vLLM 0.24.0 in /tmp/vllm-site (../shared/vllm-device), the API server's extra wheels in .whl/,
# the platform wheel in dist/, SmolLM2 chunks in /tmp/ck (tar + split, benchmarks/quality.py's docstring). Installs the wheel into vLLM's
# site, then: cold start of `vllm serve` BF16 vs block FP8 (fp8_blockgemm; caches cleared before each), HTTP checks
# (http_client.py), clean stop; BF16 quantized while loading.
set -u
export PYTHONUNBUFFERED=1 R=$PWD
export PYTHONPATH=/tmp/vllm-site PATH=/tmp/vllm-site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
L=$OUT/vllm_serve.log
say() { echo "$@" | tee -a $L; }
say "# vllm serve on the GPU: $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader), $(python3 -c 'import torch;print("torch", torch.__version__)'), vllm $(python3 -c 'import vllm;print(vllm.__version__)' 2>/dev/null)"
# vllm serve's own dependencies the offline recipe leaves out (the API server's imports)
python3 -m pip install -q --no-deps --no-index --target /tmp/vllm-site .whl/*.whl 2>&1 | grep -v WARN
say "\$ python3 -m pip install --no-deps --target /tmp/vllm-site dist/fp8linear-0.1.0-py3-none-manylinux_2_34_x86_64.whl"
python3 -m pip install -q --no-deps --no-index --target /tmp/vllm-site dist/fp8linear-0.1.0-py3-none-manylinux_2_34_x86_64.whl 2>&1 | tee -a $L
ls /tmp/vllm-site/fp8linear/backends/sm90/prebuilt/ | tee -a $L
command -v nvcc >/dev/null && say "(nvcc is on this machine at $(command -v nvcc); the wheel must not need it)"
say "\$ python3 -m fp8linear.cli build   # with the wheel: nothing to compile"
(cd /tmp && python3 -m fp8linear.cli build) 2>&1 | tee -a $L  # (from /tmp: the installed wheel, not the checkout)
[ -d /tmp/smollm2-bf16 ] || ( (cd /tmp/ck && sha256sum -c SUMS) && cat /tmp/ck/smollm2-bf16.tar.* | tar -xf - -C /tmp) >> $L 2>&1
say "\$ fp8linear quantize /tmp/smollm2-bf16 /tmp/smollm2-fp8"
[ -d /tmp/smollm2-fp8 ] || python3 -m fp8linear.cli quantize /tmp/smollm2-bf16 /tmp/smollm2-fp8 --quiet 2>&1 | tee -a $L
rm -f /tmp/ready.txt
clear_caches() { rm -rf ~/.cache/vllm ~/.triton ~/.cache/fp8linear /tmp/torchinductor_* ~/.cache/torch 2>/dev/null; }
serve() {  # serve NAME full|quick CMD...: start, time /health, HTTP checks, stop
  local name=$1 mode=$2; shift 2
  local log=/tmp/serve_$name.log t0 ready=""
  say ""; say "== $name: \$ $*"
  t0=$(date +%s.%N)
  setsid "$@" > $log 2>&1 &
  local pid=$!
  for _ in $(seq 1 1200); do
    if curl -sf -o /dev/null http://127.0.0.1:8000/health; then ready=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))"); break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.25
  done
  if [ -z "$ready" ]; then say "FAIL $name: not ready (server exited or 300 s passed)"; tail -30 $log | tee -a $L; kill -TERM -- -$pid 2>/dev/null; return 1; fi
  say "ready: /health 200 after $ready s"
  echo "$name $ready" >> /tmp/ready.txt
  python3 benchmarks/vllm_device/http_client.py 8000 "$(echo "$@" | awk '{print $3}')" $mode 2>&1 | tee -a $L
  kill -INT -- -$pid; local t1=$(date +%s)
  for _ in $(seq 1 240); do kill -0 $pid 2>/dev/null || break; sleep 0.25; done
  if kill -0 $pid 2>/dev/null; then say "FAIL $name: still running 60 s after SIGINT"; kill -KILL -- -$pid; else
    wait $pid; say "stopped cleanly: exit code $? $(($(date +%s) - t1)) s after SIGINT; processes left in its group: $(pgrep -g $pid | wc -l); port 8000 free: $(curl -s -o /dev/null http://127.0.0.1:8000/health && echo no || echo yes)"; fi
  say "-- server log ($name): our lines and any build or error lines"
  grep -iE "fp8linear|fp8_blockgemm|nvcc|compiling the sm90|error|traceback" $log | grep -v "^$" | head -25 | tee -a $L
}
# SERVES: which of the three starts this call makes (each ~2 min cold; a call has 10 min)
SERVES=${SERVES:-bf16,fp8,bf16_online}
want() { case ",$SERVES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
want bf16 && { clear_caches; serve bf16 quick vllm serve /tmp/smollm2-bf16; }
want fp8 && { clear_caches; serve fp8 full vllm serve /tmp/smollm2-fp8 --quantization fp8_blockgemm; }
want bf16_online && serve bf16_online quick vllm serve /tmp/smollm2-bf16 --quantization fp8_blockgemm
say ""; say "== cold start (caches cleared before each): $(tr '\n' ' ' < /tmp/ready.txt)"
