"""Speculative decoding, measured (docs/performance.md "Speculation"): decode tok/s of one model
without a draft, with n-gram lookup and with a draft model, on three tasks (an edit that repeats a
40-line code prompt, new code, free chat), arms interleaved round by round, greedy; every arm's
tokens are checked equal to the plain arm's. ``--serve 1,4``: the same through the server's engine
(continuous batching, in process) at 1 and 4 concurrent streams (aggregate tok/s). ``--llama-server``:
llama.cpp's llama-server on a GGUF of the same model, plain and with its n-gram speculation
(``--spec-type ngram-simple``), its own timings. Medians over rounds, min-max beside them.

  python tools/specbench.py ART [--draft DRAFT_ART] [--rounds 3] [--tokens 256] [--serve 1,4]
      [--llama-server BIN --llama-gguf GGUF] [--json OUT]
  python tools/specbench.py ART --row-cost      (a pass of T rows against one step: DraftLength's ROW_COST)
  python tools/specbench.py ART --oracle        (scripted drafters: right / 3 of 4 / wrong, on any shape;
                                                 and the artifact's MTP block where it has one)
  python tools/specbench.py ART --mtp-cost      (an MTP block's draft step against a decode step)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

CODE = '''import json
import os
from dataclasses import dataclass, field


@dataclass
class Config:
    name: str
    workers: int = 4
    paths: list = field(default_factory=list)
    verbose: bool = False


def parse_config(path):
    with open(path) as f:
        raw = json.load(f)
    cfg = Config(name=raw["name"])
    cfg.workers = int(raw.get("workers", 4))
    cfg.paths = [os.path.expanduser(p) for p in raw.get("paths", [])]
    cfg.verbose = bool(raw.get("verbose", False))
    return cfg


def check_config(cfg):
    if cfg.workers < 1:
        raise ValueError("workers must be at least 1")
    for p in cfg.paths:
        if not os.path.exists(p):
            raise FileNotFoundError(p)
    return True


def main(argv):
    cfg = parse_config(argv[1])
    check_config(cfg)
    if cfg.verbose:
        print("loaded", cfg.name, "with", cfg.workers, "workers")
    for p in cfg.paths:
        print(p)
    return 0
'''
TASKS = {
    "edit": "Rename the function parse_config to load_config everywhere in this file and output the complete "
            "updated file, nothing else.\n\n```python\n" + CODE + "```",
    "new": "Write a Python module implementing a thread-safe LRU cache class with get, put and delete methods "
           "and a memoizing decorator built on it, with docstrings.",
    "chat": "What are three good ways to improve sleep quality? Answer in a short paragraph.",
}


def med(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run_generate(m, arms, tasks, rounds, tokens):
    out = {}
    ids = {t: m.tokenizer.encode_chat([{"role": "user", "content": TASKS[t]}]) for t in tasks}
    ref = {}
    for r in range(rounds):
        for t in tasks:
            for arm, draft in arms.items():
                got = list(m.stream_ids(ids[t], tokens, draft=draft))
                st = m.last_stats
                if t not in ref:
                    ref[t] = got
                assert got == ref[t], f"{arm} on {t}: not the plain tokens"
                o = out.setdefault(t, {}).setdefault(arm, {"tok_s": [], "accepted": [], "drafted": [], "new": []})
                o["tok_s"].append(st.decode_tok_s)
                o["drafted"].append(st.drafted)
                o["accepted"].append(st.accepted)
                o["new"].append(st.new_tokens)
                print(f"round {r} {t:5} {arm:6} {st.decode_tok_s:7.2f} tok/s  {st.new_tokens} tokens, drafted "
                      f"{st.drafted}, accepted {st.accepted}", flush=True)
    return out


def run_serve(path, draft_path, streams, tasks, rounds, tokens, threads):
    from sparkq.runtime.lite import load
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.speculate import drafter
    out = {}
    for c in streams:
        engines = {}
        for arm in ["plain", "ngram"] + (["draft"] if draft_path else []):
            m = load(path, max_model_len=2048, kv_budget_mib=64 * c, slots=c, threads=threads)
            d = None if arm == "plain" else drafter("ngram" if arm == "ngram" else draft_path, m, slots=c)
            engines[arm] = Engine(m, draft=d)
        for r in range(rounds):
            for t in tasks:
                ids = engines["plain"].tok.encode_chat([{"role": "user", "content": TASKS[t]}])
                for arm, e in engines.items():
                    res = [None] * c
                    t0 = time.perf_counter()
                    ths = [threading.Thread(target=lambda k=k: res.__setitem__(k, e.generate(ids, tokens)))
                           for k in range(c)]
                    for th in ths:
                        th.start()
                    for th in ths:
                        th.join()
                    dt = time.perf_counter() - t0
                    n = sum(len(x["ids"]) for x in res)
                    out.setdefault(f"{t}@{c}", {}).setdefault(arm, []).append(n / dt)
                    print(f"round {r} {t:5} x{c} {arm:6} {n / dt:7.2f} tok/s (incl. prefill)", flush=True)
        for e in engines.values():
            e.close()
    return {k: {a: med(v) for a, v in arms.items()} for k, arms in out.items()}


def run_llama(server, gguf, tasks, rounds, tokens, threads):
    """llama-server plain and with --spec-type ngram-simple: its own decode timings"""
    from sparkq.runtime.measure.servebench import post
    out = {}
    for arm, extra in (("plain", []), ("ngram-simple", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                                                       "--spec-ngram-simple-size-m", "16"])):
        port = 18931
        p = subprocess.Popen([server, "-m", gguf, "--port", str(port), "-t", str(threads), "-c", "4096", "--no-warmup",
                              *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    import urllib.request
                    if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                        break
                except Exception:  # noqa: BLE001 (still loading)
                    time.sleep(0.5)
            for r in range(rounds):
                for t in tasks:
                    res = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": TASKS[t]}],
                                                             "max_tokens": tokens, "temperature": 0})
                    tm = res["json"].get("timings", {})
                    o = out.setdefault(t, {}).setdefault(arm, {"tok_s": [], "drafted": [], "accepted": []})
                    o["tok_s"].append(tm.get("predicted_per_second", 0.0))
                    o["drafted"].append(tm.get("draft_n", 0))
                    o["accepted"].append(tm.get("draft_n_accepted", 0))
                    print(f"round {r} {t:5} llama.cpp {arm:12} {o['tok_s'][-1]:7.2f} tok/s drafted {o['drafted'][-1]} "
                          f"accepted {o['accepted'][-1]}", flush=True)
        finally:
            p.terminate()
            p.wait(30)
    return out


def row_cost(path, threads, rounds):
    """the checking pass's cost: T rows of one sequence (verify) against one decode step"""
    from sparkq.runtime.lite import load
    m = load(path, max_model_len=1024, threads=threads)
    m.prefill(list(range(100, 400)))
    res = {T: [] for T in (1, 2, 3, 5, 9)}
    for _ in range(max(rounds, 5)):
        for T in res:
            t0 = time.perf_counter()
            for _ in range(4):
                m.verify([5] * T, 300)
                m.keep(1)
            res[T].append((time.perf_counter() - t0) / 4)
    base = statistics.median(res[1])
    for T, v in res.items():
        x = statistics.median(v) / base
        print(f"rows {T}: {statistics.median(v) * 1e3:6.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})  {x:.2f}x a step"
              + (f", +{(x - 1) / (T - 1):.3f} a row" if T > 1 else ""))
    return {T: med(v) for T, v in res.items()}


