"""Time to first token of a long system prompt after a server restart, prompt cache on vs off.

Each round starts `sparkq serve` afresh (a restart) and sends one streamed completion: the same
SYSTEM-token prefix (text from CORPUS) and a question no earlier request had. Arm ``off``: a server
without --prompt-cache (the whole prompt prefilled). Arm ``on``: a server with --prompt-cache DIR,
which the warm-up request wrote (the prefix read back from the file, the rest prefilled). Arms
alternate; the file stays in the page cache between rounds, unless ``--cold`` drops it before each
'on' round (the read then comes from the disk).

``python tools/cachebench.py ART [--system 8000] [--rounds 3] [--cold] [--corpus ../shared/corpus/wikitext2-valid.txt]``
(sparkq on PATH) prints each round and the medians [min..max]."""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request

PORT = 8393


def _post(path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def _start(art: str, cache: str | None, ctx: int, budget: int) -> subprocess.Popen:
    cmd = ["sparkq", "serve", art, "--port", str(PORT), "--parallel", "1", "--max-model-len", str(ctx),
           "--kv-budget-mib", str(budget), "--model-name", "m"] + (["--prompt-cache", cache] if cache else [])
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
            return p
        except OSError:
            time.sleep(0.25)
    raise SystemExit("the server did not start")


def _drop(cache: str) -> None:
    """the files' pages out of the page cache (clean after the writer's fsync)"""
    import os
    for f in os.listdir(cache):
        fd = os.open(os.path.join(cache, f), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _ttft(ids: list[int]) -> tuple[float, int]:
    """seconds to the first streamed token, and the cached prompt tokens the final usage reports"""
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body, {"Content-Type": "application/json"})
    t0, first, cached = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices") and ev["choices"][0].get("text") is not None:
                first = time.perf_counter() - t0
            if ev.get("usage"):
                cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first, cached


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("art")
    ap.add_argument("--system", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512, help="--kv-budget-mib (one slot)")
    ap.add_argument("--cold", action="store_true", help="drop the cache files from the page cache before each "
                    "'on' round (posix_fadvise DONTNEED): the read comes from the disk")
    ap.add_argument("--corpus", default="../shared/corpus/wikitext2-valid.txt")
    a = ap.parse_args(argv)
    ctx = a.system + 64
    cache = tempfile.mkdtemp(prefix="sparkq-cachebench-")
    try:
        p = _start(a.art, cache, ctx, a.budget)
        text = open(a.corpus, encoding="utf-8").read()[:a.system * 8]
        system = _post("/tokenize", {"model": "m", "prompt": text})["tokens"][:a.system]
        questions = [_post("/tokenize", {"model": "m", "prompt": f"\n\nQuestion {i}: what is paragraph {i} about?"})["tokens"]
                     for i in range(2 * a.rounds + 1)]
        t, _ = _ttft(system + questions[0])  # the warm-up: writes the file
        print(f"warm-up (writes the cache): {t:.2f} s", flush=True)
        p.terminate()
        p.wait()
        res: dict[str, list[float]] = {"off": [], "on": []}
        q = 1
        for r in range(a.rounds):
            for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
                if arm == "on" and a.cold:
                    _drop(cache)
                p = _start(a.art, cache if arm == "on" else None, ctx, a.budget)
                t, cached = _ttft(system + questions[q])
                q += 1
                p.terminate()
                p.wait()
                res[arm].append(t)
                print(f"round {r + 1} cache {arm}: TTFT {t:.3f} s ({cached} prompt tokens cached)", flush=True)
        size = sum(f.stat().st_size for f in __import__("pathlib").Path(cache).iterdir()) / 2**20
        for arm, xs in res.items():
            print(f"cache {arm}: TTFT median {statistics.median(xs):.3f} s [{min(xs):.3f}..{max(xs):.3f}]")
        print(f"ratio off/on: {statistics.median(res['off']) / statistics.median(res['on']):.1f}x; "
              f"{len(system)}-token system prompt, cache file(s) {size:.0f} MiB")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
