"""Running a model: sparkq generate, chat, serve."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from . import render as R
from .common import (OPT_DRAFT, OPT_DRAFT_TOKENS, OPT_FREQUENCY, OPT_KV_BUDGET, OPT_KV_DTYPE, OPT_MAX_MODEL_LEN, OPT_MIN_P, OPT_PRESENCE, OPT_REP,
                     OPT_PROMPT_CACHE, OPT_PROMPT_CACHE_MIB, OPT_SEED, OPT_TEMPERATURE, OPT_THINK, OPT_THREADS, OPT_TOP_K,
                     OPT_TOP_P, app, prompt_cache_opts, sampling_params, set_thinking)
from .common import (_fail, _kv, _need_convert_extra, _plot, _prefill_mode, _rss_mib, _run, _runtime, _save,  # noqa: F401
                     _threads, _threads_low, artifact_layout, check_draft, open_model)


@app.command()
def generate(
    model: str = typer.Argument(..., help="artifact dir, Hub repo id org/name[@revision], or a bf16 HF checkpoint dir"),
    prompt: str = typer.Argument(...),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = OPT_TEMPERATURE,
    top_p: float = OPT_TOP_P,
    top_k: int = OPT_TOP_K,
    min_p: float = OPT_MIN_P,
    repetition_penalty: float = OPT_REP,
    presence_penalty: float = OPT_PRESENCE,
    frequency_penalty: float = OPT_FREQUENCY,
    seed: Optional[int] = OPT_SEED,
    max_model_len: Optional[int] = OPT_MAX_MODEL_LEN,
    kv_budget_mib: float = OPT_KV_BUDGET,
    kv_dtype: Optional[str] = OPT_KV_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    think: Optional[bool] = OPT_THINK,
    draft: Optional[str] = OPT_DRAFT,
    draft_tokens: int = OPT_DRAFT_TOKENS,
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
    m = open_model(model, "lite" if lite else "torch" if use_torch else "auto", prefill,
              max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads, **_kv(kv_dtype))
    set_thinking(m, think)
    spec = check_draft(draft, draft_tokens)
    if spec:
        spec["draft"] = _run(m.drafter, draft, threads)
    hub = m.info.extra.get("hub")
    if hub and not as_json:
        typer.echo(f"[hub {hub['repo']} revision {hub['revision']} variant {hub['variant']}]", err=True)
    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling_params(
        temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed), **spec)
    if as_json:
        r = _run(m.generate, prompt, chat=chat, **kw)
        r["stats"].update(load_s=m.info.load_seconds, kv_capacity=m.info.kv_capacity, layout=m.info.layout, hub=hub,
                          threads=_threads(m), threads_low=_threads_low(m), rss_mib=_rss_mib(), runtime=_runtime(m))
        typer.echo(json.dumps(r))
        return

    def run_stream():
        for piece in m.stream(prompt, chat=chat, **kw):
            sys.stdout.write(piece)
            sys.stdout.flush()

    _run(run_stream)
    low = _threads_low(m)
    typer.echo("\n" + R.generate_stats(m, _rss_mib(), f"{_threads(m)}" + (f" (down to {low} while other programs held "
                                                                        "cores)" if low else "")), err=True)


@app.command()
def chat(
    model: str = typer.Argument(..., help="artifact dir, Hub repo id org/name[@revision], or a bf16 HF checkpoint dir"),
    system: Optional[str] = typer.Option(None, "--system", help="a system message for the conversation"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="per answer (and at most what the cache has left)"),
    temperature: float = OPT_TEMPERATURE,
    top_p: float = OPT_TOP_P,
    top_k: int = OPT_TOP_K,
    min_p: float = OPT_MIN_P,
    repetition_penalty: float = OPT_REP,
    presence_penalty: float = OPT_PRESENCE,
    frequency_penalty: float = OPT_FREQUENCY,
    seed: Optional[int] = OPT_SEED,
    max_model_len: Optional[int] = OPT_MAX_MODEL_LEN,
    kv_budget_mib: float = OPT_KV_BUDGET,
    kv_dtype: Optional[str] = OPT_KV_DTYPE,
    threads: Optional[int] = OPT_THREADS,
    think: Optional[bool] = OPT_THINK,
    draft: Optional[str] = OPT_DRAFT,
    draft_tokens: int = OPT_DRAFT_TOKENS,
    prompt_cache: Optional[str] = OPT_PROMPT_CACHE,
    prompt_cache_mib: float = OPT_PROMPT_CACHE_MIB,
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
    m = open_model(model, "lite" if lite else "torch" if use_torch else "auto", "auto",
              max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads, **_kv(kv_dtype))
    set_thinking(m, think)
    spec = check_draft(draft, draft_tokens)
    if spec:
        spec["draft"] = _run(m.drafter, draft, threads)
    session = _run(ChatSession, m, system, sampling=sampling_params(
        temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed),
        disk=prompt_cache_opts(prompt_cache, prompt_cache_mib), **spec)
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
            return session.close()
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            typer.echo("", err=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return session.close()
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
                   f"[{st['new_tokens']} tokens; prefilled {st['prefilled']} of {st['prompt_tokens']}"
                   + (f"; {st['from_disk']} read from the prompt cache" if st.get("from_disk") else "")
                   + (f"; drafted {m.last_stats.drafted}, accepted {m.last_stats.accepted}" if spec else "") + "]", err=True)


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
    cors_origin: list[str] = typer.Option([], "--cors-origin", help="let a web app on this origin call the API "
                                          "(e.g. http://localhost:3000; repeatable, * for any)"),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache",
                                      help="a request whose prompt begins like the one a free slot last held "
                                      "prefills only the rest (the same answer bits either way)"),
    batch_tiles: bool = typer.Option(False, "--batch-tiles/--no-batch-tiles",
                                     help="Intel Xeon with AMX (amx build): steps of 16+ sequences run their int4/lut4 "
                                     "products on int8 tiles with 15-bit activations, faster there and more exact, "
                                     "but a reply's bits then depend on how many sequences ran beside it "
                                     "(docs/serving.md \"Tiles\")"),
    draft: Optional[str] = OPT_DRAFT,
    draft_tokens: int = OPT_DRAFT_TOKENS,
    prompt_cache: Optional[str] = OPT_PROMPT_CACHE,
    prompt_cache_mib: float = OPT_PROMPT_CACHE_MIB,
):
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics; a chat page at /) that
    decodes concurrent requests together, one pass over the weights per step."""
    if parallel < 1 or parallel > 64:
        _fail(f"--parallel must be in 1..64, got {parallel}")
    if max_queue < 0:
        _fail(f"--max-queue must be >= 0, got {max_queue}")
    if artifact_layout(model) not in (None, "rows32"):
        _fail(f"{model}: sparkq serve runs rows32 artifacts (torch-free); convert with --target rows32")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        _fail("sparkq serve needs starlette and uvicorn: pip install 'sparkq[serve]'")
    from sparkq.runtime.serve.server import serve as run_server

    spec = check_draft(draft, draft_tokens)
    if prompt_cache and not prefix_cache:
        _fail("--prompt-cache reuses prompt prefixes, which --no-prefix-cache turns off: drop one of them")
    _run(run_server, model, host=host, port=port, parallel=parallel, api_key=api_key, kv_budget_mib=kv_budget_mib,
         max_model_len=max_model_len, threads=threads, model_name=model_name, max_queue=max_queue,
         prefix_cache=prefix_cache, echo=lambda s: typer.echo(s, err=True), cors_origins=tuple(cors_origin),
         batch_tiles=batch_tiles, prompt_cache=prompt_cache_opts(prompt_cache, prompt_cache_mib), **spec, **_kv(kv_dtype))


