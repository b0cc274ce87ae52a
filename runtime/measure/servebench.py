"""The serving benchmark (``sparkq bench-serve``): concurrent streaming requests against
OpenAI-compatible servers (sparkq serve, llama.cpp's llama-server), interleaved.

Per concurrency level c, c client threads each send ``requests_per_client`` streaming
/v1/completions requests one after another (greedy, a fixed number of new tokens: ignore_eos,
which both servers accept). Measured per request: time to first token (TTFT: the first chunk
with text) and inter-token latency (ITL: the gaps between later chunks); per level: aggregate
decode tok/s = all completion tokens / the level's wall time. Arms (servers) and levels are
interleaved pass by pass, and each figure is the median over passes. Standard library only (the
client side needs nothing of sparkq's)."""
from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from urllib.parse import urlsplit


def post(url: str, path: str, body: dict | bytes, *, key: str | None = None, stream: bool = False,
         timeout: float = 600.0, read_events: int | None = None) -> dict:
    """POST body to url+path; returns {"status", "json" | "events", "ttft", "gaps", "text"} (SSE
    parsed when stream). read_events: stop after that many events and drop the connection (a
    client that leaves mid-stream)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    conn.request("POST", (u.path.rstrip("/") + path), body=data, headers=headers)
    resp = conn.getresponse()
    out = {"status": resp.status, "text": "", "ttft": None, "gaps": [], "events": []}
    if not stream or resp.status != 200:
        raw = resp.read()
        conn.close()
        try:
            out["json"] = json.loads(raw)
        except ValueError:
            out["json"] = None
        return out
    last = None
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            out["done"] = True
            break
        ev = json.loads(payload)
        out["events"].append(ev)
        piece = ""
        for c in ev.get("choices") or []:
            piece += c.get("text") or (c.get("delta") or {}).get("content") or ""
            if c.get("finish_reason"):
                out["finish"] = c["finish_reason"]
        if ev.get("usage"):
            out["usage"] = ev["usage"]
        if piece:
            now = time.perf_counter()
            if out["ttft"] is None:
                out["ttft"] = now - t0
            else:
                out["gaps"].append(now - last)
            last = now
            out["text"] += piece
        if read_events is not None and len(out["events"]) >= read_events:
            conn.sock.close()  # leave mid-stream
            conn.close()
            out["left"] = True
            return out
    conn.close()
    return out


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def id_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of ``length`` token ids in [100, 1000) (for servers without a real vocabulary);
    another seed, other prompts"""
    import random
    r = random.Random(seed)
    return [[r.randrange(100, 1000) for _ in range(length)] for _ in range(n)]


def run_level(url: str, model: str, prompts: list, c: int, max_tokens: int, per_client: int,
              key: str | None = None) -> dict:
    results, errors = [], []

    def client(i):
        for j in range(per_client):
            body = {"model": model, "prompt": prompts[(i * per_client + j) % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            try:
                r = post(url, "/v1/completions", body, key=key, stream=True)
            except OSError as e:
                errors.append(str(e))
                continue
            if r["status"] != 200:
                errors.append(f"HTTP {r['status']}")
                continue
            results.append(r)

    t0 = time.perf_counter()
    th = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum((r.get("usage") or {}).get("completion_tokens") or len(r["gaps"]) + 1 for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {"concurrency": c, "requests": len(results), "errors": len(errors), "tokens": tokens, "wall_s": wall,
            "agg_tok_s": tokens / wall if wall else 0.0, "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
            "itl_p50_ms": 1e3 * _pct(gaps, 0.5), "itl_p95_ms": 1e3 * _pct(gaps, 0.95)}


def bench(arms: dict[str, tuple[str, str]], prompts, levels: list[int], max_tokens: int, passes: int,
          per_client: int = 2, key: str | None = None, progress=None) -> dict:
    """arms: name -> (base URL, model id); prompts: a list, or (pass, level) -> list: new prompts for
    every level of every pass, so that no server's prompt cache finds one level's prompts in the
    next (the arms of a level get the same ones). Returns {"runs": [...], "summary": {arm: {c:
    medians}}}."""
    servers = {name: server_build(url, key) for name, (url, _) in arms.items()}
    runs = []
    for p in range(passes):
        for c in levels:
            plist = prompts(p, c) if callable(prompts) else prompts
            for name, (url, model) in arms.items():
                r = run_level(url, model, plist, c, max_tokens, per_client, key)
                r.update(arm=name, **{"pass": p})
                runs.append(r)
                if progress:
                    progress(r)
    summary: dict = {}
    for name in arms:
        summary[name] = {}
        for c in levels:
            rs = [r for r in runs if r["arm"] == name and r["concurrency"] == c]
            med = {k: statistics.median(r[k] for r in rs) for k in ("agg_tok_s", "ttft_p50_s", "ttft_p95_s",
                                                                       "itl_p50_ms", "itl_p95_ms")}
            med["agg_tok_s_range"] = [min(r["agg_tok_s"] for r in rs), max(r["agg_tok_s"] for r in rs)]
            med["errors"] = sum(r["errors"] for r in rs)
            summary[name][c] = med
    return {"runs": runs, "summary": summary, "builds": servers}


def server_build(url: str, key: str | None = None) -> str | None:
    """The C-core build a sparkq server runs (its /health "build"); None for other servers."""
    u = urlsplit(url)
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
        conn.request("GET", u.path.rstrip("/") + "/health", headers={"Authorization": f"Bearer {key}"} if key else {})
        body = json.loads(conn.getresponse().read())
        conn.close()
    except (OSError, ValueError):
        return None
    return body.get("build") if isinstance(body, dict) else None
