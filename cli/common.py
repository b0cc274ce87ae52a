"""What every command shares: the two typer apps, the one-line failure (``error: ...``, exit 2),
the options generate / chat / serve share, and the library calls' adapters."""
from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

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


def _kv(kv_dtype: str | None) -> dict:
    """--kv-dtype as a load keyword (absent: the runtime's default, common.DEFAULT_KV_DTYPE)"""
    return {} if kv_dtype is None else {"kv_dtype": kv_dtype}


def open_model(model: str, runtime: str, prefill: str, **kw):
    """sparkq.runtime.open_model with its errors as the CLI's one line"""
    from sparkq.runtime.opening import open_model as do_open

    return _run(do_open, model, runtime, prefill, **kw)


def check_draft(draft: str | None, draft_tokens: int) -> dict:
    """--draft / --draft-tokens as stream keywords (checked)"""
    if not 1 <= draft_tokens <= 32:
        _fail(f"--draft-tokens must be in 1..32, got {draft_tokens}")
    return {} if draft is None else {"draft": draft, "draft_tokens": draft_tokens}


def artifact_layout(model: str) -> str | None:
    from sparkq.runtime.opening import artifact_layout as layout

    return layout(model)


# the sampling and memory options generate and chat share
OPT_TEMPERATURE = typer.Option(0.0, "--temperature", help="0 = greedy")
OPT_TOP_P = typer.Option(1.0, "--top-p")
OPT_SEED = typer.Option(None, "--seed")
OPT_MAX_MODEL_LEN = typer.Option(None, "--max-model-len", help="default: min(2048, max_position_embeddings)")
OPT_KV_BUDGET = typer.Option(192, "--kv-budget-mib")
OPT_KV_DTYPE = typer.Option(None, "--kv-dtype", help="KV cache: int8 (the default: int8 K/V rows with a bf16 scale per "
                            "position and KV head, ~0.52x bf16's bytes, so ~1.9x the positions per budget) or bf16")
OPT_THREADS = typer.Option(None, "--threads", help="a fixed thread count (default: the physical cores, fewer while "
                           "other programs take cores, back when they free them)")
OPT_TOP_K = typer.Option(0, "--top-k", help="sample among the k most probable tokens (0: off)")
OPT_MIN_P = typer.Option(0.0, "--min-p", help="drop tokens under min_p x the most probable one's probability")
OPT_REP = typer.Option(1.0, "--repetition-penalty", help="> 1 discourages tokens of the prompt and the answer so far")
OPT_PRESENCE = typer.Option(0.0, "--presence-penalty", help="subtracted from the logit of every token generated so far")
OPT_FREQUENCY = typer.Option(0.0, "--frequency-penalty", help="subtracted per occurrence of a generated token")
OPT_DRAFT = typer.Option(None, "--draft", help="speculative decoding, the same output: ngram (repeats of the prompt "
                         "and answer so far), mtp (the model's multi-token-prediction block, Qwen3.5) or a draft "
                         "artifact with the same tokenizer (a smaller model)")
OPT_DRAFT_TOKENS = typer.Option(8, "--draft-tokens", help="the most drafted tokens checked per pass (adapts below it)")
OPT_PROMPT_CACHE = typer.Option(None, "--prompt-cache", help="a directory for a prompt cache on disk: the KV cache "
                                 "of prompts of 256+ tokens is kept there, and a later run (after a restart too) "
                                 "reads a shared prefix back instead of prefilling it (the same answer bits)")
OPT_PROMPT_CACHE_MIB = typer.Option(4096, "--prompt-cache-mib", help="the prompt cache directory's bound (least "
                                    "recently used files go first)")
OPT_THINK = typer.Option(None, "--think/--no-think", help="with a chat template: its thinking switch "
                         "(enable_thinking; SmolLM3, Qwen3); default: the template's")


def sampling_params(temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed):
    """The sampler's parameters (runtime/sampling.py), one line per bad value"""
    from sparkq.runtime.sampling import SamplingParams

    return _run(SamplingParams(temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
                               repetition_penalty, seed=seed).check)


def prompt_cache_opts(directory: str | None, mib: float) -> dict | None:
    """--prompt-cache / --prompt-cache-mib as PromptCache's options (runtime/promptcache.py)"""
    if directory is None:
        return None
    if mib <= 0:
        _fail(f"--prompt-cache-mib must be > 0, got {mib}")
    return {"directory": directory, "max_bytes": int(mib * (1 << 20))}


def set_thinking(m, think: bool | None) -> None:
    if think is not None and m.tokenizer is not None:
        m.tokenizer.template_kwargs = {**m.tokenizer.template_kwargs, "enable_thinking": think}

def _rss_mib() -> dict:
    from sparkq.runtime.procmem import rss_kib
    return {k: v / 1024 for k, v in rss_kib().items()}


def _runtime(m) -> str:
    return "lite" if "lite" in m.info.extra.get("decode_path", "") else "torch"


def _governor(m):
    """The C calls' thread governor of a loaded model (runtime/core/threads.py), None without the C core"""
    s = getattr(m, "session", None) or getattr(getattr(m, "model", None), "fast", None)
    return getattr(s, "gov", None)


def _threads_low(m) -> int | None:
    """The fewest threads the C calls ran on (other programs held cores), None where never fewer"""
    g = _governor(m)
    return g.low if g is not None and g.low < g.max else None


def _threads(m) -> int:
    """The loaded model's thread count (the torch-free runtime records its own; torch's otherwise)."""
    if "threads" in m.info.extra:
        return m.info.extra["threads"]
    import torch
    return torch.get_num_threads()
