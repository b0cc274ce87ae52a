"""Where an artifact's KL comes from: its linears restored to the bf16 reference's, group by group.

Loads the artifact and its bf16 reference on the torch runtime (torch products, a bf16 KV cache, so
only the weights differ), then measures mean KL(reference || artifact) over TOKENS tokens of a text
(windows of 512) with each group of linears swapped for the reference's: none, each role (qkv with
its bias, o, gate_up, down, embed, lm_head) and each block of STEP layers. What a group costs is
the KL with nothing restored minus the KL with that group restored. With ``--summary`` (the
``spark-convert --json`` summary of the conversion that wrote the artifact) it also prints the sum
of the budget's damage estimates for each group and the ratio of measured to estimated
(docs/quality.md "Sensitivity").

    python tools/restore.py ARTIFACT REFERENCE --text FILE [--start 200000] [--tokens 1024] [--step 4]
        [--summary CONVERT.json] [--json]

Keep the text away from both the calibration text and the fidelity text (the docs use wikitext-2
validation characters 200,000-300,000).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

ROLES = ("qkv", "o", "gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("reference")
    ap.add_argument("--text", required=True)
    ap.add_argument("--start", type=int, default=200_000, help="first character of the text used")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--step", type=int, default=4, help="layers per block")
    ap.add_argument("--summary", help="the conversion's --json summary: its budget's estimates, to compare")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from sparkq.runtime.torchrt.api import load
    from sparkq.runtime.options import LabOptions

    lab = LabOptions(c_decode=False, c_prefill=False)
    art = load(a.artifact, max_model_len=600, kv_budget_mib=4096, kv_dtype="bf16", lab=lab)
    ref = load(a.reference, max_model_len=600, kv_budget_mib=4096, kv_dtype="bf16", lab=lab)
    text = open(a.text, encoding="utf-8", errors="replace").read()[a.start:a.start + a.tokens * 20]
    ids = art.tokenizer.encode(text)[:a.tokens]
    w = 512
    refl = [ref.logits(ids[s:s + w]).log_softmax(-1) for s in range(0, len(ids), w)]
    m, r = art.model, ref.model
    lin0, norms0 = dict(m.lin), dict(m.norms)

    def restore(names):
        m.lin, m.norms = dict(lin0), dict(norms0)
        for n in names:
            m.lin[n] = r.lin[n]
            if n.endswith(".qkv") and n + ".bias" in r.norms:  # the converter's key scaling moved the bias too
                m.norms[n + ".bias"] = r.norms[n + ".bias"]
        m.embedding = m.lin["embed"] if "embed" in m.lin else m.lin["lm_head"]
        m.head = m.lin["lm_head"]

    def kl() -> float:
        out = []
        for j, s in enumerate(range(0, len(ids), w)):
            la = m.logits(ids[s:s + w]).log_softmax(-1)
            out.append((refl[j].exp() * (refl[j] - la)).sum(-1))
        return float(torch.cat(out).double().mean())

    layers = m.spec.layers
    groups = {"none": []}
    for role in ROLES:
        groups[role] = [f"layers.{i}.{role}" for i in range(layers)]
    groups.update({n: [n] for n in ("embed", "lm_head") if n in lin0})
    for b in range(0, layers, a.step):
        e = min(layers, b + a.step)
        groups[f"layers {b}-{e - 1}"] = [f"layers.{i}.{role}" for i in range(b, e) for role in ROLES]
    est = None
    if a.summary:
        est = {n: v["damage_estimate"] for n, v in json.load(open(a.summary))["budget"]["linears"].items()}
    rows = []
    for g, names in groups.items():
        t = time.perf_counter()
        restore(names)
        rows.append({"restored": g, "kl": kl(), "seconds": round(time.perf_counter() - t, 1)})
    full = rows[0]["kl"]
    for row in rows[1:]:
        row["cost"] = full - row["kl"]
        if est is not None:
            row["estimate"] = sum(est[n] for n in groups[row["restored"]] if n in est)
            row["ratio"] = row["cost"] / row["estimate"] if row["estimate"] > 0 else None
    if a.json:
        print(json.dumps({"artifact": a.artifact, "tokens": len(ids), "kl": full, "groups": rows[1:]}, indent=1))
        return
    print(f"{a.artifact}: mean KL {full:.4f} over {len(ids)} tokens (torch runtime, bf16 KV cache)\n")
    print("| restored | KL | cost | share |" + (" estimate | measured / estimate |" if est else ""))
    print("|---|---|---|---|" + ("---|---|" if est else ""))
    for row in rows[1:]:
        line = f"| {row['restored']} | {row['kl']:.4f} | {row['cost']:.4f} | {row['cost'] / full:.2f} |"
        if est is not None:
            line += f" {row['estimate']:.2e} | {row['ratio']:.2f} |" if row["ratio"] is not None else " - | - |"
        print(line)


if __name__ == "__main__":
    main()
