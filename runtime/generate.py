"""The generate loop both runtimes share: prompt -> tokens -> text, sampling, timing.

A runtime subclasses ``Generator`` and supplies ``check_fits`` and two logits calls (fp32
numpy [vocab]): ``first_logits(ids)`` (the prompt through the model, its K/V cached) and
``next_logits(token, pos)`` (one decode step).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
from sparkq.formats import constants as C

from .errors import RuntimeUserError
from .sampling import Sampler, SamplingParams


@dataclass
class GenStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    drafted: int = 0  # speculative decoding (speculate.py): tokens proposed, accepted, checking passes
    accepted: int = 0
    passes: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first new token comes from prefill; the rest from decode steps
        return (self.new_tokens - 1) / self.decode_s if self.decode_s and self.new_tokens > 1 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(prefill_tok_s=self.prefill_tok_s, decode_tok_s=self.decode_tok_s)
        return d


def check_request(ids, max_new_tokens: int) -> None:
    """(the sampling controls: SamplingParams.check)"""
    if not ids:
        raise RuntimeUserError("empty prompt: give at least one token of text")
    if max_new_tokens < 1:
        raise RuntimeUserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


class Generator:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.last_stats = GenStats()

    def check_fits(self, total_tokens: int) -> None:
        raise NotImplementedError

    def first_logits(self, ids: list[int]) -> np.ndarray:
        raise NotImplementedError

    def next_logits(self, token: int, pos: int) -> np.ndarray:
        raise NotImplementedError

    def prefill_from(self, ids: list[int], pos0: int) -> np.ndarray:
        """Logits of the last of ids when ids[:pos0] are already in the KV cache (a chat's
        history): only ids[pos0:] are computed."""
        raise NotImplementedError

    def state_buffers(self) -> list:
        """a hybrid model's recurrent state buffers (each [slots, ...]; empty for attention only)"""
        state = getattr(self, "state", None)
        if state is None:
            state = getattr(getattr(self, "model", None), "state", None) or []
        return [a for st in state if st for a in st.values()]

    def verify(self, tokens: list[int], pos: int) -> np.ndarray:
        """Logits [n, vocab] of tokens fed at pos, pos + 1, ...: row j the bits ``next_logits``
        gives for tokens[j] after tokens[:j] (speculate.py). Then ``keep(n)`` says how many rows
        stand. This one: a decode step each; a runtime with the C core checks them in one pass."""
        self._verified = (tokens, pos, [a[0].clone() if hasattr(a, "clone") else a[0].copy() for a in self.state_buffers()])
        return np.stack([np.array(self.next_logits(t, pos + j), dtype=np.float32) for j, t in enumerate(tokens)])

    def keep(self, n: int) -> None:
        """Of the last ``verify``'s rows, the first n stand (a recurrent state rewound to them)."""
        tokens, pos, saved = self._verified
        if saved and n < len(tokens):
            for a, c in zip(self.state_buffers(), saved):
                a[0] = c
            for j in range(n):
                self.next_logits(tokens[j], pos + j)

    def drafter(self, draft, threads: int | None = None):
        """``draft``: "ngram", a draft artifact's path, or a drafter (speculate.py); kept per spec"""
        if not isinstance(draft, str):
            return draft
        cache = self.__dict__.setdefault("_drafters", {})
        if draft not in cache:
            from .speculate import drafter
            cache[draft] = drafter(draft, self, threads=threads)
        return cache[draft]

    def resumable(self, n: int, held: int) -> int:
        """Of the first n positions (a prefix of the ``held`` the model last saw, in order), how many
        a next prompt can continue from: all of them, except in a model with recurrent state
        (formats/mixers.py), which holds the whole sequence seen: n only where n is all of it."""
        spec = getattr(self, "spec", None) or getattr(getattr(self, "model", None), "spec", None)
        if spec is None or all(m == C.MIXER_ATTENTION for m in spec.mixers):
            return n
        return n if n == held else 0

    def prompt_ids(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeUserError("this model has no tokenizer.json; pass token ids (stream_ids/logits) instead of text")
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.tokenizer.encode_chat(msgs)
        return self.tokenizer.encode(prompt)

    def stream_ids(self, ids: list[int], max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   seed: int | None = None, stop_ids=None, cached: int = 0, sampling: SamplingParams | None = None,
                   draft=None, draft_tokens: int | None = None):
        """Yields generated token ids; raises before any compute if it cannot fit. ``cached``:
        how many leading ids are already in the KV cache (< len(ids)); each yielded token but the
        last is fed back (its K/V cached at the next position). ``sampling``: every sampling
        control (sampling.py); else temperature, top_p and seed alone. ``draft``: speculative
        decoding ("ngram", a draft artifact, or a drafter: speculate.py), up to ``draft_tokens``
        checked per pass; the same tokens as without it."""
        sampling = sampling or SamplingParams(temperature, top_p, seed=seed)
        check_request(ids, max_new_tokens)
        sampling.check()
        self.check_fits(len(ids) + max_new_tokens)
        stop = (self.tokenizer.stop_ids if self.tokenizer else set()) if stop_ids is None else set(stop_ids)
        sample_next = Sampler(sampling, ids)
        st = self.last_stats = GenStats(prompt_tokens=len(ids) - cached)
        t0 = time.perf_counter()
        draft = None if draft is None else self.drafter(draft)  # (before the prompt: an MTP drafter reads its states)
        first = self.prefill_from(ids, cached) if cached else self.first_logits(ids)
        if draft is not None:  # the drafter reads the prompt too (a draft model prefills it), before the answer
            draft.warm(0, ids)
        tok = sample_next(first)
        st.prefill_s = st.ttft_s = time.perf_counter() - t0
        st.new_tokens = 1
        yield tok
        if draft is not None:
            from .speculate import DEFAULT_DRAFT_TOKENS, decode
            yield from decode(self, draft, int(draft_tokens or DEFAULT_DRAFT_TOKENS), ids, tok, sample_next, stop,
                              max_new_tokens, st)
            return
        pos = len(ids)
        t1 = time.perf_counter()
        while st.new_tokens < max_new_tokens and tok not in stop:
            tok = sample_next(self.next_logits(tok, pos))
            pos += 1
            st.new_tokens += 1
            st.decode_s = time.perf_counter() - t1
            yield tok

    def stream(self, prompt: str, *, chat: bool = False, **kw):
        """Yields text pieces as they become decodable (UTF-8 safe)."""
        ids = self.prompt_ids(prompt, chat)
        out: list[int] = []
        shown = 0
        for t in self.stream_ids(ids, **kw):
            if t in self.tokenizer.stop_ids:
                break
            out.append(t)
            text = self.tokenizer.decode(out)
            if text.endswith("\ufffd"):
                continue
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)

    def generate(self, prompt: str, *, chat: bool = False, **kw) -> dict:
        ids = self.prompt_ids(prompt, chat)
        new = list(self.stream_ids(ids, **kw))
        body = [t for t in new if t not in self.tokenizer.stop_ids]
        return {"text": self.tokenizer.decode(body), "prompt_ids": ids, "token_ids": new,
                "stats": self.last_stats.as_dict()}
