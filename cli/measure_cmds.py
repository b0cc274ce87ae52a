"""The measurements: sparkq memory, fidelity, bench, bench-serve."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from . import render as R
from .common import OPT_KV_DTYPE, app
from .common import (_fail, _kv, _need_convert_extra, _plot, _prefill_mode, _rss_mib, _run, _runtime, _save,  # noqa: F401
                     _threads, artifact_layout, open_model)


@app.command()
def memory(
    artifact: str,
    kv_budget_mib: Optional[float] = typer.Option(None, "--kv-budget-mib"),
    kv_dtype: Optional[str] = OPT_KV_DTYPE,
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    rope_len_from_config: bool = typer.Option(False, "--rope-len-from-config",
                                              help="bad arm: size RoPE tables from max_position_embeddings"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    as_json: bool = typer.Option(False, "--json"),
    plot: Optional[str] = typer.Option(None, "--plot", help="write a PNG chart"),
    save: bool = typer.Option(False, "--save", help="store the result in ARTIFACT/measurements/ (model card)"),
):
    """Memory ledger (by storage, mincore residency), process stages, peak vs settled."""
    _need_convert_extra("sparkq memory", ("torch",))
    from sparkq.runtime.measure.memory import run

    r = _run(run, artifact, kv_budget_mib=kv_budget_mib, max_model_len=max_model_len,
             rope_len_from_config=rope_len_from_config or None, threads=threads, kv_dtype=kv_dtype)
    if save:
        _save(artifact, "memory", r)
    if plot:
        _plot(plot, f"sparkq memory: {artifact}",
              {"process (MiB)": {s["stage"]: s["rss_anon_mib"] + s["rss_file_mib"] for s in r["stages"]},
               "ledger resident (MiB)": {k: v["resident"] / 2**20 for k, v in r["ledger"]["categories"].items()}}, "MiB")
    if as_json:
        typer.echo(json.dumps(r, indent=1))
        return
    typer.echo(R.memory_summary(artifact, r))


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
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="the artifact's KV cache (int8 | bf16)"),
    reference_kv_dtype: str = typer.Option("bf16", "--reference-kv-dtype", help="the reference's KV cache"),
    as_json: bool = typer.Option(False, "--json"),
    save: bool = typer.Option(False, "--save", help="store the result in ARTIFACT/measurements/ (model card)"),
):
    """Top-1 agreement, KL(reference||artifact), perplexity, greedy reproductions. The reference
    may be an artifact too: `--reference ART --kv-dtype int8` measures the int8 KV cache alone."""
    from pathlib import Path

    _need_convert_extra("sparkq fidelity", ("torch",))
    from sparkq.runtime.measure.fidelity import fidelity as do_fidelity

    plist = None
    if prompts:
        if not Path(prompts).is_file():
            _fail(f"--prompts {prompts}: no such file")
        plist = [line for line in Path(prompts).read_text().splitlines() if line.strip()]
    r = _run(do_fidelity, artifact, reference, corpus, tokens, window, plist, new_tokens, threads,
             prefill_dequant=_prefill_mode(prefill), **_kv(kv_dtype), reference_kv_dtype=reference_kv_dtype)
    if save:
        _save(artifact, "fidelity", r)
    if as_json:
        typer.echo(json.dumps(r, indent=1))
        return
    typer.echo(R.fidelity_summary(artifact, reference, prefill, r))


@app.command()
def bench(
    model: str,
    arm: list[str] = typer.Option([], "--arm", help="NAME=key=value,... (load options or UPPER_CASE env vars); repeatable"),
    passes: int = typer.Option(3, "--passes"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    pp: int = typer.Option(512, "--pp", help="prefill length"),
    tg: int = typer.Option(128, "--tg", help="decode length"),
    depth: int = typer.Option(0, "--depth", help="decode after this many cached positions (a prompt of DEPTH "
                              "tokens first), as llama-bench -d"),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="every sparkq arm's KV cache (int8 | bf16; an arm's "
                                           "kv_dtype=... overrides it)"),
    llama_gguf: list[str] = typer.Option([], "--llama-gguf", help="also bench this GGUF with llama-cpp-python; repeatable"),
    as_json: bool = typer.Option(False, "--json"),
    plot: Optional[str] = typer.Option(None, "--plot"),
    save: bool = typer.Option(False, "--save", help="store the result in MODEL/measurements/ (model card)"),
):
    """Decode/prefill tok/s, load, TTFT, peak/settled RSS: interleaved arms, medians and spread."""
    _need_convert_extra("sparkq bench", ("torch",))
    from sparkq.runtime.measure.bench import bench as do_bench

    r = _run(do_bench, model, arm, passes, threads, pp, tg, 16, llama_gguf,
             (lambda msg: typer.echo(f"  {msg}", err=True)) if not as_json else None, depth=depth, kv_dtype=kv_dtype)
    if save:
        _save(model, "bench", r)
    if plot:
        _plot(plot, f"sparkq bench: {model}", {
            f"decode tg{tg} (tok/s)": {n: a["tg_tok_s"]["median"] for n, a in r["arms"].items()},
            f"prefill pp{pp} (tok/s)": {n: a["pp_tok_s"]["median"] for n, a in r["arms"].items()}}, "tok/s")
    if as_json:
        typer.echo(json.dumps(r, indent=1))
        return
    typer.echo(R.format_bench(r))


@app.command("bench-serve")
def bench_serve(
    arm: list[str] = typer.Option(..., "--arm", help="NAME=URL[@MODEL]: an OpenAI-compatible server (base URL without "
                                  "/v1; MODEL: the id it serves, default NAME); repeatable, arms are interleaved"),
    concurrency: str = typer.Option("1,2,4,8", "--concurrency", help="concurrent streams per level"),
    max_tokens: int = typer.Option(64, "--max-tokens", help="new tokens per request (ignore_eos)"),
    per_client: int = typer.Option(2, "--per-client", help="requests each client sends in turn per level"),
    passes: int = typer.Option(3, "--passes"),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="file with one prompt per line (default: 12 shipped)"),
    prompt_ids: int = typer.Option(0, "--prompt-ids", help="instead, prompts of this many token ids (100..999), new "
                                   "ones for every level of every pass: for models without a real vocabulary (sparkq synth + "
                                   "tools/llamacpp.py)"),
    api_key: Optional[str] = typer.Option(None, "--api-key"),
    as_json: bool = typer.Option(False, "--json"),
    plot: Optional[str] = typer.Option(None, "--plot", help="PNG: aggregate decode tok/s per level and arm"),
):
    """Serving benchmark: aggregate decode tok/s, p50/p95 TTFT and inter-token latency at each
    concurrency, for running servers (sparkq serve, llama-server), interleaved, medians over passes."""
    from sparkq.runtime.measure.servebench import bench as do_bench

    arms = {}
    for a in arm:
        name, eq, rest = a.partition("=")
        if not eq or not rest.startswith("http"):
            _fail(f"--arm {a!r}: use NAME=http://HOST:PORT[@MODEL]")
        url, _, model = rest.partition("@")
        arms[name] = (url, model or name)
    try:
        levels = [int(x) for x in concurrency.split(",")]
    except ValueError:
        _fail(f"--concurrency {concurrency!r}: a comma-separated list of integers")
    if not levels or min(levels) < 1 or max_tokens < 1 or passes < 1 or per_client < 1:
        _fail("--concurrency levels, --max-tokens, --passes and --per-client must be >= 1")
    from importlib.resources import files

    path = Path(prompts) if prompts else files("sparkq.runtime") / "prompts" / "fidelity.txt"
    if not path.is_file():
        _fail(f"--prompts {prompts}: no such file")
    plist = [line for line in path.read_text().splitlines() if line.strip()]
    if prompt_ids > 0:
        from sparkq.runtime.measure.servebench import id_prompts
        # new ids for every level of every pass: no server finds them in its prompt cache
        plist, path = (lambda p, c: id_prompts(16, prompt_ids, seed=1000 * p + c)), f"{prompt_ids} token ids, new per level"

    def progress(r):
        typer.echo(f"  pass {r['pass']} c={r['concurrency']} {r['arm']}: {r['agg_tok_s']:.1f} tok/s, TTFT p50 "
                   f"{r['ttft_p50_s']:.2f} s, ITL p50 {r['itl_p50_ms']:.0f} ms, errors {r['errors']}", err=True)

    try:
        r = do_bench(arms, plist, levels, max_tokens, passes, per_client, api_key, progress)
    except OSError as e:
        _fail(f"a server did not answer ({e}); start it first (sparkq serve MODEL / llama-server)")
    r.update(settings={"concurrency": levels, "max_tokens": max_tokens, "per_client": per_client, "passes": passes,
                       "arms": {k: list(v) for k, v in arms.items()}, "prompts": str(path)})
    if plot:
        _plot(plot, "sparkq bench-serve: aggregate decode", {
            f"{c} streams (tok/s)": {n: r["summary"][n][c]["agg_tok_s"] for n in arms} for c in levels}, "tok/s")
    if as_json:
        typer.echo(json.dumps(r, indent=1))
        return
    typer.echo(R.format_bench_serve(r))
