"""Console entry points: ``spark-convert`` and ``sparkq`` (typer). What they print is in render.py.

Every user-facing failure is one line on stderr (``error: ...``) and exit code 2. ``pip install
sparkq`` gives the torch-free runtime (``sparkq generate`` of rows32 artifacts, inspect, verify,
upload); conversion and the torch runtime need ``pip install 'sparkq[convert]'``.
"""
from __future__ import annotations

import json
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Optional

import typer

from . import render as R

convert_app = typer.Typer(add_completion=False, help="Convert a bf16 HF checkpoint, Hub repo id or GGUF file into a sparkq int4 artifact.")
app = typer.Typer(add_completion=False, no_args_is_help=True, help="sparkq: run small LLMs on CPUs with little RAM.")


def _user_errors():
    from sparkq.formats import ArtifactError, LayoutError, SpecError
    from sparkq.runtime.errors import RuntimeUserError
    errs = [ArtifactError, LayoutError, SpecError, RuntimeUserError, R.PlotUnavailable]
    if find_spec("torch") is not None:
        from sparkq.convert.errors import ConvertError
        errs.append(ConvertError)
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


def have_torch() -> bool:
    return find_spec("torch") is not None


def _need_convert_extra(what: str, modules=("torch", "gguf")) -> None:
    missing = [m for m in modules if find_spec(m) is None]
    if missing:
        _fail(f"{what} needs {' and '.join(missing)}: pip install 'sparkq[convert]' "
              "(install torch==2.13.0 first for the CPU build)")


def _prefill_mode(v: str) -> bool | None:
    from sparkq.runtime.options import PREFILL_MODES

    if v not in PREFILL_MODES:
        _fail(f"--prefill {v!r}: use one of {', '.join(PREFILL_MODES)}")
    return PREFILL_MODES[v]


def _save(target: str, kind: str, result: dict) -> None:
    """Store a measurement inside the artifact (measurements/KIND.json) for its model card."""
    import os

    d = Path(target)
    if not (d / "sparkq.json").is_file():
        _fail(f"--save needs a local artifact directory, not {target!r}")
    (d / "measurements").mkdir(exist_ok=True)
    tmp = d / "measurements" / f".{kind}.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, d / "measurements" / f"{kind}.json")


def _plot(path: str, title: str, groups: dict, ylabel: str) -> None:
    _run(R.plot, path, title, groups, ylabel)


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
                                                   key_scaling, head_rows))
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


@app.command()
def inspect(artifact: str, as_json: bool = typer.Option(False, "--json")):
    """Layout, group sizes, bytes per role, bits per weight, tied or not, source."""
    from sparkq.formats import Artifact

    s = _run(lambda: Artifact.open(artifact).summary())
    typer.echo(json.dumps(s, indent=1) if as_json else R.inspect_summary(s))


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
    typer.echo(f"ok: {len(art.manifest.tensors)} tensors verified ({R.mib(size)})")


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
               R.table([("repo", f"{u['repo']}@{u['revision']}"), ("variant", f"{u['variant']}/ ({', '.join(u['variants'])} in repo)"),
                       ("commit", u["commit"]), ("message", u["commit_message"]), ("files", str(u["files"]))]))


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


def _rows32_artifact(model: str) -> bool | None:
    """True/False for a local artifact (rows32 or not), None for anything else (a Hub repo id, a
    bf16 checkpoint, a missing path: the loaders say what it is)."""
    m = Path(model) / "sparkq.json"
    if not m.is_file():
        return None
    try:
        from sparkq.formats.layout import ROWS32
        return json.loads(m.read_text()).get("layout") == ROWS32
    except (ValueError, OSError, AttributeError):
        return None


def _kv(kv_dtype: str | None) -> dict:
    """--kv-dtype as a load keyword (absent: the runtime's default, common.DEFAULT_KV_DTYPE)"""
    return {} if kv_dtype is None else {"kv_dtype": kv_dtype}


def _open(model: str, runtime: str, prefill: str, **kw):
    """The model on the runtime ``generate`` picks: the torch-free one for rows32 artifacts (and Hub
    repos, which it fetches the rows32 variant of), the torch runtime for torch's int4 layouts,
    bf16 checkpoints, ``--torch`` or ``--prefill kernel|dequant``."""
    from sparkq.runtime.errors import RuntimeUserError

    if runtime == "auto":
        rows32 = _rows32_artifact(model)
        bf16_dir = rows32 is None and (Path(model) / "config.json").is_file()
        runtime = "torch" if prefill != "auto" or rows32 is False or bf16_dir else "lite"
        # a Hub repo without a rows32 variant, or no C compiler here: the torch runtime where installed
        fallback = have_torch() and not bf16_dir
    else:
        fallback = False
    if runtime == "lite":
        if prefill != "auto":
            _fail("--prefill applies to the torch runtime (--torch); the torch-free runtime's prompts go through the C prefill")
        from sparkq.runtime import load_lite
        try:
            return load_lite(model, **kw)
        except RuntimeUserError as e:
            if not fallback:
                _fail(str(e))
    if not have_torch():
        what = "a bf16 checkpoint" if (Path(model) / "config.json").is_file() and _rows32_artifact(model) is None \
            else "an artifact in torch's int4 layout" if _rows32_artifact(model) is False else "the torch runtime"
        _fail(f"{model} needs the torch runtime ({what}): pip install 'sparkq[convert]' (torch==2.13.0 first)")
    from sparkq.runtime import load
    return _run(load, model, prefill_dequant=_prefill_mode(prefill), **kw)


