"""Embeddings per second of 256-token passages through `sparkq serve` (the openai client): batch 1 (one
input a request, 16 requests in turn) and batch 16 (16 inputs in one request), interleaved rounds,
fresh random passages each time (a repeated one is a prefix-cache hit: not what is measured).

``python tools/embedbench.py ART [ROUNDS]`` (sparkq on PATH) prints each round and the medians
[min..max]."""
from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time

from openai import OpenAI

PORT, PASSAGE, BATCH = 8391, 256, 16


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    art, rounds = argv[0], int(argv[1]) if len(argv) > 1 else 3
    srv = subprocess.Popen(["sparkq", "serve", art, "--port", str(PORT), "--parallel", str(BATCH), "--max-model-len",
                            "512", "--kv-budget-mib", "256"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rng = random.Random(0)

    def fresh():
        return [[rng.randrange(1000, 150000) for _ in range(PASSAGE)] for _ in range(BATCH)]
    try:
        c = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x", max_retries=0, timeout=600)
        for _ in range(600):
            try:
                model = c.models.list().data[0].id
                break
            except Exception:  # (still loading)
                time.sleep(0.5)
        c.embeddings.create(model=model, input=fresh()[:2])  # warm-up
        res: dict[int, list[float]] = {1: [], BATCH: []}
        for r in range(rounds):
            for b in ((1, BATCH) if r % 2 == 0 else (BATCH, 1)):
                batch = fresh()
                t0 = time.perf_counter()
                if b == 1:
                    for p in batch:
                        c.embeddings.create(model=model, input=[p])
                else:
                    c.embeddings.create(model=model, input=batch)
                res[b].append(BATCH / (time.perf_counter() - t0))
                print(f"round {r + 1} batch {b}: {res[b][-1]:.2f}/s", flush=True)
        for b, xs in res.items():
            print(f"batch {b}: {statistics.median(xs):.2f} embeddings/s [{min(xs):.2f}..{max(xs):.2f}]")
    finally:
        srv.terminate()
        srv.wait()


if __name__ == "__main__":
    main()
