"""HTTP checks against a running `vllm serve` (stdlib only): models, completions and chat
completions, streaming and not, concurrent clients. Exit 1 on any failed check."""
import http.client, json, sys, threading, time
port, model = int(sys.argv[1]), sys.argv[2]
full = len(sys.argv) > 3 and sys.argv[3] == "full"
fails = []
def req(method, path, body=None, stream=False):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request(method, path, body=json.dumps(body) if body else None,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if not stream:
        data = r.read().decode(); c.close()
        return r.status, (json.loads(data) if data.startswith("{") else data)
    chunks = []
    for line in r:
        line = line.decode().strip()
        if line.startswith("data: "):
            chunks.append(line[6:])
    c.close()
    return r.status, chunks
def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok: fails.append(name)
st, body = req("GET", "/v1/models")
check("GET /v1/models", st == 200 and body["data"][0]["id"] == model, f"{st} {body['data'][0]['id'] if st == 200 else body}")
comp = {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
st, body = req("POST", "/v1/completions", comp)
text = body["choices"][0]["text"] if st == 200 else ""
check("POST /v1/completions", st == 200 and len(text) > 0, f"{st} {text!r}")
if full:
    st, chunks = req("POST", "/v1/completions", dict(comp, stream=True), stream=True)
    streamed = "".join(json.loads(c)["choices"][0]["text"] for c in chunks if c != "[DONE]")
    check("POST /v1/completions stream", st == 200 and chunks[-1] == "[DONE]" and len(chunks) > 2 and streamed == text,
          f"{st} {len(chunks)} events, same text as non-streamed: {streamed == text}")
    chat = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0}
    st, body = req("POST", "/v1/chat/completions", chat)
    msg = body["choices"][0]["message"]["content"] if st == 200 else ""
    check("POST /v1/chat/completions", st == 200 and len(msg) > 0, f"{st} {msg!r}")
    st, chunks = req("POST", "/v1/chat/completions", dict(chat, stream=True), stream=True)
    deltas = "".join(json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks if c != "[DONE]")
    check("POST /v1/chat/completions stream", st == 200 and chunks[-1] == "[DONE]" and deltas == msg,
          f"{st} {len(chunks)} events, same text as non-streamed: {deltas == msg}")
    n, res = 16, [None] * 16
    def client(i):
        try:
            res[i] = req("POST", "/v1/completions", {"model": model, "prompt": f"Count to {i + 3}:", "max_tokens": 32, "temperature": 0})
        except Exception as e:
            res[i] = (0, repr(e))
    t0 = time.time()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    [t.start() for t in ts]; [t.join() for t in ts]
    dt = time.time() - t0
    good = [r for r in res if r[0] == 200 and r[1]["choices"][0]["text"]]
    toks = sum(r[1]["usage"]["completion_tokens"] for r in good)
    check(f"{n} concurrent clients", len(good) == n, f"{len(good)}/{n} answered in {dt:.2f} s, {toks} tokens")
sys.exit(1 if fails else 0)