def mtp_cost(path, threads, rounds):
    """an MTP block's draft step (its layer, fc and the model's head) against the model's decode step"""
    import numpy as np

    from sparkq.runtime.lite import load
    from sparkq.runtime.mtp import MtpBlock
    m = load(path, max_model_len=1024, threads=threads)
    h = m.session.prefill(list(range(100, 400)), last_only=False)
    b = MtpBlock(path, slots=1, cap=m.cap, threads=m.session.threads)
    b.session.prefill(list(range(101, 400)), 0, hin=h[:299])
    res = {"step": [], "mtp": []}
    for _ in range(max(rounds, 5)):
        for arm in res:
            t0 = time.perf_counter()
            for _ in range(4):
                if arm == "step":
                    m.verify([5], 300)
                else:
                    b.session.step_many([5], [299], [0], hin=np.ascontiguousarray(h[299:300]))
            res[arm].append((time.perf_counter() - t0) / 4)
    x = statistics.median(res["mtp"]) / statistics.median(res["step"])
    for arm, v in res.items():
        print(f"{arm:5} {statistics.median(v) * 1e3:6.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})")
    print(f"an MTP draft step costs {x:.2f} of a decode step (the drafter prices it at {b.step_bytes / _bytes(m):.2f} "
          "from the bytes)")
    return {arm: med(v) for arm, v in res.items()}


def _bytes(m):
    from sparkq.runtime.speculate import step_bytes
    return step_bytes(m)


