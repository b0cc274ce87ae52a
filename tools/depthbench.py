"""Decode speed at a long context against a short one, in one process: two loaded copies of an
artifact (the weights mapped once, page cache shared), one with DEPTH cached positions and one with
8, stepped alternately so drift on a shared box hits both arms alike. Reports each arm's median
step and the median of the per-pair ratios (tok/s at DEPTH over tok/s at 8) with quartiles.

    python tools/depthbench.py ARTIFACT [--depth 2000] [--steps 80] [--kv-dtype int8|bf16] [--json]

`sparkq bench --arm a=lite=1,depth=8 --arm b=lite=1,depth=2000` measures the same through the
generate loop, one process per arm (docs/long-context.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--depth", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-dtype", default=None, help="int8 | bf16 (default: the runtime's)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from sparkq.runtime.lite import load

    n = a.depth + a.steps + 16
    kw = dict(max_model_len=n, kv_budget_mib=4096, threads=a.threads, **({"kv_dtype": a.kv_dtype} if a.kv_dtype else {}))
    short, deep = load(a.artifact, **kw), load(a.artifact, **kw)
    ids = np.random.default_rng(0).integers(100, min(10000, short.spec.vocab), n).tolist()
    short.prefill(ids[:8])
    deep.prefill(ids[:a.depth])
    ts, td = [], []
    for i in range(a.steps):
        t = time.perf_counter()
        short.step(ids[8 + i], 8 + i)
        ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        deep.step(ids[a.depth + i], a.depth + i)
        td.append(time.perf_counter() - t)
    r = sorted(x / y for x, y in zip(ts, td))
    out = {"artifact": a.artifact, "depth": a.depth, "steps": a.steps, "kv_dtype": short.info.extra.get("kv_dtype", "bf16"),
           "threads": short.session.threads, "step_ms_at_8": statistics.median(ts) * 1e3,
           f"step_ms_at_{a.depth}": statistics.median(td) * 1e3, "ratio_median": statistics.median(r),
           "ratio_q1": float(np.percentile(r, 25)), "ratio_q3": float(np.percentile(r, 75))}
    if a.json:
        print(json.dumps(out))
        return
    print(f"{a.artifact}: KV {out['kv_dtype']}, {out['threads']} threads, {a.steps} alternating steps: "
          f"{out['step_ms_at_8']:.2f} ms at 8, {out[f'step_ms_at_{a.depth}']:.2f} ms at {a.depth}; "
          f"tok/s ratio {out['ratio_median']:.3f} [q1 {out['ratio_q1']:.3f}, q3 {out['ratio_q3']:.3f}]")


if __name__ == "__main__":
    main()
