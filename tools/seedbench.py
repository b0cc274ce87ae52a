"""The seed's tables at Spark2_5's real shape (docs/performance.md "The seed's model").

``python tools/seedbench.py WORK [--llama-gguf Q4_0.gguf] [--llama-bench BIN] [--corpus FILE]``
expects in WORK (made by the commands it prints when they are missing):
``spark-x2.5-1.7b`` (``sparkq synth --shape spark-x2.5-1.7b``), ``spark-x2.5-1.7b-q`` (the default
conversion), ``spark-x2.5-1.7b-minmax`` (``--method minmax --kind int4``) and ``qwen3-1.7b-q``
(``sparkq synth --shape qwen3-1.7b`` + ``spark-convert --method minmax``); writes
``WORK/seedbench.json`` and prints markdown tables:

- memory: the seed's levers as A/B arms of ``sparkq memory`` (KV budget 1 GiB vs 192 MiB at
  max_model_len 2048; RoPE tables at max_model_len vs from the 1M config), each arm's ledger by
  role and its peak vs settled RSS through load;
- speed: ``sparkq bench`` (interleaved passes) of the Spark2_5 artifacts against the Qwen3-1.7B
  shape, and ``llama-bench`` on that shape's Q4_0 between the passes; decode's share of the
  streaming-read probe;
- the gate's share of a decode step: steps timed with the layers' gate products on and off
  (the same session, interleaved rounds);
- fidelity: ``sparkq fidelity`` of the default conversion against the bf16 checkpoint.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPARK, SPARK_Q, SPARK_MM, QWEN_Q = "spark-x2.5-1.7b", "spark-x2.5-1.7b-q", "spark-x2.5-1.7b-minmax", "qwen3-1.7b-q"
MAKE = {SPARK: "sparkq synth {w}/spark-x2.5-1.7b --shape spark-x2.5-1.7b",
        SPARK_Q: "spark-convert {w}/spark-x2.5-1.7b {w}/spark-x2.5-1.7b-q",
        SPARK_MM: "spark-convert {w}/spark-x2.5-1.7b {w}/spark-x2.5-1.7b-minmax --method minmax --kind int4",
        QWEN_Q: "sparkq synth {w}/qwen3-1.7b --shape qwen3-1.7b && spark-convert {w}/qwen3-1.7b {w}/qwen3-1.7b-q "
                "--method minmax"}
MEMORY_ARMS = {  # the seed's levers, one flag each, at max_model_len 2048 (then where the KV budget binds)
    "default (KV budget 192 MiB, RoPE at max_model_len 2048)": [],
    "KV budget 1 GiB": ["--kv-budget-mib", "1024"],
    "RoPE from the 1M config": ["--rope-len-from-config"],
    "max_model_len 1M, KV budget 192 MiB": ["--max-model-len", "1048576"],
    "max_model_len 1M, KV budget 1 GiB": ["--max-model-len", "1048576", "--kv-budget-mib", "1024"],
}


def sh(cmd: list[str], log: list[str]) -> dict:
    log.append(" ".join(map(str, cmd)))
    print("+", log[-1], file=sys.stderr)
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"seedbench: {log[-1]} failed: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout)


def memory(w: Path, log: list[str]) -> dict:
    return {arm: sh(["sparkq", "memory", w / SPARK_Q, *(["--max-model-len", "2048"] if "--max-model-len" not in flags
                                                         else []), *flags, "--json"], log)
            for arm, flags in MEMORY_ARMS.items()}


def llama_bench(binary: str, gguf: str, log: list[str]) -> dict:
    """pp512 and tg64 tok/s of one llama-bench run (2 threads)"""
    out = sh([binary, "-m", gguf, "-t", "2", "-p", "512", "-n", "64", "-r", "1", "-o", "json"], log)
    return {("pp512" if r["n_prompt"] else "tg64"): r["avg_ts"] for r in out}


def speed(w: Path, log: list[str], passes: int, llama: tuple[str, str] | None) -> dict:
    """sparkq bench one pass at a time (its arms interleaved within the pass), llama-bench after each"""
    runs, lruns = [], []
    for _ in range(passes):
        runs.append(sh(["sparkq", "bench", w / SPARK_Q, "--arm", f"minmax-int4=model={w / SPARK_MM}", "--arm",
                        f"qwen3-1.7b=model={w / QWEN_Q}", "--pp", "512", "--tg", "64", "--passes", "1", "--json"], log))
        if llama:
            lruns.append(llama_bench(*llama, log))
    arms = {}
    for name in runs[0]["arms"]:
        rs = [r["arms"][name] for r in runs]
        arms[name] = {"tg_tok_s": [r["tg_tok_s"]["median"] for r in rs], "pp_tok_s": [r["pp_tok_s"]["median"] for r in rs],
                      "pct_of_probe": [r["decode_pct_of_ceiling"] for r in rs],
                      "decode_bytes_per_token": rs[0]["decode_bytes_per_token"], "decode_path": rs[0]["decode_path"]}
    if lruns:
        arms["llama.cpp Q4_0 (qwen3-1.7b shape)"] = {"tg_tok_s": [r["tg64"] for r in lruns],
                                                     "pp_tok_s": [r["pp512"] for r in lruns]}
    return {"passes": passes, "arms": arms, "probes": [r["read_ceiling_gb_s"] for r in runs]}


def gate_share(w: Path, rounds: int = 7, steps: int = 48) -> dict:
    """A decode step's time with and without the layers' gate products (the gate's linear cleared in
    the C structs of one session; interleaved rounds, medians)."""
    from sparkq.runtime.core import abi
    from sparkq.runtime.lite import load

    m = load(str(w / SPARK_Q), max_model_len=1024)
    s = m.session
    gates = [abi.SqLinear.from_buffer_copy(s.layers[i].gate) for i in range(s.spec.layers)]  # (copies, not views)
    assert all(g.q for g in gates), "the artifact has no gate"
    m.prefill(list(range(1, 257)))
    t = {"on": [], "off": []}
    for r in range(rounds):
        for arm in ("on", "off") if r % 2 == 0 else ("off", "on"):
            for i in range(s.spec.layers):
                s.layers[i].gate = gates[i] if arm == "on" else abi.SqLinear()
            t0 = time.perf_counter()
            for j in range(steps):
                s.step(7, 256 + j)
            t[arm].append((time.perf_counter() - t0) / steps)
    for i in range(s.spec.layers):
        s.layers[i].gate = gates[i]
    on, off = statistics.median(t["on"]), statistics.median(t["off"])
    gbytes = sum(2 * g.n * g.k for g in gates)
    return {"step_ms_with_gate": 1e3 * on, "step_ms_without": 1e3 * off, "share": (on - off) / on,
            "rounds": rounds, "steps": steps, "gate_bytes": gbytes,
            "spread_ms": {k: [1e3 * min(v), 1e3 * max(v)] for k, v in t.items()}}


def med(xs):
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}..{max(xs):.1f}]"


def tables(res: dict) -> list[str]:
    L = ["| arm | weights | embedding/head | bf16 (gate) | KV cache | RoPE | imports | peak RSS | settled RSS | load s |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in res["memory"].items():
        c = {k: v["bytes"] / 2**20 for k, v in r["ledger"]["categories"].items()}
        wts = c.get("int4 weights", 0) + c.get("scales/zeros", 0) + c.get("int8 weights", 0)
        L.append(f"| {arm} | {wts:.1f} | {c.get('embedding/head', 0):.1f} | {c.get('bf16 weights', 0):.2f} | "
                 f"{c.get('kv cache', 0):.1f} | {c.get('rope tables', 0):.1f} | {sum(r['import_cost_mib'].values()):.0f} | {r['peak_mib']:.0f} | "
                 f"{r['settled_mib']:.0f} | {r['load_s']:.3f} |")
    L += ["", "| arm | decode tg64 tok/s | prefill pp512 tok/s | decode % of read probe |", "|---|---|---|---|"]
    for arm, a in res["speed"]["arms"].items():
        pct = med(a["pct_of_probe"]) if "pct_of_probe" in a else "-"
        L.append(f"| {arm} | {med(a['tg_tok_s'])} | {med(a['pp_tok_s'])} | {pct} |")
    g = res["gate"]
    L += ["", f"Gate: {g['gate_bytes'] / 2**10:.0f} KiB bf16 in all; decode step {g['step_ms_with_gate']:.2f} ms with "
          f"the gate products, {g['step_ms_without']:.2f} ms without: **{100 * g['share']:.2f}%** of the step "
          f"({g['rounds']} interleaved rounds of {g['steps']} steps, medians)."]
    if res.get("fidelity"):
        L += ["", "| conversion | KL mean | KL p99 | top-1 vs bf16 |", "|---|---|---|---|"]
        for arm, r in res["fidelity"].items():
            f = r["teacher_forced"]
            L.append(f"| {arm} | {f['kl_mean']:.4f} | {f['kl_p99']:.4f} | {f['top1_agreement']:.2%} |")
    return L


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--llama-gguf", help="the Qwen3-1.7B shape's Q4_0 GGUF (tools/llamacpp.py)")
    ap.add_argument("--llama-bench", default="llama-bench", help="llama.cpp's llama-bench binary")
    ap.add_argument("--corpus", help="text for sparkq fidelity (e.g. ../shared/corpus/wikitext2-valid.txt)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--only", default="memory,speed,gate,fidelity")
    a = ap.parse_args(argv)
    w = a.work
    missing = [MAKE[n].format(w=w) for n in (SPARK, SPARK_Q, SPARK_MM, QWEN_Q) if not (w / n).exists()]
    if missing:
        sys.exit("seedbench: make these first:\n  " + "\n  ".join(missing))
    out = w / "seedbench.json"
    res, log = json.loads(out.read_text()) if out.exists() else {}, []
    only = a.only.split(",")
    if "memory" in only:
        res["memory"] = memory(w, log)
    if "speed" in only:
        res["speed"] = speed(w, log, a.passes, (a.llama_bench, a.llama_gguf) if a.llama_gguf else None)
    if "gate" in only:
        res["gate"] = gate_share(w)
    if "fidelity" in only and a.corpus:
        res["fidelity"] = {arm: sh(["sparkq", "fidelity", w / art, "--reference", w / SPARK, "--corpus", a.corpus,
                                    "--tokens", "1024", "--json"], log)
                           for arm, art in (("default", SPARK_Q), ("minmax int4", SPARK_MM))}
    res.setdefault("commands", []).extend(log)
    out.write_text(json.dumps(res, indent=1))
    print("\n".join(tables(res)))


if __name__ == "__main__":
    main()
