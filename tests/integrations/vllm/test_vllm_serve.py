"""The CPU serving command that README.md and docs/vllm.md give, run as they give it, queried
over HTTP on 127.0.0.1 by a stdlib client.

The command is read from README.md (the one line that starts ``python -m fp8linear_vllm.cli
serve``; docs/vllm.md must hold the same line), so the documentation and the test cannot
drift. Only two things change: the model (the tiny FP8 checkpoint that `fp8linear quantize`
wrote, with a small word-level tokenizer and a 4096-position config added so that it serves
like a real model) and the address: ``--host 127.0.0.1 --port 0``, i.e. a port the OS picks
while binding; the test reads it from the server process's listening socket (vLLM logs the
requested port, 0). The server runs its usual processes (API server, engine core, worker),
each registering the plugin through its entry point. Checked: /v1/models, /v1/completions
(log-probabilities and greedy tokens against the offline engine's) and /v1/chat/completions,
streamed and not, concurrent clients, and a clean stop on SIGINT (exit code 0, no process of
the server left, the port closed).
Bounded: 300 s to come up, 120 s a request, 30 s to stop.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil  # (a dependency of vLLM)
import pytest

from conftest import PROMPT, REPO, vllm_env

DOC_PREFIX = ["python", "-m", "fp8linear_vllm.cli", "serve"]
ADDRESS = ["--host", "127.0.0.1", "--port", "0"]
N_TOKENS = 4
# test_vllm_engine's tolerances: eager vs compiled, and the margin of a clear greedy token
COMPILE_MEAN_TOL, COMPILE_MAX_TOL, CLEAR_MARGIN = 0.2, 0.6, 0.6
PLUGIN_LINE = "fp8_blockgemm: fp8 block-FP8 checkpoint; linear layers run on fp8linear"


def documented_lines(path) -> list[str]:
    return [ln.strip() for ln in (REPO / path).read_text().splitlines()
            if ln.strip().startswith(" ".join(DOC_PREFIX) + " ")]


def documented_command() -> list[str]:
    """The README's CPU serving command, split as a shell would split it."""
    readme, docs = documented_lines("README.md"), documented_lines("docs/vllm.md")
    assert len(readme) == 1, f"README.md should give one CPU serving command: {readme}"
    assert readme[0] in docs, f"docs/vllm.md does not give README.md's command {readme[0]!r}"
    argv = shlex.split(readme[0])
    assert argv[:4] == DOC_PREFIX and len(argv) > 4 and not argv[4].startswith("-"), argv
    assert not {"--host", "--port", "--uds"} & set(argv), argv  # the address is the test's
    return argv


