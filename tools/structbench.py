"""Structured output's cost (by hand, not a test): aggregate decode tok/s of 4 concurrent streams
through `sparkq serve`'s app with a JSON schema on every request against the same requests
without, interleaved arms, medians over passes; and the per-token mask cost (llguidance's mask
plus its unpacking) timed alone over the tokens of constrained replies.

    python tools/structbench.py work/smollm2-135m-int4 --passes 3 [--json]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# a long string field: every token of a 64-token reply is inside the grammar, none ends it early
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 600}}, "required": ["story"]}
PROMPTS = ["Tell a story about a lighthouse.", "Describe a day at the market.", "Write about a long journey.",
           "Explain how bread is made."]


def main() -> None:
    import uvicorn
    from openai import OpenAI

    from sparkq.runtime.lite import load
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.serve.server import App

    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    e = Engine(load(a.artifact, max_model_len=1024, kv_budget_mib=64, slots=a.streams))
    app = App(e, "m")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app.asgi, log_level="warning", access_log=False))
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not srv.started:
        time.sleep(0.02)
    c = OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", max_retries=0, timeout=600)
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}

    def run(arm: str) -> float:
        toks = [0] * a.streams

        def one(k):
            extra = {"response_format": rf} if arm == "schema" else {}
            r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
                                          max_tokens=a.max_tokens, temperature=0.8, seed=k,
                                          extra_body={"ignore_eos": True}, **extra)
            toks[k] = r.usage.completion_tokens

        t0 = time.perf_counter()
        th = [threading.Thread(target=one, args=(k,)) for k in range(a.streams)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        return sum(toks) / (time.perf_counter() - t0)

    run("plain"), run("schema")  # warm: the tokenizer's trie, the first compile
    res = {"plain": [], "schema": [], "ratio": []}
    for _ in range(a.passes):
        p, s = run("plain"), run("schema")
        res["plain"].append(p), res["schema"].append(s), res["ratio"].append(s / p)
    # the mask alone, per token, over a constrained reply's tokens
    g = app.grammars()
    r = e.generate(e.tok.encode_chat([{"role": "user", "content": PROMPTS[0]}]), a.max_tokens,
                   constraint=g.constraint(g.json_schema(SCHEMA, "s")), temperature=0.8, seed=1)
    con = g.constraint(g.json_schema(SCHEMA, "s"))
    t0 = time.perf_counter()
    for t in r["ids"]:
        con.mask()
        con.consume(t)
    mask_ms = (time.perf_counter() - t0) / len(r["ids"]) * 1e3
    srv.should_exit = True
    e.close()
    out = {"artifact": a.artifact, "streams": a.streams, "max_tokens": a.max_tokens, "passes": a.passes,
           "agg_tok_s": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in res.items()},
           "mask_ms_per_token": mask_ms, "vocab": e.session.vocab}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"| arm | aggregate tok/s median [min..max] ({a.streams} streams, {a.passes} passes) |\n|---|---|")
    for k in ("plain", "schema"):
        v = out["agg_tok_s"][k]
        print(f"| {k} | {v['median']:.1f} [{v['min']:.1f}..{v['max']:.1f}] |")
    v = out["agg_tok_s"]["ratio"]
    print(f"| schema / plain | {v['median']:.3f} [{v['min']:.3f}..{v['max']:.3f}] |")
    print(f"mask per token: {mask_ms:.3f} ms (vocab {out['vocab']})")


if __name__ == "__main__":
    main()
