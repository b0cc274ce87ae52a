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
