"""Two serving probes through the openai client, arms interleaved (one URL per arm, e.g. the same
artifact served twice with different flags):

    python tools/serveprobe.py keepalive URL MODEL [--requests 20]
        one-token completions on one kept-alive connection (the openai client's pool): the case
        TCP_NODELAY decides (runtime/serve/server.py listen_socket); median and range in ms, the
        first request (which opens the connection) left out
    python tools/serveprobe.py choices MODEL URL [URL ...] [--n 4] [--chars 4000] [--rounds 4]
        n choices of one long prompt (the first chars of ../shared/corpus/wikitext2-valid.txt, a new
        prompt each round) with 8 tokens each: the prompt prefilled once and copied (prefix.py) or
        once per choice (--no-prefix-cache); median and range in s per arm
"""
import argparse
import statistics
import time
from pathlib import Path

import openai


def _client(url):
    return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)


def keepalive(a) -> None:
    c, ms = _client(a.url), []
    for _ in range(a.requests + 1):
        t = time.perf_counter()
        c.completions.create(model=a.model, prompt="Hi", max_tokens=1, temperature=0)
        ms.append((time.perf_counter() - t) * 1e3)
    ms = ms[1:]
    print(f"{a.requests} one-token completions on one connection: median {statistics.median(ms):.1f} ms "
          f"[{min(ms):.1f}..{max(ms):.1f}]")


def choices(a) -> None:
    text = (Path(__file__).resolve().parents[1] / ".." / "shared/corpus/wikitext2-valid.txt").read_text()[:a.chars]
    times = {u: [] for u in a.urls}
    for rnd in range(a.rounds):
        for u in a.urls:
            t = time.perf_counter()
            r = _client(u).completions.create(model=a.model, prompt=f"[{rnd}] {text}", n=a.n, max_tokens=8,
                                              temperature=0.8, seed=1)
            times[u].append(time.perf_counter() - t)
    for u, v in times.items():
        print(f"{u}: n={a.n}, {r.usage.prompt_tokens}-token prompt, 8 tokens each: median {statistics.median(v):.2f} s "
              f"[{min(v):.2f}..{max(v):.2f}] over {a.rounds} rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keepalive")
    k.add_argument("url")
    k.add_argument("model")
    k.add_argument("--requests", type=int, default=20)
    c = sub.add_parser("choices")
    c.add_argument("model")
    c.add_argument("urls", nargs="+")
    c.add_argument("--n", type=int, default=4)
    c.add_argument("--chars", type=int, default=4000)
    c.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    keepalive(a) if a.cmd == "keepalive" else choices(a)


if __name__ == "__main__":
    main()
