"""The one sampler: ``sparkq generate``, ``chat`` and ``serve`` pick tokens here, so a seed gives the
same tokens in every runtime and command.

Per step, on the model's fp32 logits: ``logit_bias`` (added, OpenAI's), the repetition penalty
(transformers': over the prompt and the tokens so far, a positive logit divided by it, a negative
one multiplied), presence and frequency penalties (OpenAI's: over the generated tokens), an
allowed-token mask (structured output), then greedy at temperature 0, else softmax(logits / T)
restricted by top-k, top-p and min-p (a token kept if its probability is at least min_p times the
largest), drawn with the uniform of the token's own position in the request's random streams (a
seed and the token's index: a token does not depend on how many draws came before it, so
speculative decoding picks the tokens plain decoding would: speculate.py). Log-probabilities, where
asked, are the model's (log-softmax of the raw logits), as OpenAI reports them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import RuntimeUserError


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None

    def check(self, vocab: int | None = None) -> "SamplingParams":
        """One line per bad value, naming it (RuntimeUserError)."""
        if not self.temperature >= 0:
            raise RuntimeUserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RuntimeUserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RuntimeUserError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RuntimeUserError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise RuntimeUserError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RuntimeUserError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for t, b in self.logit_bias.items():
            if vocab is not None and not 0 <= t < vocab:
                raise RuntimeUserError(f"logit_bias names token {t}, outside the vocabulary (0..{vocab - 1})")
            if not -100 <= b <= 100:
                raise RuntimeUserError(f"logit_bias values must be in [-100, 100], got {b} for token {t}")
        return self

    @property
    def plain(self) -> bool:
        """No bias or penalty: the logits are sampled as they are."""
        return not (self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def logprobs(logits: np.ndarray) -> np.ndarray:
    """log-softmax of fp32 logits, in float64"""
    z = logits.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def top_tokens(lp: np.ndarray, k: int) -> np.ndarray:
    """The k most probable tokens of log-probabilities lp, most probable first, ties by lower id
    (``np.argsort(-lp, kind="stable")[:k]``, without sorting the whole vocabulary)."""
    if k <= 0:
        return np.zeros(0, np.int64)
    cand = np.arange(lp.size)
    if k < lp.size:
        kth = lp[np.argpartition(-lp, k - 1)[k - 1]]
        cand = np.flatnonzero(lp >= kth)  # every token tied with the k-th too
    return cand[np.lexsort((cand, -lp[cand]))][:k]


class Sampler:
    """One sequence's sampler: its parameters, generator and the tokens seen so far (for the
    penalties). ``__call__(logits, mask)`` -> token id; ``mask``: bool [vocab], the allowed tokens."""

    def __init__(self, params: SamplingParams, prompt_ids=()):
        self.p = params
        # the streams' root: the seed, else fresh entropy; token n draws from default_rng([root, n])
        self.root = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.n = 0
        self.counts: dict[int, int] = {}  # generated tokens -> times
        self.seen = set(int(t) for t in prompt_ids)  # prompt + generated (the repetition penalty's)

    def accept(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1
        self.seen.add(token)

    def adjusted(self, logits: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        p = self.p
        if p.plain and mask is None:
            return logits
        z = logits.astype(np.float32, copy=True)
        for t, b in p.logit_bias.items():
            z[t] += b
        if p.repetition_penalty != 1 and self.seen:
            idx = np.fromiter(self.seen, dtype=np.int64)
            v = z[idx]
            z[idx] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            idx = np.fromiter(self.counts, dtype=np.int64)
            c = np.fromiter(self.counts.values(), dtype=np.float32)
            z[idx] -= p.presence_penalty + p.frequency_penalty * c
        if mask is not None:
            z[~mask] = -np.inf
        return z

    def __call__(self, logits: np.ndarray, mask: np.ndarray | None = None) -> int:
        if self.p.logit_bias and max(self.p.logit_bias) >= logits.size:
            raise RuntimeUserError(f"logit_bias names token {max(self.p.logit_bias)}, outside the vocabulary "
                                   f"(0..{logits.size - 1})")
        z = self.adjusted(logits, mask)
        tok = choose(z, self.p, np.random.default_rng([self.root, self.n]) if self.p.temperature > 0 else None)
        self.n += 1
        self.accept(tok)
        return tok


def choose(z: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """A token from adjusted logits: greedy at temperature 0, else top-k / top-p / min-p sampling."""
    if p.temperature <= 0:
        return int(np.argmax(z))
    z = z.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < z.size:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z >= kth, z, -np.inf)
    q = np.exp(z - z.max())
    q /= q.sum()
    if p.top_p < 1.0:
        order = np.argsort(-q, kind="stable")
        sq = q[order]
        keep = np.cumsum(sq) - sq < p.top_p
        keep[0] = True
        r = np.zeros_like(q)
        r[order[keep]] = sq[keep]
        q = r / r.sum()
    if p.min_p > 0:
        q = np.where(q >= p.min_p * q.max(), q, 0.0)
        q /= q.sum()
    return int(rng.choice(q.size, p=q))
