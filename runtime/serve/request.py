"""One generation as the engine (engine.py) runs it: the caller's prompt, limits and sampling, the
server's per-choice fields, and the engine's state."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import SamplingParams


@dataclass
class Request:
    """One generation: prompt ids, limits (max_tokens 0: the prompt alone) and sampling;
    ``emit(event: dict)`` receives {"delta": text} pieces and one {"finish": reason,
    "prompt_tokens", "completion_tokens"}."""
    ids: list[int]
    max_tokens: int
    emit: object
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # run to max_tokens through stop tokens (benchmarks)
    sampling: SamplingParams | None = None  # every sampling control (else temperature, top_p, seed)
    logprobs: int | None = None  # emit each token's log-probability and this many alternatives
    split: object = None  # the server's reasoning splitter (chat replies)
    constraint: object = None  # a grammar's per-sequence matcher (structured.py): the allowed tokens
    tool: object = None  # the server's tool-call parsing of this reply (tools.py)
    index: int = 0  # the server's choice index within its response
    echo: str | None = None  # the server's echoed prompt text (completions' echo)
    # emit the prompt's own log-probabilities (completions' echo) with this many alternatives: one
    # {"prompt_logprob"} event per prompt token as it is prefilled (the first: no logprob); the
    # prompt is then prefilled whole (no kept prefix)
    echo_logprobs: int | None = None
    # engine state
    cancelled: bool = False
    done: bool = False
    slot: int = -1
    filled: int = 0  # prompt tokens in the cache
    new: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the decoded text already emitted
    sampler: object = None
    t_submit: float = 0.0
    t_last: float = 0.0
    t_first: float = 0.0
    cached: int = 0  # prompt tokens whose K/V the slot already held (the prefix cache)
    draft_ctl: object = None  # speculative decoding: how many tokens to draft (speculate.DraftLength)


def new_text(r: Request, out: str, last: bool = False) -> str | None:
    """The text of r to emit now, given its whole decoded text ``out`` (None: r hit a stop string:
    the text before it went out, r is finished): held back while it ends in a partial UTF-8
    character or could be the start of a stop string, unless ``last``."""
    if r.stop:
        hit = [i for i in (out.find(s, max(0, r.sent - len(s) + 1)) for s in r.stop) if i >= 0]
        if hit:
            cut = min(hit)
            if cut > r.sent:
                r.emit({"delta": out[r.sent:cut]})
            r.sent = cut
            return None
    if out.endswith("\ufffd") and not last:
        return ""
    end = len(out)
    if r.stop and not last:  # hold back a tail that may begin a stop string
        for s in r.stop:
            for k in range(min(len(s) - 1, end - r.sent), 0, -1):
                if out.endswith(s[:k]):
                    end = min(end, len(out) - k)
                    break
    piece = out[r.sent:end]
    r.sent = max(r.sent, end)
    return piece


def run_one(engine, ids: list[int], max_tokens: int | None = None, **kw) -> dict:
    """Submit one request and wait for its end: {"ids", "text", "finish", ...} (from any thread)."""
    import threading

    done = threading.Event()
    out = {"text": "", "finish": None}

    def emit(ev):
        if "delta" in ev:
            out["text"] += ev["delta"]
        elif "logprob" in ev:
            out.setdefault("logprobs", []).append(ev["logprob"])
        else:
            out.update(ev)
            done.set()

    r = engine.submit(Request(list(ids), max_tokens, emit, **kw))
    done.wait()
    if "error" in out:
        raise RuntimeError(out["error"])
    out["ids"] = list(r.new)
    return out
