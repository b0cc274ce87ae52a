"""Prefill + decode loop, sampling, text streaming and timing."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

from .errors import RuntimeUserError


@dataclass
class GenStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0

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


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    import torch

    if temperature <= 0:  # numpy: torch's argmax over a vocab runs an OpenMP region, whose threads
        # then spin beside the C core's (two OpenMP runtimes in one process; see README "Threads")
        return int(logits.float().numpy().argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def check_request(ids, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if not ids:
        raise RuntimeUserError("empty prompt: give at least one token of text")
    if max_new_tokens < 1:
        raise RuntimeUserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise RuntimeUserError("temperature must be >= 0 and top_p in (0, 1]")


class Generator:
    """Prompt -> text around a model's ``stream_ids`` (the torch runtime's is below; runtime/lite.py
    overrides it without torch)."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.last_stats = GenStats()

    def prompt_ids(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeUserError("this model has no tokenizer.json; pass token ids (stream_ids/logits) instead of text")
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.tokenizer.encode_chat(msgs)
        return self.tokenizer.encode(prompt)

    def stream_ids(self, ids: list[int], max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   seed: int | None = None, stop_ids=None):
        """Yields generated token ids; raises before any compute if it cannot fit."""
        import torch

        check_request(ids, max_new_tokens, temperature, top_p)
        self.model.check_fits(len(ids) + max_new_tokens)
        stop = (self.tokenizer.stop_ids if self.tokenizer else set()) if stop_ids is None else set(stop_ids)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        st = self.last_stats = GenStats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        logits = self.model.forward(torch.tensor(ids, dtype=torch.int64), 0, last_only=True)[-1]
        tok = sample(logits, temperature, top_p, gen)
        st.prefill_s = st.ttft_s = time.perf_counter() - t0
        st.new_tokens = 1
        yield tok
        pos = len(ids)
        t1 = time.perf_counter()
        buf = torch.empty(1, dtype=torch.int64)
        while st.new_tokens < max_new_tokens and tok not in stop:
            buf[0] = tok
            logits = self.model.forward(buf, pos, last_only=True)[-1]
            pos += 1
            tok = sample(logits, temperature, top_p, gen)
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
