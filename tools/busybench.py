"""Speed beside busy programs (docs/performance.md "A busy machine"): decode and prompt speed of
sparkq's default (adaptive threads) against every fixed ``--threads``, and llama.cpp's llama-bench at
each thread count, with 0, 1 and 2 spinning processes (``python3 -c "while True: pass"``) beside it.

``python tools/busybench.py ART [ART ...] [--llama-gguf G ...] [--llama-bench BIN] [--rounds 3] [--busy 0,1,2]
[--out busybench.json]``

Per load, per round, every arm runs once (interleaved): ``sparkq generate ART PROMPT --max-new-tokens
64 --json`` with a prompt of ~512 tokens (``stats.prefill_tok_s``, ``stats.decode_tok_s``), and
``llama-bench -m G -t N -p 512 -n 64 -r 1``. Prints medians [min..max] and each arm's ratio to its
own quiet median; writes the runs to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT_TOKENS = 512


def prompt_text(art: str) -> str:
    """~PROMPT_TOKENS tokens of the bundled calibration text in the artifact's tokenizer"""
    from sparkq.runtime.tokenizer import ChatTokenizer
    text = (Path(__file__).parents[1] / "convert" / "data" / "calibration.txt").read_text()
    tok = ChatTokenizer.from_dir(Path(art), json.loads((Path(art) / "config.json").read_text()))
    ids = tok.encode(text)[:PROMPT_TOKENS]
    return tok.decode(ids)


def run_sparkq(art: str, prompt: str, threads: int | None) -> dict:
    cmd = ["sparkq", "generate", art, prompt, "--max-new-tokens", "64", "--json"]
    if threads:
        cmd += ["--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"busybench: {' '.join(cmd[:3])} failed: {p.stderr.strip()[-300:]}")
    st = json.loads(p.stdout)["stats"]
    return {"pp": st["prefill_tok_s"], "tg": st["decode_tok_s"], "new_tokens": st["new_tokens"]}


def run_llama(binary: str, gguf: str, threads: int) -> dict:
    p = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", str(PROMPT_TOKENS), "-n", "64", "-r", "1",
                        "-o", "json"], capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"busybench: llama-bench failed: {p.stderr.strip()[-300:]}")
    out = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in json.loads(p.stdout)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arts", nargs="+")
    ap.add_argument("--llama-gguf", action="append", default=[], help="one per artifact, in order (optional)")
    ap.add_argument("--llama-bench", default="llama-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", default="0,1,2")
    ap.add_argument("--out", default="busybench.json")
    a = ap.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    fixed = list(range(1, cpus + 1))
    res = {"cpus": cpus, "rounds": a.rounds, "models": {}}
    for mi, art in enumerate(a.arts):
        prompt = prompt_text(art)
        gguf = a.llama_gguf[mi] if mi < len(a.llama_gguf) else None
        arms = [("sparkq default (adaptive)", None)] + [(f"sparkq --threads {n}", n) for n in fixed]
        if gguf:
            arms += [(f"llama.cpp -t {n}", ("llama", n)) for n in fixed]
        per_load = {}
        for busy in (int(b) for b in a.busy.split(",")):
            spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                got: dict[str, list[dict]] = {name: [] for name, _ in arms}
                for r in range(a.rounds):
                    for name, arm in (arms if r % 2 == 0 else arms[::-1]):
                        got[name].append(run_llama(a.llama_bench, gguf, arm[1]) if isinstance(arm, tuple)
                                         else run_sparkq(art, prompt, arm))
                        print(f"{Path(art).name} busy={busy} round {r + 1} {name}: {got[name][-1]}", file=sys.stderr)
            finally:
                for p in spin:
                    p.kill()
                    p.wait()
            per_load[busy] = {name: {m: [x[m] for x in rs] for m in ("pp", "tg")} for name, rs in got.items()}
        res["models"][art] = per_load
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("\n".join(table(res)))


def med(xs):
    return statistics.median(xs)


def table(res: dict) -> list[str]:
    L = []
    for art, per_load in res["models"].items():
        loads = sorted(per_load, key=int)
        L += [f"**{Path(art).name}** (decode tg64 / prompt pp512 tok/s, medians of {res['rounds']} interleaved rounds "
              "[min..max]; x = the arm's ratio to its own quiet median)", "",
              "| arm | " + " | ".join(f"{b} busy: decode | {b} busy: prompt" for b in loads) + " |",
              "|---|" + "---|---|" * len(loads)]
        quiet = per_load[loads[0]]
        for name in quiet:
            cells = []
            for b in loads:
                r = per_load[b][name]
                for m in ("tg", "pp"):
                    q = med(quiet[name][m])
                    cells.append(f"{med(r[m]):.1f} [{min(r[m]):.0f}..{max(r[m]):.0f}] ({med(r[m]) / q:.2f}x)")
            L.append(f"| {name} | " + " | ".join(cells) + " |")
        L.append("")
    return L


if __name__ == "__main__":
    main()
