"""A bounded mixed load against a running OpenAI-compatible server (tests/test_serve.py; by hand:
`python tests/serveload.py URL MODEL --requests 200 --clients 16`): well-formed requests (chat and
completions, streamed and not) whose text must equal what the same request got alone, clients that
leave mid-stream, malformed bodies and over-long prompts, with the server's RSS sampled."""
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparkq.runtime.measure.servebench import post  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello in Spanish."]
TEXTS = ["The capital of France is", "Water boils at", "def fibonacci(n):", "Once upon a time"]


def _templates(model):
    out = []
    for i, q in enumerate(QUESTIONS):
        out.append(("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": q}],
                                             "max_tokens": 12 + 4 * i, "temperature": 0, "stream": i % 2 == 0}))
    for i, t in enumerate(TEXTS):
        out.append(("/v1/completions", {"model": model, "prompt": t, "max_tokens": 10 + 4 * i, "temperature": 0,
                                        "stream": i % 2 == 1}))
    # seeded sampling with every control, a JSON schema and a forced tool call: the same bits under load
    out.append(("/v1/completions", {"model": model, "prompt": TEXTS[0], "max_tokens": 16, "temperature": 0.7, "seed": 5,
                                    "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                                    "top_k": 40, "min_p": 0.05, "stream": False}))
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24},
                                               "sure": {"type": "boolean"}}, "required": ["answer", "sure"]}
    out.append(("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": QUESTIONS[0]}],
                                         "max_tokens": 40, "temperature": 0.8, "seed": 7, "stream": True,
                                         "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "a", "schema": schema}}}))
    tool = {"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string", "maxLength": 20}}, "required": ["country"]}}}
    out.append(("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": QUESTIONS[0]}],
                                         "max_tokens": 40, "temperature": 0.8, "seed": 3, "stream": False,
                                         "tools": [tool], "tool_choice": "required"}))
    # the Responses API (instructions, a sampled reply) beside the rest
    out.append(("/v1/responses", {"model": model, "instructions": "Be brief.", "input": QUESTIONS[2],
                                  "max_output_tokens": 16, "temperature": 0.7, "seed": 4, "stream": False}))
    # n seeded choices; lm-eval's loglikelihood request (a batch, echo, the prompts' logprobs)
    out.append(("/v1/completions", {"model": model, "prompt": TEXTS[1], "max_tokens": 12, "temperature": 0.9, "seed": 9,
                                    "n": 2, "stream": False}))
    out.append(("/v1/completions", {"model": model, "prompt": TEXTS[2:], "max_tokens": 1, "temperature": 0, "seed": 1234,
                                    "logprobs": 1, "echo": True, "stream": False}))
    # the Messages API (a system prompt, a sampled reply), embeddings and rerank beside the generation
    out.append(("/v1/messages", {"model": model, "system": "Be brief.", "max_tokens": 16, "temperature": 0.7,
                                 "messages": [{"role": "user", "content": QUESTIONS[3]}]}))
    out.append(("/v1/embeddings", {"model": model, "input": TEXTS[:2]}))
    out.append(("/v1/rerank", {"model": model, "query": QUESTIONS[0], "documents": TEXTS}))
    return out


STREAMABLE = ("/v1/chat/completions", "/v1/completions")  # the routes a client leaves mid-stream


def _malformed(model, rng):
    return rng.choice([b"{", b"null", b"[]", json.dumps({"model": model}).encode(),
                       json.dumps({"model": model, "messages": "hi"}).encode(),
                       json.dumps({"model": model, "prompt": "a", "max_tokens": -1}).encode(),
                       json.dumps({"model": model, "prompt": "a", "n": 0}).encode(),
                       json.dumps({"model": model, "prompt": "a", "temperature": "hot"}).encode(),
                       json.dumps({"model": "other", "prompt": "a"}).encode(), b"\xff\xfe garbage"])