def write_tokenizer(model_dir) -> None:
    """A word-level tokenizer over the tiny model's 512 ids ("w3" is id 3) with a chat
    template: enough for text prompts, detokenized output and chat requests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # words joined by spaces
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 4096,
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))


def _request(url, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _json(url, body=None, timeout=120):
    with _request(url, body, timeout) as r:
        assert r.status == 200
        return json.loads(r.read())


def _stream(url, body, timeout=120) -> list[dict]:
    """The server-sent events of a streamed request, up to ``data: [DONE]``."""
    events = []
    with _request(url, dict(body, stream=True), timeout) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: "):]))
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


class Server:
    def __init__(self, argv, env, log_path):
        self.argv, self.log_path = argv, log_path
        self.log = open(log_path, "w")
        # its own session: the group is the server and every process it starts
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.port = None

    def log_tail(self, n=4000) -> str:
        return self.log_path.read_text()[-n:]

    def listening_ports(self) -> list[int]:
        try:
            conns = psutil.Process(self.proc.pid).net_connections("tcp")
        except psutil.Error:
            return []
        return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})

    def wait_ready(self, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            for port in self.listening_ports():
                try:
                    with _request(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        if r.status == 200:
                            self.port = port
                            return
                except (urllib.error.URLError, ConnectionError, OSError):
                    pass
            time.sleep(1)
        pytest.fail(f"the server was not ready in {timeout} s:\n{self.log_tail()}")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def group_alive(self) -> bool:
        """Whether a live process (not a zombie) of the server's group is left."""
        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) == self.proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    return True
            except (ProcessLookupError, psutil.Error):
                pass
        return False

    def kill(self):
        if self.group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def model(tiny_models, tmp_path_factory):
    """The tiny FP8 checkpoint (`fp8linear quantize` output) with a tokenizer, positions up
    to 4096 (the documented --max-model-len) and nothing else changed."""
    d = tmp_path_factory.mktemp("serve") / "tiny-fp8"
    shutil.copytree(tiny_models["fp8"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    doc = documented_command()
    argv = [sys.executable] + doc[1:4] + [str(model)] + doc[5:] + ADDRESS
    tmp = tmp_path_factory.mktemp("serve-run")
    env = vllm_env(tmp)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's usual engine-core process
    srv = Server(argv, env, tmp / "serve.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def test_runs_exactly_the_documented_command(server, model):
    doc = documented_command()
    assert server.argv == [sys.executable, *doc[1:4], str(model), *doc[5:], *ADDRESS]


def test_models(server, model):
    out = _json(server.base + "/v1/models")
    assert [m["id"] for m in out["data"]] == [str(model)]


def test_completion_matches_offline_engine(server, model, engine_results):
    out = _json(server.base + "/v1/completions", {
        "model": str(model), "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1,
        "return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == N_TOKENS
    assert out["usage"] == {**out["usage"], "prompt_tokens": len(PROMPT),
                            "completion_tokens": N_TOKENS}
    # The same checkpoint as the offline eager engine run; the server compiles (the documented
    # command has no --enforce-eager), so they differ as test_vllm_engine's compiled and
    # eager engines do: log-probabilities within its compile tolerances, the same greedy
    # tokens up to the first position where eager's top-2 margin is not clear.
    offline = engine_results["fp8_eager"]
    served = [choice["prompt_logprobs"][i][str(t)]["logprob"]
              for i, t in enumerate(PROMPT) if i > 0]
    d = [abs(a - b) for a, b in zip(served, offline["prompt_logprobs"], strict=True)]
    assert sum(d) / len(d) < COMPILE_MEAN_TOL and max(d) < COMPILE_MAX_TOL, (
        f"server vs offline eager: mean {sum(d) / len(d):.3f} max {max(d):.3f}")
    for j, tok in enumerate(choice["token_ids"]):
        if tok != offline["tokens"][j]:
            top = sorted(offline["token_top"][j].values(), reverse=True)
            assert top[0] - top[1] < CLEAR_MARGIN, (j, tok, offline["tokens"][j])
            break
        assert choice["logprobs"]["token_logprobs"][j] == pytest.approx(
            offline["token_logprobs"][j], abs=COMPILE_MAX_TOL)


def test_completion_text_streamed_and_not(server, model):
    body = {"model": str(model), "prompt": "w5 w6 w7 w8", "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True}
    whole = _json(server.base + "/v1/completions", body)
    text = whole["choices"][0]["text"]
    assert re.fullmatch(r"( w\d+){8}", text), text
    events = _stream(server.base + "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completion_streamed_and_not(server, model):
    body = {"model": str(model), "messages": [{"role": "user", "content": "w9 w10 w11"}],
            "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    whole = _json(server.base + "/v1/chat/completions", body)
    msg = whole["choices"][0]["message"]
    assert msg["role"] == "assistant" and whole["usage"]["completion_tokens"] == 6
    events = _stream(server.base + "/v1/chat/completions", body)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e["choices"])
    assert streamed == msg["content"] and re.fullmatch(r" ?w\d+( w\d+){5}", streamed), streamed


def test_concurrent_clients(server, model):
    def one(i):
        return _json(server.base + "/v1/completions", {
            "model": str(model), "prompt": f"w{10 + i} w{20 + i} w{30 + i}", "max_tokens": 6,
            "temperature": 0.0, "ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    assert [o["usage"]["completion_tokens"] for o in outs] == [6] * 8


def test_plugin_registered_in_the_engine_process(server):
    # the engine core / worker processes built the model with our config (registered there
    # by the entry point; the wrapper's version fallback reached them too)
    assert PLUGIN_LINE in server.log_path.read_text()


def test_stops_cleanly_on_sigint(server):
    """Last in this module: stops the module's server. Ctrl-C: SIGINT to the whole group."""
    os.killpg(server.proc.pid, signal.SIGINT)
    try:
        rc = server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop in 30 s after SIGINT:\n{server.log_tail()}")
    deadline = time.time() + 15
    while server.group_alive() and time.time() < deadline:
        time.sleep(0.5)
    left = server.group_alive()
    assert rc == 0, f"exit code {rc} after SIGINT:\n{server.log_tail()}"
    assert not left, "processes of the server's group still run 15 s after it exited"
    with pytest.raises((ConnectionRefusedError, urllib.error.URLError)):
        _request(server.base + "/health", timeout=5)
