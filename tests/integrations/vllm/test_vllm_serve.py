"""A real client: ``vllm serve DIR --quantization fp8_blockgemm`` on 127.0.0.1 (API server
and engine core in separate processes, each registering the plugin through its entry
point), one completion request over the OpenAI-compatible HTTP API, then the server is
stopped. Bounded: 240 s to come up, 120 s for the request, 30 s to stop."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import HERE, PROMPT, vllm_env

N_TOKENS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def _post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture
def server(tiny_models, tmp_path):
    port = _free_port()
    model = str(tiny_models["fp8"])
    env = vllm_env(tmp_path)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's usual engine-core process
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "vllm_cli.py"), "serve", model,
         "--quantization", "fp8_blockgemm", "--host", "127.0.0.1", "--port", str(port),
         "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--seed", "0",
         "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
         "--kv-cache-memory-bytes", str(64 * 2**20)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n"
                            f"{(tmp_path / 'serve.log').read_text()[-4000:]}")
            try:
                if _get(base + "/health", 5) == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                pytest.fail("vllm serve did not come up in 240 s:\n"
                            f"{(tmp_path / 'serve.log').read_text()[-4000:]}")
            time.sleep(1)
        yield base, model, tmp_path / "serve.log"
    finally:
        # the server runs in its own session: stop that group (server + engine core)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


def test_completion_over_http_matches_offline_engine(server, engine_results):
    base, model, log = server
    out = _post(base + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0.0,
        "logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True},
        timeout=120)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == N_TOKENS
    assert out["usage"] == {**out["usage"], "prompt_tokens": len(PROMPT),
                            "completion_tokens": N_TOKENS}
    # same checkpoint, same greedy decoding as the offline fp8_eager engine run
    offline = engine_results["fp8_eager"]
    for j, tok in enumerate(choice["token_ids"]):
        top = sorted(offline["token_top"][j].values(), reverse=True)
        if tok != offline["tokens"][j]:
            assert top[0] - top[1] < 0.05, (j, tok, offline["tokens"][j])
            break
        assert choice["logprobs"]["token_logprobs"][j] == pytest.approx(
            offline["token_logprobs"][j], abs=0.05)
    # the engine-core process built the model with our config (registered there too)
    assert "fp8_blockgemm: fp8 block-FP8 checkpoint; linear layers run on fp8linear" in \
        log.read_text()
