"""Latency of short requests over one kept-alive connection (the openai client's pool), the case
TCP_NODELAY decides (runtime/serve/server.py listen_socket):

    python tools/keepalive.py URL MODEL [--requests 20]

prints the median and range of one-token completions in ms (the first request, which opens the
connection, left out)."""
import argparse
import statistics
import time

import openai


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the server, e.g. http://127.0.0.1:8080")
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=20)
    a = ap.parse_args()
    c = openai.OpenAI(base_url=a.url.rstrip("/") + "/v1", api_key="unused", max_retries=0)
    ms = []
    for _ in range(a.requests + 1):
        t = time.perf_counter()
        c.completions.create(model=a.model, prompt="Hi", max_tokens=1, temperature=0)
        ms.append((time.perf_counter() - t) * 1e3)
    ms = ms[1:]
    print(f"{a.requests} one-token completions on one connection: median {statistics.median(ms):.1f} ms "
          f"[{min(ms):.1f}..{max(ms):.1f}]")


if __name__ == "__main__":
    main()