class Scripted:
    """a drafter that knows the answer: right (``every`` 0), wrong (1), or wrong every ``every``-th position"""

    def __init__(self, full, every, vocab):
        self.full, self.every, self.vocab = full, every, vocab

    def warm(self, key, ids):
        pass

    def propose_many(self, asks):
        out = []
        for _, ids, k in asks:
            c = self.full[len(ids):len(ids) + k]
            out.append([(t + 1) % self.vocab if self.every and (len(ids) + j) % self.every == 0 else t
                        for j, t in enumerate(c)])
        return out


def oracle(path, rounds, tokens, threads):
    """what checking and rewinding cost on a shape without a natural drafter (synth weights): drafts
    always right, right 3 of 4, always wrong, against plain decoding"""
    from sparkq.runtime.lite import load
    m = load(path, max_model_len=1024, threads=threads)
    ids = list(range(1000, 1200))
    ref = list(m.stream_ids(ids, tokens, stop_ids=()))
    arms = {"plain": None, "right": Scripted(ids + ref, 0, m.spec.vocab), "3 of 4": Scripted(ids + ref, 4, m.spec.vocab),
            "wrong": Scripted(ids + ref, 1, m.spec.vocab)}
    if m.spec.mtp_layers:  # the artifact's own block (random weights: wrong), with its catch-up and probes
        arms["mtp"] = m.drafter("mtp")
    res = {a: [] for a in arms}
    for _ in range(rounds):
        for a, d in arms.items():
            assert list(m.stream_ids(ids, tokens, stop_ids=(), draft=d)) == ref
            res[a].append(m.last_stats.decode_tok_s)
    base = statistics.median(res["plain"])
    for a, v in res.items():
        print(f"{a:7} {statistics.median(v):7.2f} tok/s [{min(v):.2f}..{max(v):.2f}] {statistics.median(v) / base:.2f}x")
    return {a: med(v) for a, v in res.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("art")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--tasks", default="edit,new,chat")
    ap.add_argument("--serve", default="")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--llama-gguf", default=None)
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--row-cost", action="store_true", help="only the checking pass's cost per row")
    ap.add_argument("--oracle", action="store_true", help="only scripted drafters (right / 3 of 4 / wrong)")
    ap.add_argument("--mtp-cost", action="store_true", help="only an MTP block's draft step against a decode step")
    a = ap.parse_args()
    if a.mtp_cost:
        mtp_cost(a.art, a.threads, a.rounds)
        return
    if a.row_cost:
        row_cost(a.art, a.threads, a.rounds)
        return
    if a.oracle:
        oracle(a.art, a.rounds, a.tokens, a.threads)
        return
    from sparkq.runtime.lite import load
    tasks = a.tasks.split(",")
    res = {"settings": vars(a)}
    if not a.no_generate:
        m = load(a.art, max_model_len=2048, threads=a.threads)
        arms = {"plain": None, "ngram": m.drafter("ngram")}
        if a.draft:
            arms["draft"] = m.drafter(a.draft)
        g = run_generate(m, arms, tasks, a.rounds, a.tokens)
        res["generate"] = g
        print("\ntask   arm     tok/s median (min-max)   ratio   accepted/drafted")
        for t, arms_ in g.items():
            base = statistics.median(arms_["plain"]["tok_s"])
            for arm, o in arms_.items():
                s = med(o["tok_s"])
                acc = f"{sum(o['accepted'])}/{sum(o['drafted'])}" if o["drafted"][0] else "-"
                print(f"{t:6} {arm:6} {s['median']:7.2f} ({s['min']:.2f}-{s['max']:.2f})   {s['median'] / base:5.2f}x   {acc}")
    if a.serve:
        res["serve"] = run_serve(a.art, a.draft, [int(x) for x in a.serve.split(",")], tasks, a.rounds, a.tokens, a.threads)
        for k, arms_ in res["serve"].items():
            base = arms_["plain"]["median"]
            print(k, "  ".join(f"{arm} {v['median']:.2f} ({v['median'] / base:.2f}x)" for arm, v in arms_.items()))
    if a.llama_server:
        res["llama"] = run_llama(a.llama_server, a.llama_gguf, tasks, a.rounds, a.tokens, a.threads or 2)
        for t, arms_ in res["llama"].items():
            base = statistics.median(arms_["plain"]["tok_s"])
            for arm, o in arms_.items():
                print(f"llama.cpp {t:6} {arm:12} {statistics.median(o['tok_s']):7.2f} "
                      f"({statistics.median(o['tok_s']) / base:.2f}x) accepted {sum(o['accepted'])}/{sum(o['drafted'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