# the sampling and memory options generate and chat share
OPT_TEMPERATURE = typer.Option(0.0, "--temperature", help="0 = greedy")
OPT_TOP_P = typer.Option(1.0, "--top-p")
OPT_SEED = typer.Option(None, "--seed")
OPT_MAX_MODEL_LEN = typer.Option(None, "--max-model-len", help="default: min(2048, max_position_embeddings)")
OPT_KV_BUDGET = typer.Option(192, "--kv-budget-mib")
OPT_KV_DTYPE = typer.Option(None, "--kv-dtype", help="KV cache: int8 (the default: int8 K/V rows with a bf16 scale per "
                            "position and KV head, ~0.52x bf16's bytes, so ~1.9x the positions per budget) or bf16")
OPT_THREADS = typer.Option(None, "--threads")


@app.command()
def generate(
    model: str = typer.Argument(..., help="artifact dir, Hub repo id org/name[@revision], or a bf16 HF checkpoint dir"),
    prompt: str = typer.Argument(...),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = OPT_TEMPERATURE,
    top_p: float = OPT_TOP_P,
    seed: Optional[int] = OPT_SEED,
    max_model_len: Optional[int] = OPT_MAX_MODEL_LEN,
    kv_budget_mib: float = OPT_KV_BUDGET,
    kv_dtype: Optional[str] = OPT_KV_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    prefill: str = typer.Option("auto", "--prefill", help="torch runtime: prompt products of int4 linears above 64 "
                                "rows: auto (the C W4A8 GEMM where it applies, else dequantize), kernel, or dequant"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (text, token ids, stats)"),
    lite: bool = typer.Option(False, "--lite", help="the torch-free runtime (the default for rows32 artifacts)"),
    use_torch: bool = typer.Option(False, "--torch", help="the torch runtime (the default for torch's int4 layouts "
                                   "and bf16 checkpoints; needs sparkq[convert])"),
):
    """Generate text; streams tokens, then prints one stats line."""
    if lite and use_torch:
        _fail("--lite and --torch exclude each other")
    m = _open(model, "lite" if lite else "torch" if use_torch else "auto", prefill,
              max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads, **_kv(kv_dtype))
    hub = m.info.extra.get("hub")
    if hub and not as_json:
        typer.echo(f"[hub {hub['repo']} revision {hub['revision']} variant {hub['variant']}]", err=True)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    if as_json:
        r = _run(m.generate, prompt, chat=chat, **kw)
        r["stats"].update(load_s=m.info.load_seconds, kv_capacity=m.info.kv_capacity, layout=m.info.layout, hub=hub,
                          threads=_threads(m), rss_mib=_rss_mib(), runtime=_runtime(m))
        typer.echo(json.dumps(r))
        return

    def run_stream():
        for piece in m.stream(prompt, chat=chat, **kw):
            sys.stdout.write(piece)
            sys.stdout.flush()

    _run(run_stream)
    typer.echo("\n" + R.generate_stats(m, _rss_mib(), _threads(m)), err=True)


@app.command()
def chat(
    model: str = typer.Argument(..., help="artifact dir, Hub repo id org/name[@revision], or a bf16 HF checkpoint dir"),
    system: Optional[str] = typer.Option(None, "--system", help="a system message for the conversation"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="per answer (and at most what the cache has left)"),
    temperature: float = OPT_TEMPERATURE,
    top_p: float = OPT_TOP_P,
    seed: Optional[int] = OPT_SEED,
    max_model_len: Optional[int] = OPT_MAX_MODEL_LEN,
    kv_budget_mib: float = OPT_KV_BUDGET,
    kv_dtype: Optional[str] = OPT_KV_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    lite: bool = typer.Option(False, "--lite", help="the torch-free runtime (the default for rows32 artifacts)"),
    use_torch: bool = typer.Option(False, "--torch", help="the torch runtime"),
):
    """Chat in the terminal: the chat template, streamed answers, the history kept in the KV cache
    (a turn prefills only its new tokens). /reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops
    an answer."""
    from sparkq.runtime.chat import ChatSession
    from sparkq.runtime.errors import RuntimeUserError

    if lite and use_torch:
        _fail("--lite and --torch exclude each other")
    m = _open(model, "lite" if lite else "torch" if use_torch else "auto", "auto",
              max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads, **_kv(kv_dtype))
    session = _run(ChatSession, m, system, temperature=temperature, top_p=top_p, seed=seed)
    import signal
    # Ctrl-C stops an answer even where SIGINT came in ignored (a shell's background job): Python
    # then installs no KeyboardInterrupt handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    typer.echo(f"sparkq chat: {model} ({_runtime(m)}, KV cache {session.capacity()} tokens). "
               "/reset starts over, /exit quits, Ctrl-C stops an answer.", err=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            typer.echo("", err=True)
            return
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            typer.echo("", err=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            typer.echo("[conversation reset]", err=True)
            continue
        pieces = session.turn(text, max_new_tokens=max_new_tokens)
        try:
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pieces.close()
            session.last["interrupted"] = True
        except RuntimeUserError as e:
            typer.echo(f"error: {e}", err=True)
            continue
        st = session.last
        typer.echo(("\n[stopped] " if st["interrupted"] else "\n") +
                   f"[{st['new_tokens']} tokens; prefilled {st['prefilled']} of {st['prompt_tokens']}]", err=True)


@app.command()
def serve(
    model: str = typer.Argument(..., help="a rows32 artifact dir or Hub repo id org/name[@revision]"),
    host: str = typer.Option("127.0.0.1", "--host", help="the address to bind (loopback by default)"),
    port: int = typer.Option(8080, "--port"),
    parallel: int = typer.Option(4, "--parallel", help="sequences decoded together (KV slots; the budget is split "
                                 "evenly between them)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPARKQ_API_KEY",
                                          help="require Authorization: Bearer KEY on /v1"),
    kv_budget_mib: float = OPT_KV_BUDGET,
    kv_dtype: Optional[str] = OPT_KV_DTYPE,
    max_model_len: Optional[int] = OPT_MAX_MODEL_LEN,
    threads: Optional[int] = OPT_THREADS,
    model_name: Optional[str] = typer.Option(None, "--model-name", help="the id clients send as 'model' "
                                             "(default: the directory's name or the repo id)"),
    max_queue: int = typer.Option(64, "--max-queue", help="requests that may wait for a slot; more get HTTP 429"),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache",
                                      help="a request whose prompt begins like the one a free slot last held "
                                      "prefills only the rest (the same answer bits either way)"),
):
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health) that
    decodes concurrent requests together, one pass over the weights per step."""
    if parallel < 1 or parallel > 64:
        _fail(f"--parallel must be in 1..64, got {parallel}")
    if max_queue < 0:
        _fail(f"--max-queue must be >= 0, got {max_queue}")
    if _rows32_artifact(model) is False:
        _fail(f"{model}: sparkq serve runs rows32 artifacts (torch-free); convert with --target rows32")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        _fail("sparkq serve needs starlette and uvicorn: pip install 'sparkq[serve]'")
    from sparkq.runtime.server import serve as run_server

    _run(run_server, model, host=host, port=port, parallel=parallel, api_key=api_key, kv_budget_mib=kv_budget_mib,
         max_model_len=max_model_len, threads=threads, model_name=model_name, max_queue=max_queue,
         prefix_cache=prefix_cache, echo=lambda s: typer.echo(s, err=True), **_kv(kv_dtype))


def _rss_mib() -> dict:
    from sparkq.runtime.procmem import rss_kib
    return {k: v / 1024 for k, v in rss_kib().items()}


def _runtime(m) -> str:
    return "lite" if "lite" in m.info.extra.get("decode_path", "") else "torch"


def _threads(m) -> int:
    """The loaded model's thread count (the torch-free runtime records its own; torch's otherwise)."""
    if "threads" in m.info.extra:
        return m.info.extra["threads"]
    import torch
    return torch.get_num_threads()


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
    from sparkq.runtime.memory import run

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
    from sparkq.runtime.fidelity import fidelity as do_fidelity

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
    from sparkq.runtime.bench import bench as do_bench

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
    from sparkq.runtime.servebench import bench as do_bench

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
        from sparkq.runtime.servebench import id_prompts
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


@app.command()
def synth(
    out_dir: str,
    shape: str = typer.Option("qwen3-1.7b", "--shape", help="qwen3-1.7b | spark-x2.5-1.7b | smollm2-135m"),
    seed: int = typer.Option(0, "--seed"),
    force: bool = typer.Option(False, "--force"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Write a random-weight bf16 checkpoint of a real model shape (tied)."""
    _need_convert_extra("sparkq synth", ("torch",))
    from sparkq.convert.synth import synth as do_synth

    r = _run(do_synth, shape, out_dir, seed, force, not as_json)
    typer.echo(json.dumps(r, indent=1) if as_json else R.table([(k, str(v)) for k, v in r.items()]))

def convert_main():  # console script: spark-convert
    convert_app()


def sparkq_main():  # console script: sparkq
    app()
