"""The KV cache's int8 rounding error by scale granularity, on a real model's cache.

Prefills held-out text into a bf16 cache (torch-free runtime) and rounds every K and V row to
int8 with one scale per group of G channels (G = head_dim: the runtime's per-(position, KV head)
scale; 64; 32), reporting the median and p99 relative error ||x^ - x|| / ||x|| per row and the
bytes per row. ``--channels``: per layer, how far the largest channel's range stands above the
median channel's (the worst KV head), for K and V: what key scaling (convert/keyscale.py) flattens.
docs/long-context.md quotes its output.

    python tools/kvquant.py ARTIFACT --corpus ../shared/corpus/wikitext2-valid.txt [--tokens 1024] [--channels]
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--channels", action="store_true", help="per-layer channel range ratios instead")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from sparkq.runtime.lite import load

    m = load(a.artifact, max_model_len=a.tokens + 8, kv_budget_mib=4096, kv_dtype="bf16")
    ids = m.tokenizer.encode(open(a.corpus, encoding="utf-8", errors="replace").read()[: a.tokens * 12])[: a.tokens]
    m.prefill(ids)
    n = len(ids)
    rows = {"K": m.k, "V": m.v}
    if a.channels:
        return channels(a, rows, n)
    out = []
    for name, bits in rows.items():
        x = (bits[:, 0, :, :n].astype(np.uint32) << 16).view(np.float32)  # [layers, kv_heads, n, D]
        D = x.shape[-1]
        for g in sorted({D, 64, 32}, reverse=True):
            if D % g:
                continue
            xg = x.reshape(*x.shape[:-1], D // g, g)
            s = np.abs(xg).max(-1, keepdims=True) / 127
            q = np.clip(np.round(xg / np.where(s > 0, s, 1)), -127, 127) * s
            err = np.linalg.norm((q - xg).reshape(x.shape), axis=-1) / np.maximum(np.linalg.norm(x, axis=-1), 1e-30)
            out.append({"rows": name, "group": g, "median_rel_err": float(np.median(err)),
                        "p99_rel_err": float(np.percentile(err, 99)), "bytes_per_row": D + 2 * D // g,
                        "vs_bf16": (D + 2 * D // g) / (2 * D)})
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{a.artifact}: {n} tokens of {a.corpus}")
    print("| rows | scale per | median rel. error | p99 | bytes per row (vs bf16) |\n|---|---|---|---|---|")
    for r in out:
        print(f"| {r['rows']} | {r['group']} channels | {r['median_rel_err']:.4f} | {r['p99_rel_err']:.4f} "
              f"| {r['bytes_per_row']} ({r['vs_bf16']:.3f}x) |")


def channels(a, rows: dict, n: int) -> None:
    out = {}
    for name, bits in rows.items():
        x = np.abs((bits[:, 0, :, :n].astype(np.uint32) << 16).view(np.float32))  # [layers, kv_heads, n, D]
        ch = x.max(2)  # each channel's range over the positions
        out[name] = {"largest_over_median": (ch.max(-1) / np.maximum(np.median(ch, -1), 1e-30)).max(-1).tolist(),
                     "row_max_mean": x.max(-1).mean((1, 2)).tolist()}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{a.artifact}: {n} tokens of {a.corpus}; per layer, worst KV head")
    print("| layer | K largest / median channel | K mean row max | V largest / median | V mean row max |\n|---|---|---|---|---|")
    for i in range(len(out["K"]["row_max_mean"])):
        print(f"| {i} | {out['K']['largest_over_median'][i]:.1f} | {out['K']['row_max_mean'][i]:.1f} "
              f"| {out['V']['largest_over_median'][i]:.1f} | {out['V']['row_max_mean'][i]:.1f} |")


if __name__ == "__main__":
    main()
