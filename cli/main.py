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
    group_size: int = typer.Option(128, "--group-size", help="int4 group size along K (32, 64, 128, 256)"),
    target: str = typer.Option("native", "--target", help="packed layout: native|avx512|avx2|default"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="recipe TOML overriding the built-in one"),
    method: str = typer.Option("minmax", "--method", help="quantization method"),
    force: bool = typer.Option(False, "--force", help="replace an existing OUT"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as one JSON object"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
):
    """Convert SOURCE into a sparkq int4 artifact at OUT."""
    from sparkq.convert.pipeline import Options
    from sparkq.convert.pipeline import convert as do_convert

    s = _run(do_convert, source, out, Options(group_size, target, recipe, method, force, not (quiet or as_json)))
    if as_json:
        typer.echo(json.dumps(s, indent=1))
    else:
        print_convert_summary(s)


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
    typer.echo(f"ok: {len(art.manifest['tensors'])} tensors verified ({_mib(size)})")


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
    no_prefill_dequant: bool = typer.Option(False, "--no-prefill-dequant", help="prefill with the int4 kernel too"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (text, token ids, stats)"),
):
    """Generate text; streams tokens, then prints one stats line."""
    from sparkq.runtime import load

    m = _run(load, model, max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads,
             prefill_dequant=not no_prefill_dequant)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    if as_json:
        r = _run(m.generate, prompt, chat=chat, **kw)
        r["stats"].update(load_s=m.info.load_seconds, kv_capacity=m.info.kv_capacity, layout=m.info.layout,
                          threads=torch_threads(), rss_mib=_rss_mib())
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
               f"file {rss['RssFile']:.0f} MiB (peak {rss['VmHWM']:.0f}) | threads {torch_threads()} | "
               f"layout {m.info.layout or 'bf16 checkpoint'}]", err=True)


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()
