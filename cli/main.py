"""Console entry points: ``spark-convert`` and ``sparkq``.

Every user-facing failure is one line on stderr (``error: ...``) and exit code 2.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

convert_app = typer.Typer(add_completion=False, help="Convert a bf16 HF checkpoint, Hub repo id or GGUF file into a sparkq int4 artifact.")
app = typer.Typer(add_completion=False, no_args_is_help=True, help="sparkq: run small LLMs on CPUs with little RAM.")


def _user_errors():
    from sparkq.convert.errors import ConvertError
    from sparkq.formats import ArtifactError, LayoutError, SpecError
    errs = [ConvertError, ArtifactError, LayoutError, SpecError]
    try:
        from sparkq.runtime.errors import RuntimeUserError
        errs.append(RuntimeUserError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errs)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _run(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except _user_errors() as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written")


def _prefill_mode(v: str) -> bool | None:
    from sparkq.runtime.weights import PREFILL_MODES

    if v not in PREFILL_MODES:
        _fail(f"--prefill {v!r}: use one of {', '.join(PREFILL_MODES)}")
    return PREFILL_MODES[v]


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def print_convert_summary(s: dict) -> None:
    src = s["source"]
    rows = [
        ("source", f"{src.get('kind')}: {src.get('id')}" + (f"@{src['revision']}" if src.get("revision") else "")),
        ("output", s["output"]),
        ("family / method", f"{s['family']} / {s['method']}"),
        ("layout", s["layout"]),
        ("tensors", str(s["tensors"])),
        ("source -> artifact", f"{_mib(s['source_bytes'])} -> {_mib(s['artifact_bytes'])} "
                               f"({s['artifact_bytes'] / max(1, s['source_bytes']):.1%})"),
        ("bits / weight", f"{s['bits_per_weight']:.3f} (whole file, {s['parameters']:,} params)"),
        ("tied embedding", "yes, stored once (lm_head)" if s["tied_embeddings"] else "no (embed + lm_head)"),
        ("group sizes", ", ".join(f"{k}: {v} linears" for k, v in s["group_sizes"].items())),
        ("group size by role", ", ".join(f"{k}={v}" for k, v in s["group_size_by_role"].items())),
    ]
    for role, e in s["rel_error_by_role"].items():
        rows.append((f"rel. error {role}", f"mean {e['mean']:.4f}, max {e['max']:.4f}"))
    if s.get("calibration"):
        c = s["calibration"]
        rows.append(("calibration", f"{c['tokens']} tokens of {c['file']} from char {c['start_char']:,}; "
                                    f"forward {c['forward_seconds']:.1f} s"))
    rows += [
        ("time", f"{s['seconds']:.1f} s"),
        ("peak RSS (sampled)", f"{s['peak_rss_mib']:.0f} MiB (at start {s['start_rss_mib']:.0f} MiB); anonymous "
                               f"{s['peak_rss_anon_mib']:.0f} MiB (at start {s['start_rss_anon_mib']:.0f} MiB)"),
        ("largest source tensor", f"{s['largest_source_tensor_mib']:.1f} MiB"),
    ]
    typer.echo("sparkq conversion summary\n" + _table(rows))


@convert_app.command()
def convert(
    source: str = typer.Argument(..., help="HF checkpoint dir, Hub repo id org/name[@revision], or a .gguf file"),
    out: str = typer.Argument(..., help="output artifact directory (must not exist unless --force)"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="int4 group size along K (32, 64, 128, 256; "
                                             "default: the recipe's [quant] group_size, 128 in the built-in recipes)"),
    target: str = typer.Option("rows32", "--target", help="packed layout: rows32 (default: any CPU, read by the C decode core) or native|avx512|avx2|default (torch's int4 kernel on that ISA)"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="recipe TOML overriding the built-in one"),
    method: str = typer.Option("auto", "--method", help="auto (gptq when the source has a tokenizer, else clip) | "
                               "minmax (fastest) | clip (calibration-free range search) | gptq (calibrated)"),
    calib: Optional[str] = typer.Option(None, "--calib", help="calibration text file for gptq (its second half is used; "
                                        "default: the bundled text, convert/data/calibration.txt)"),
    calib_tokens: int = typer.Option(8192, "--calib-tokens", help="calibration tokens (windows of 512)"),
    head: Optional[str] = typer.Option(None, "--head", help="lm_head/embedding as int4 | int8 | bf16 | split (int4 + 4-bit residual: the decode step reads half an int8 head; default: recipe)"),
    force: bool = typer.Option(False, "--force", help="replace an existing OUT"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as one JSON object"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="then upload to this Hub repo (ORG/NAME)"),
    private: bool = typer.Option(False, "--private", help="with --push-to-hub: create the repo private"),
    revision: Optional[str] = typer.Option(None, "--revision", help="with --push-to-hub: branch to commit to"),
    base_model: Optional[str] = typer.Option(None, "--base-model", help="with --push-to-hub: the card's base_model, "
                                             "when SOURCE is not a Hub repo id (e.g. a GGUF)"),
):
    """Convert SOURCE into a sparkq int4 artifact at OUT."""
    from sparkq.convert.pipeline import Options
    from sparkq.convert.pipeline import convert as do_convert

    s = _run(do_convert, source, out, Options(group_size, target, recipe, method, force, not (quiet or as_json), head,
                                                   calib, calib_tokens))
    if push_to_hub:
        from sparkq.convert.publish import upload as do_upload
        s["upload"] = _run(do_upload, out, push_to_hub, private=private, revision=revision, base_model=base_model)
    if as_json:
        typer.echo(json.dumps(s, indent=1))
    else:
        print_convert_summary(s)
        if push_to_hub:
            u = s["upload"]
            typer.echo(f"  uploaded             {u['repo']}@{u['revision']} {u['variant']}/ (commit {u['commit'][:12]})")


@app.command()
def inspect(artifact: str, as_json: bool = typer.Option(False, "--json")):
    """Layout, group sizes, bytes per role, bits per weight, tied or not, source."""
    from sparkq.formats import Artifact

    s = _run(lambda: Artifact.open(artifact).summary())
    if as_json:
        typer.echo(json.dumps(s, indent=1))
        return
    rows = [("artifact", s["path"]), ("format version", str(s["format_version"])), ("layout", s["layout"]),
            ("family / method", f"{s['family']} / {s['method']}"),
            ("tied embedding", str(s["tied_embeddings"])),
            ("source", json.dumps(s["source"])),
            ("group sizes", ", ".join(f"{k}: {v}" for k, v in s["group_sizes"].items())),
            ("weights file", _mib(s["weights_file_bytes"])),
            ("bits / weight", f"{s['bits_per_weight']:.3f} overall, {s['bits_per_weight_linears']:.3f} quantized linears")]
    rows += [(f"bytes {k}", _mib(v)) for k, v in s["bytes_by_role"].items()]
    typer.echo(_table(rows))


@app.command()
def verify(artifact: str):
    """Recompute every tensor digest: exit 0 if all match, 2 naming the first bad tensor."""
    from sparkq.formats import Artifact
    from tqdm import tqdm

    art = _run(Artifact.open, artifact)
    size = art.weights_path.stat().st_size
    with tqdm(total=size, unit="B", unit_scale=True, desc="verify", leave=False, disable=not sys.stderr.isatty()) as bar:
        bad = art.verify(progress=bar.update)
    if bad:
        _fail(f"tensor {bad!r} does not match its sha256 in the manifest: the artifact is corrupt, re-download or re-convert it")
    typer.echo(f"ok: {len(art.manifest.tensors)} tensors verified ({_mib(size)})")


@app.command()
def upload(artifact: str, repo_id: str, private: bool = typer.Option(False, "--private"),
           revision: Optional[str] = typer.Option(None, "--revision", help="branch to commit to (created if needed)"),
           base_model: Optional[str] = typer.Option(None, "--base-model", help="the card's base_model when the source "
                                                    "was not a Hub repo id"),
           as_json: bool = typer.Option(False, "--json")):
    """Upload an artifact to the Hub as the <layout>/ variant of REPO_ID, with a generated model card."""
    from sparkq.convert.publish import upload as do_upload

    u = _run(do_upload, artifact, repo_id, private=private, revision=revision, base_model=base_model)
    typer.echo(json.dumps(u, indent=1) if as_json else
               _table([("repo", f"{u['repo']}@{u['revision']}"), ("variant", f"{u['variant']}/ ({', '.join(u['variants'])} in repo)"),
                       ("commit", u["commit"]), ("message", u["commit_message"]), ("files", str(u["files"]))]))


@app.command("import-gguf")
def import_gguf(gguf_file: str, out_dir: str, force: bool = typer.Option(False, "--force"),
                as_json: bool = typer.Option(False, "--json")):
    """Write the standard bf16 HF checkpoint (config, safetensors, tokenizer, chat template) of a GGUF file."""
    from sparkq.convert.pipeline import import_gguf as do_import

    s = _run(do_import, gguf_file, out_dir, force, not as_json)
    if as_json:
        typer.echo(json.dumps(s, indent=1))
    else:
        typer.echo(_table([("source", s["source"]["id"]), ("output", s["output"]), ("tensors", str(s["tensors"])),
                           ("weights", _mib(s["bytes"])), ("files", ", ".join(s["files"])),
                           ("time", f"{s['seconds']:.1f} s")]))


def convert_main():  # console script: spark-convert
    convert_app()


def sparkq_main():  # console script: sparkq
    app()


def _rss_mib() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) / 1024
    return out


@app.command()
def generate(
    model: str = typer.Argument(..., help="artifact dir, Hub repo id org/name[@revision], or a bf16 HF checkpoint dir"),
    prompt: str = typer.Argument(...),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="default: min(2048, max_position_embeddings)"),
    kv_budget_mib: float = typer.Option(192, "--kv-budget-mib"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    prefill: str = typer.Option("auto", "--prefill", help="prompt products of int4 linears above 64 rows: auto "
                                "(the C W4A8 GEMM where it applies, else dequantize), kernel, or dequant (fp32 activations, no A8)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (text, token ids, stats)"),
    lite: bool = typer.Option(False, "--lite", help="the torch-free runtime (rows32 artifacts, C core, numpy): "
                              "~200 MiB less memory; prompts always through the C prefill"),
):
    """Generate text; streams tokens, then prints one stats line."""
    if lite:
        from sparkq.runtime import load_lite

        if prefill != "auto":
            _fail("--prefill applies to the torch runtime; drop it with --lite (prompts go through the C prefill)")
        m = _run(load_lite, model, max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads)
    else:
        from sparkq.runtime import load

        m = _run(load, model, max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads,
                 prefill_dequant=_prefill_mode(prefill))
    hub = m.info.extra.get("hub")
    if hub and not as_json:
        typer.echo(f"[hub {hub['repo']} revision {hub['revision']} variant {hub['variant']}]", err=True)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    if as_json:
        r = _run(m.generate, prompt, chat=chat, **kw)
        r["stats"].update(load_s=m.info.load_seconds, kv_capacity=m.info.kv_capacity, layout=m.info.layout, hub=hub,
                          threads=_threads(m), rss_mib=_rss_mib())
        typer.echo(json.dumps(r))
        return

    def run_stream():
        for piece in m.stream(prompt, chat=chat, **kw):
            sys.stdout.write(piece)
            sys.stdout.flush()

    _run(run_stream)
    st, rss = m.last_stats, _rss_mib()
    typer.echo(f"\n[load {m.info.load_seconds:.2f} s | prefill {st.prompt_tokens} tok {st.prefill_tok_s:.1f} tok/s | "
               f"decode {st.new_tokens} tok {st.decode_tok_s:.1f} tok/s | RSS anon {rss['RssAnon']:.0f} MiB + "
               f"file {rss['RssFile']:.0f} MiB (peak {rss['VmHWM']:.0f}) | threads {_threads(m)} | "
               f"layout {m.info.layout or 'bf16 checkpoint'} | decode path {m.info.extra.get('decode_path', '?')} | "
               f"prefill path {m.info.extra.get('prefill_path', '?')}]", err=True)


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def _threads(m) -> int:
    """The loaded model's thread count (the torch-free runtime records its own; torch's otherwise)."""
    return m.info.extra["threads"] if "threads" in m.info.extra else torch_threads()


def _save(target: str, kind: str, result: dict) -> None:
    """Store a measurement inside the artifact (measurements/KIND.json) for its model card."""
    import os
    from pathlib import Path

    d = Path(target)
    if not (d / "sparkq.json").is_file():
        _fail(f"--save needs a local artifact directory, not {target!r}")
    (d / "measurements").mkdir(exist_ok=True)
    tmp = d / "measurements" / f".{kind}.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, d / "measurements" / f"{kind}.json")


def _plot(path: str, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> None:
    """A grouped bar chart as PNG (matplotlib, optional: `pip install matplotlib`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _fail("--plot needs matplotlib: pip install matplotlib")
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (name, vals) in zip(axes[0], groups.items()):
        ax.bar(list(vals), list(vals.values()), color="#4c72b0")
        ax.set_title(name)
        ax.set_ylabel(ylabel if ax is axes[0][0] else "")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


@app.command()
def memory(
    artifact: str,
    kv_budget_mib: Optional[float] = typer.Option(None, "--kv-budget-mib"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    rope_len_from_config: bool = typer.Option(False, "--rope-len-from-config",
                                              help="bad arm: size RoPE tables from max_position_embeddings"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    as_json: bool = typer.Option(False, "--json"),
    plot: Optional[str] = typer.Option(None, "--plot", help="write a PNG chart"),
    save: bool = typer.Option(False, "--save", help="store the result in ARTIFACT/measurements/ (model card)"),
):
    """Memory ledger (by storage, mincore residency), process stages, peak vs settled."""
    from sparkq.runtime.memory import run

    r = _run(run, artifact, kv_budget_mib=kv_budget_mib, max_model_len=max_model_len,
             rope_len_from_config=rope_len_from_config or None, threads=threads)
    if save:
        _save(artifact, "memory", r)
    if plot:
        _plot(plot, f"sparkq memory: {artifact}",
              {"process (MiB)": {s["stage"]: s["rss_anon_mib"] + s["rss_file_mib"] for s in r["stages"]},
               "ledger resident (MiB)": {k: v["resident"] / 2**20 for k, v in r["ledger"]["categories"].items()}}, "MiB")
    if as_json:
        typer.echo(json.dumps(r, indent=1))
        return
    lines = [f"sparkq memory: {artifact}  ({', '.join(f'{k}={v}' for k, v in r['settings'].items())})", "",
             f"  {'category':16} {'regions':>7} {'bytes':>12} {'resident':>12} {'file':>12} {'anon':>12}"]
    rows = list(r["ledger"]["categories"].items()) + [("total", r["ledger"]["total"])]
    for k, c in rows:
        lines.append(f"  {k:16} {c['regions']:>7} {_mib(c['bytes']):>12} {_mib(c['resident']):>12} "
                     f"{_mib(c['resident_file']):>12} {_mib(c['resident_anon']):>12}")
    lines += ["", f"  {'stage':18} {'RssAnon':>10} {'RssFile':>10} {'PSS':>10}"]
    for s in r["stages"]:
        lines.append(f"  {s['stage']:18} {s['rss_anon_mib']:>7.1f} MiB {s['rss_file_mib']:>6.1f} MiB {s['pss_mib']:>6.1f} MiB")
    lines += ["", f"  import cost: torch {r['import_cost_mib']['torch']:.1f} MiB, sparkq {r['import_cost_mib']['sparkq']:.1f} MiB",
              f"  load + warm-up: peak {r['peak_mib']:.1f} MiB, settled {r['settled_mib']:.1f} MiB, "
              f"transient {r['transient_mib']:.1f} MiB (sampled every 2 ms); load {r['load_s']:.3f} s"]
    typer.echo("\n".join(lines))


@app.command()
def fidelity(
    artifact: str,
    reference: str = typer.Option(..., "--reference", help="the bf16 HF checkpoint the artifact came from"),
    corpus: str = typer.Option(..., "--corpus", help="UTF-8 text for teacher-forced metrics (held-out text)"),
    tokens: int = typer.Option(4096, "--tokens"),
    window: int = typer.Option(512, "--window", help="tokens per teacher-forced window, each from position 0"),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="file with one prompt per line (default: 12 shipped)"),
    new_tokens: int = typer.Option(32, "--new-tokens"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    prefill: str = typer.Option("auto", "--prefill", help="the artifact's prompt products, as `sparkq generate "
                                "--prefill`: auto, kernel, or dequant (fp32 activations, no A8)"),
    as_json: bool = typer.Option(False, "--json"),
    save: bool = typer.Option(False, "--save", help="store the result in ARTIFACT/measurements/ (model card)"),
):
    """Top-1 agreement, KL(reference||artifact), perplexity, greedy reproductions."""
    from pathlib import Path

    from sparkq.runtime.fidelity import fidelity as do_fidelity

    plist = None
    if prompts:
        if not Path(prompts).is_file():
            _fail(f"--prompts {prompts}: no such file")
        plist = [line for line in Path(prompts).read_text().splitlines() if line.strip()]
    r = _run(do_fidelity, artifact, reference, corpus, tokens, window, plist, new_tokens, threads,
             prefill_dequant=_prefill_mode(prefill))
    if save:
        _save(artifact, "fidelity", r)
    if as_json:
        typer.echo(json.dumps(r, indent=1))
        return
    tf, g = r["teacher_forced"], r["greedy"]
    typer.echo(f"sparkq fidelity: {artifact} vs {reference}\n" + _table([
        ("tokens (teacher-forced)", f"{tf['tokens']} in windows of {r['window']} (prefill {prefill})"),
        ("top-1 agreement", f"{tf['top1_agreement']:.2%}"),
        ("KL(ref || artifact)", f"mean {tf['kl_mean']:.4f}, p99 {tf['kl_p99']:.4f}"),
        ("perplexity", f"artifact {tf['ppl_artifact']:.3f}, reference {tf['ppl_reference']:.3f}"),
        ("greedy identical", f"{g['identical']}/{g['prompts']} ({g['new_tokens']} tokens each)"),
        ("mean first divergence", f"{g['mean_first_divergence']:.1f} tokens"),
    ]) + f"\n  note: {g['caveat']}")


@app.command()
def bench(
    model: str,
    arm: list[str] = typer.Option([], "--arm", help="NAME=key=value,... (load options or UPPER_CASE env vars); repeatable"),
    passes: int = typer.Option(3, "--passes"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    pp: int = typer.Option(512, "--pp", help="prefill length"),
    tg: int = typer.Option(128, "--tg", help="decode length"),
    llama_gguf: list[str] = typer.Option([], "--llama-gguf", help="also bench this GGUF with llama-cpp-python; repeatable"),
    as_json: bool = typer.Option(False, "--json"),
    plot: Optional[str] = typer.Option(None, "--plot"),
    save: bool = typer.Option(False, "--save", help="store the result in MODEL/measurements/ (model card)"),
):
    """Decode/prefill tok/s, load, TTFT, peak/settled RSS: interleaved arms, medians and spread."""
    from sparkq.runtime.bench import bench as do_bench

    r = _run(do_bench, model, arm, passes, threads, pp, tg, 16, llama_gguf,
             (lambda msg: typer.echo(f"  {msg}", err=True)) if not as_json else None)
    if save:
        _save(model, "bench", r)
    if plot:
        _plot(plot, f"sparkq bench: {model}", {
            f"decode tg{tg} (tok/s)": {n: a["tg_tok_s"]["median"] for n, a in r["arms"].items()},
            f"prefill pp{pp} (tok/s)": {n: a["pp_tok_s"]["median"] for n, a in r["arms"].items()}}, "tok/s")
    if as_json:
        typer.echo(json.dumps(r, indent=1))
        return
    typer.echo(format_bench(r))


def format_bench(r: dict) -> str:
    lines = [f"sparkq bench: {r['model']}", f"  threads {r['threads']}, OMP_WAIT_POLICY {r['omp_wait_policy']}, "
             f"cpu {r['cpu_capability']}, {r['passes']} interleaved passes, medians [min..max]; "
             f"read ceiling {r['read_ceiling_gb_s']:.1f} GB/s"
             + (f" [{r['read_ceiling']['min']:.1f}..{r['read_ceiling']['max']:.1f}], probed before each arm's run; % ceiling = "
                "median over passes of a run's GB/s over its own probe; ratios = medians of same-pass ratios" if "read_ceiling" in r else ""),
             "",
             f"  | arm | decode tg{r['tg']} tok/s | prefill pp{r['pp']} tok/s | load s | TTFT s | peak / settled RSS MiB "
             f"| run peak / after RSS MiB (bound) | decode GB/s (% ceiling) | decode vs control | prefill vs control "
             f"| decode path; prefill path |", "  |---|---|---|---|---|---|---|---|---|---|---|"]
    for n, a in r["arms"].items():
        def f(m, fmt):
            return f"{format(a[m]['median'], fmt)} [{format(a[m]['min'], fmt)}..{format(a[m]['max'], fmt)}]"
        lines.append(f"  | {n} | {f('tg_tok_s', '.1f')} | {f('pp_tok_s', '.0f')} | {f('load_s', '.3f')} | {f('ttft_s', '.3f')} "
                     f"| {a['peak_rss_mib']['median']:.0f} / {a['settled_rss_mib']['median']:.0f} "
                     f"| {a['run_peak_rss_mib']['max']:.0f} / {a['after_run_rss_mib']['median']:.0f}"
                     f"{' (' + format(a['rss_bound_mib'], '.0f') + ')' if 'rss_bound_mib' in a else ''} "
                     f"| {a['decode_gb_s']:.1f} ({a['decode_pct_of_ceiling']:.0f}%) | {a['ratio_to_control']['tg_tok_s']:.2f}x "
                     f"| {a['ratio_to_control']['pp_tok_s']:.2f}x | {a.get('decode_path', '?')}"
                     f"{'; prefill ' + a['prefill_path'] if a.get('prefill_path') else ''} |")
    return "\n".join(lines)


@app.command()
def synth(
    out_dir: str,
    shape: str = typer.Option("qwen3-1.7b", "--shape", help="qwen3-1.7b | spark-x2.5-1.7b | smollm2-135m"),
    seed: int = typer.Option(0, "--seed"),
    force: bool = typer.Option(False, "--force"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Write a random-weight bf16 checkpoint of a real model shape (tied)."""
    from sparkq.convert.synth import synth as do_synth

    r = _run(do_synth, shape, out_dir, seed, force, not as_json)
    typer.echo(json.dumps(r, indent=1) if as_json else _table([(k, str(v)) for k, v in r.items()]))
