"""Making artifacts: spark-convert, sparkq import-gguf, sparkq synth."""
from __future__ import annotations

import json
from typing import Optional

import typer

from . import render as R
from .common import app, convert_app
from .common import (_fail, _kv, _need_convert_extra, _plot, _prefill_mode, _rss_mib, _run, _runtime, _save,  # noqa: F401
                     _threads, artifact_layout, open_model)


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
    bpw: Optional[float] = typer.Option(None, "--bpw", help="bits per weight of the file, spent per linear where they "
                                        "buy the most fidelity (lut4 and int4 at g32-g128, int8, split head; rows32). "
                                        "Default: the built-in budget, unless --kind / --head / --group-size ask for one encoding"),
    kind: Optional[str] = typer.Option(None, "--kind", help="every body linear's 4-bit codes: int4 (uniform grid) or lut4 "
                                       "(a 16-level grid learned per row; rows32 only); no --bpw budget"),
    head: Optional[str] = typer.Option(None, "--head", help="lm_head/embedding as int4 | lut4 | int8 | bf16 | split (int4 + 4-bit residual: the decode step reads half an int8 head; default: recipe)"),
    head_rows: Optional[float] = typer.Option(None, "--head-rows", help="with --head split: the share of lm_head's rows "
                                              "that get the second plane, the most probable tokens' (e.g. 0.0625; default: all)"),
    key_scaling: bool = typer.Option(True, "--key-scaling/--no-key-scaling", help="move powers of two from the keys' "
                                     "large channels onto the queries' (the same q.k; flatter rows for the int8 KV cache)"),
    mtp: bool = typer.Option(True, "--mtp/--no-mtp", help="keep the multi-token-prediction block a checkpoint ships "
                             "(Qwen3.5's mtp.*: speculative decoding with --draft mtp; int4, ~3%% of the file)"),
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
    _need_convert_extra("spark-convert")
    from sparkq.convert.pipeline import Options
    from sparkq.convert.pipeline import convert as do_convert

    s = _run(do_convert, source, out, Options(group_size, target, recipe, method, force, not (quiet or as_json), head,
                                                   calib, calib_tokens, kind, "auto" if bpw is None else bpw,
                                                   key_scaling, head_rows, mtp))
    if push_to_hub:
        from sparkq.convert.publish import upload as do_upload
        s["upload"] = _run(do_upload, out, push_to_hub, private=private, revision=revision, base_model=base_model)
    if as_json:
        typer.echo(json.dumps(s, indent=1))
    else:
        typer.echo(R.convert_summary(s))
        if push_to_hub:
            u = s["upload"]
            typer.echo(f"  uploaded             {u['repo']}@{u['revision']} {u['variant']}/ (commit {u['commit'][:12]})")


@app.command("import-gguf")
def import_gguf(gguf_file: str, out_dir: str, force: bool = typer.Option(False, "--force"),
                as_json: bool = typer.Option(False, "--json")):
    """Write the standard bf16 HF checkpoint (config, safetensors, tokenizer, chat template) of a GGUF file."""
    _need_convert_extra("sparkq import-gguf")
    from sparkq.convert.pipeline import import_gguf as do_import

    s = _run(do_import, gguf_file, out_dir, force, not as_json)
    if as_json:
        typer.echo(json.dumps(s, indent=1))
    else:
        typer.echo(R.table([("source", s["source"]["id"]), ("output", s["output"]), ("tensors", str(s["tensors"])),
                           ("weights", R.mib(s["bytes"])), ("files", ", ".join(s["files"])),
                           ("time", f"{s['seconds']:.1f} s")]))


@app.command()
def synth(
    out_dir: str,
    shape: str = typer.Option("qwen3-1.7b", "--shape", help="qwen3-1.7b | spark-x2.5-1.7b | qwen3.5-0.8b | "
                              "qwen3.5-2b | gemma4-e2b | gemma4-e4b | smollm2-135m"),
    seed: int = typer.Option(0, "--seed"),
    force: bool = typer.Option(False, "--force"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Write a random-weight bf16 checkpoint of a real model shape (its published layout and tensor names)."""
    _need_convert_extra("sparkq synth", ("torch",))
    from sparkq.convert.synth import synth as do_synth

    r = _run(do_synth, shape, out_dir, seed, force, not as_json)
    typer.echo(json.dumps(r, indent=1) if as_json else R.table([(k, str(v)) for k, v in r.items()]))