@app.command()
def embed(
    model: str = typer.Argument(..., help="a rows32 artifact dir, Hub repo id org/name[@revision], or a bf16 HF checkpoint dir"),
    texts: list[str] = typer.Argument(..., help="texts to embed (a query's instruction prefix is part of its text)"),
    dimensions: Optional[int] = typer.Option(None, "--dimensions", help="Matryoshka: keep the first N, re-normalized"),
    as_json: bool = typer.Option(False, "--json", help="print the full vectors as JSON"),
    kv_budget_mib: float = OPT_KV_BUDGET,
    kv_dtype: Optional[str] = OPT_KV_DTYPE,
    max_model_len: Optional[int] = OPT_MAX_MODEL_LEN,
    threads: Optional[int] = OPT_THREADS,
):
    """Embeddings of texts (the pooling the model's sentence-transformers files name, else the last token;
    docs/serving.md "Embeddings and rerank"): a table of dims and norms, or --json the vectors."""
    import numpy as np

    from sparkq.runtime.embedding import Embedder, encode, pool, shaped

    m = open_model(model, "auto", "auto", max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads,
                   **_kv(kv_dtype))
    e = _run(Embedder, m)
    hidden = e.session.spec.hidden
    if dimensions is not None and not 1 <= dimensions <= hidden:
        _fail(f"--dimensions must be in 1..{hidden}, got {dimensions}")
    rows = []
    for t in texts:
        if not t:
            _fail("an empty text: give at least one character")
        ids = encode(e.tok, t)
        raw = pool(_run(e.hidden, ids), e.pooling.mode)
        rows.append((t, len(ids), float(np.linalg.norm(raw)), shaped(raw, dimensions, e.pooling.normalize)))
    if as_json:
        typer.echo(json.dumps([{"text": t, "tokens": n, "embedding": v.tolist()} for t, n, _, v in rows]))
        return
    typer.echo(f"pooling: {e.pooling.mode}{', normalized' if e.pooling.normalize else ''} "
               f"({'sentence-transformers files' if e.pooling.embedding_model else 'default: no sentence-transformers files'})")
    typer.echo(f"{'#':>3} {'tokens':>6} {'dims':>5} {'pooled norm':>11} {'norm':>6}  first values / text")
    for i, (t, n, raw_norm, v) in enumerate(rows):
        head = " ".join(f"{x:+.4f}" for x in v[:4])
        typer.echo(f"{i:>3} {n:>6} {v.size:>5} {raw_norm:>11.4f} {float(np.linalg.norm(v)):>6.4f}  {head}  {t[:40]!r}")
