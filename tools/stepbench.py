"""The batched decode step alone (no HTTP, no sampling): ms per step and tokens/s for M sequences
at once against the single-sequence step, interleaved rounds, medians.

    python tools/stepbench.py ARTIFACT [--rows 1,2,4,8] [--threads 2] [--rounds 3] [--steps 10] [--tiles N]

--tiles N: a second batched arm whose int4 / lut4 products take the AMX-INT8 tiles from N
sequences on (Session.set_batch_tiles; the amx build), interleaved with the default one.
"""
import argparse
import statistics
import time

from sparkq.runtime.lite import load


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tiles", type=int, default=0)
    a = ap.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    m = load(a.artifact, threads=a.threads, slots=max(rows), kv_budget_mib=512, max_model_len=1024)
    one = load(a.artifact, threads=a.threads, slots=1, kv_budget_mib=64, max_model_len=1024)
    s, ids = m.session, m.tokenizer.encode("The capital of France is a city that")
    for i in range(max(rows)):
        s.prefill(ids, 0, kvoff=i * m.slot_elems)
    one.session.prefill(ids)
    res = {}
    for _ in range(a.rounds):
        t = time.perf_counter()
        for k in range(a.steps):
            one.session.step(5, len(ids) + k)
        res.setdefault("step (M=1)", []).append((time.perf_counter() - t) / a.steps)
        for M in rows:
            for arm in ("", " tiles")[:2 if a.tiles else 1]:
                s.set_batch_tiles(a.tiles if arm else 0)
                t = time.perf_counter()
                for k in range(a.steps):
                    s.step_many([5] * M, [len(ids) + k] * M, [i * m.slot_elems for i in range(M)])
                res.setdefault(f"step_many{arm} M={M}", []).append((time.perf_counter() - t) / a.steps)
    base = statistics.median(res["step (M=1)"])
    print(f"{a.artifact}: {a.threads} threads, {a.rounds} interleaved rounds of {a.steps} steps, medians")
    print("| call | ms / step | tok/s | vs step |\n|---|---|---|---|")
    for k, v in res.items():
        med, M = statistics.median(v), int(k.split("=")[-1].strip(")"))
        print(f"| {k} | {1e3 * med:.1f} | {M / med:.1f} | {M / med * base:.2f}x |")


if __name__ == "__main__":
    main()