def _text(r):
    j = r.get("json") or {}
    if j.get("type") == "message":  # the Messages API: its content blocks
        return json.dumps(j["content"])
    if j.get("object") == "list" or "results" in j:  # embeddings (the vectors' bits), rerank (scores, order)
        return json.dumps(j.get("data") or j.get("results"))
    if "json" in r and "output" in r["json"]:  # a Responses API reply: its items' texts and calls
        return json.dumps([[o.get("type"), [c.get("text") for c in o.get("content", [])], o.get("arguments")]
                           for o in r["json"]["output"]])
    if "json" in r and len(r["json"]["choices"]) > 1:  # n choices, a batch: each one's text and logprobs
        return json.dumps([[c.get("text"), (c.get("logprobs") or {}).get("token_logprobs")] for c in r["json"]["choices"]])
    if "json" in r:
        c = r["json"]["choices"][0]
        if c.get("message", {}).get("tool_calls"):  # (their ids are new per response)
            return json.dumps([t["function"] for t in c["message"]["tool_calls"]])
        return c["message"]["content"] if "message" in c else c["text"]
    return r["text"]


def load_test(url, model, requests=200, clients=16, rss=None, seed=0):
    rng = random.Random(seed)
    tmpl = _templates(model)
    expected = []
    for path, body in tmpl:  # each request alone first: the answer it must get under load too
        r = post(url, path, body, stream=body.get("stream", False))
        assert r["status"] == 200, r
        expected.append(_text(r))
    time.sleep(0.5)
    settled = rss() if rss else 0.0
    jobs = []
    for i in range(requests):
        x = rng.random()
        if x < 0.6:
            k = rng.randrange(len(tmpl))
            jobs.append(("ok", k))
        elif x < 0.75:
            jobs.append(("leave", rng.choice([k for k, (path, _) in enumerate(tmpl) if path in STREAMABLE])))
        elif x < 0.9:
            jobs.append(("bad", _malformed(model, rng)))
        else:
            jobs.append(("long", None))
    res = {"requests": requests, "ok": 0, "refused": 0, "left": 0, "wrong": [], "failed": []}
    lock = threading.Lock()
    peak = [settled]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.05)

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                kind, arg = jobs.pop()
            try:
                if kind == "ok":
                    path, body = tmpl[arg]
                    r = post(url, path, body, stream=body.get("stream", False))
                    with lock:
                        if r["status"] != 200:
                            res["failed"].append((kind, r["status"], r.get("json")))
                        elif _text(r) != expected[arg]:
                            res["wrong"].append((arg, _text(r), expected[arg]))
                        else:
                            res["ok"] += 1
                elif kind == "leave":
                    path, body = tmpl[arg]
                    r = post(url, path, {**body, "stream": True, "max_tokens": 64}, stream=True, read_events=2)
                    with lock:
                        res["left"] += 1
                elif kind == "bad":
                    r = post(url, "/v1/completions", arg)
                    with lock:
                        if r["status"] in (400, 404) and r["json"] and "error" in r["json"]:
                            res["refused"] += 1
                        else:
                            res["failed"].append((kind, r["status"], arg[:40]))
                else:
                    r = post(url, "/v1/completions", {"model": model, "prompt": "many words " * 3000, "max_tokens": 4})
                    with lock:
                        if r["status"] == 400 and "context" in r["json"]["error"]["message"]:
                            res["refused"] += 1
                        else:
                            res["failed"].append((kind, r["status"], r.get("json")))
            except Exception as e:  # noqa: BLE001 -- a dropped connection is a failure to report
                with lock:
                    res["failed"].append((kind, "exception", repr(e)))

    sampler = threading.Thread(target=sample, daemon=True) if rss else None
    if sampler:
        sampler.start()
    t0 = time.perf_counter()
    th = [threading.Thread(target=worker) for _ in range(clients)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    res["wall_s"] = time.perf_counter() - t0
    # the server is idle again once the clients that left have been noticed
    for _ in range(200):
        h = json.loads(__import__("urllib.request").request.urlopen(url + "/health", timeout=5).read())
        if h["running"] == 0 and h["waiting"] == 0:
            break
        time.sleep(0.05)
    res["server"] = h
    time.sleep(0.5)
    stop.set()
    if rss:
        res.update(rss_settled_mib=settled, rss_peak_mib=peak[0], rss_after_mib=rss())
    return res


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--pid", type=int, help="the server's pid: sample its RSS")
    a = ap.parse_args()

    def rss():
        for line in open(f"/proc/{a.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    r = load_test(a.url, a.model, a.requests, a.clients, rss if a.pid else None)
    print(json.dumps({k: v for k, v in r.items()}, indent=1))
