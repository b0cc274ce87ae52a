"""Speculative decoding: a drafter guesses a sequence's next tokens, one pass over the weights checks
them all (the batched step's rows for the sequence's consecutive positions: Session.step_many), and
the output is the one decoding without a draft gives.

Each checked row's logits are the bits the single decode step gives at that position (csrc/batch.c),
and the sampler draws each token from its own position's random stream (sampling.py), so the token
the model picks at a position does not depend on whether, or what, was drafted there. A row's token
is picked as without a draft; the draft is accepted while it equals the picked token, and the first
picked token that differs ends the pass (it is the correction, the "bonus" token). For a drafter
whose proposal is one token with certainty (n-gram lookup, a greedy draft model) this is the standard
rule (accept d with probability min(1, p(d) / q(d)) = p(d), else draw from p without d), with one
uniform per position shared by both draws: greedy and seeded sampled outputs are identical, token
for token, to decoding without a draft. The rows past the accepted ones leave nothing behind: their
K/V are written again before they are read, and a hybrid model's recurrent state is rewound
(Session.rewind).

Drafters: ``NgramDrafter`` (the longest recent n-gram of the prompt and output so far that occurred
before, and what followed it: no second model), ``ModelDrafter`` (a smaller artifact with the
same vocabulary, greedy, its KV slots beside the target's) and the model's own multi-token-prediction
block (mtp.py). ``DraftLength`` adapts how many tokens
to draft from the acceptance so far (never from timings: a seed reproduces a run).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .chat import common_prefix
from .errors import RuntimeUserError

DEFAULT_DRAFT_TOKENS = 8  # --draft-tokens: the most tokens drafted for one pass
NGRAM_MAX, NGRAM_MIN = 4, 2  # the n-gram lookup's match lengths, longest tried first
MAX_PAUSE = 32  # the longest run of tokens decoded without a draft after drafts keep failing
# a drafted row's cost in the checking pass, in single steps: Qwen2.5-Coder-1.5B 1.21x / 1.36x / 2.01x /
# 3.27x for 2 / 3 / 5 / 9 rows, the example 1.11x / 1.36x / 2.28x / 3.64x (docs/performance.md
# "Speculation": python tools/specbench.py ART --row-cost)
ROW_COST = 0.25
MIN_GAIN = 1.03  # draft only where the expected tokens per cost beat a plain step by this much
DECAY = 0.8  # per pass, of the acceptance counts
GIVE_UP = 3  # a draft model's failed probes in a row after which a sequence drafts no more
CATCH_UP_ROWS = 8  # a draft model's tokens to take before drafting: as step rows up to this many, else a prompt


@dataclass
class DraftLength:
    """How many tokens to draft for one sequence's next pass: the k that maximizes the expected tokens
    per pass, (1 - a^(k+1)) / (1 - a) for a per-token acceptance a, over the pass's cost, 1 + k (ROW_COST
    + ``draft_cost``) target passes; none where no k beats a plain step, then a probe after ``pause``
    tokens (doubling up to MAX_PAUSE), so a drafter that keeps failing costs almost nothing. ``a`` is
    counted from the sequence's drafts (decaying), never from timings: a seed reproduces a run."""
    kmax: int = DEFAULT_DRAFT_TOKENS
    draft_cost: float = 0.0  # a drafted token's cost in target passes (a draft model: its bytes per step / the target's)
    hits: float = 1.4  # decaying counts of accepted drafted tokens and of trials (prior: a = 0.7)
    trials: float = 2.0
    give_up: int = 0  # after this many failed probes in a row, no more drafts (0: never; a draft model's catch-up costs)
    pause: int = 0
    wait: int = 0
    probing: bool = False
    failed: int = 0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0

    def best(self, batch: int = 1) -> int:
        """the k that maximizes tokens per cost of the pass, which holds ``batch`` sequences: the
        others' batch - 1 tokens and a pass of 1 + ROW_COST (batch - 1), plus this one's"""
        a = min(self.hits / self.trials, 0.999)
        per, others, base = ROW_COST + self.draft_cost, batch - 1, 1 + ROW_COST * (batch - 1)
        rate = [(others + (1 - a ** (k + 1)) / (1 - a)) / (base + per * k) for k in range(self.kmax + 1)]
        k = max(range(self.kmax + 1), key=rate.__getitem__)
        return k if rate[k] >= MIN_GAIN * rate[0] else 0

    @classmethod
    def of(cls, kmax: int, draft) -> "DraftLength":
        return cls(kmax, getattr(draft, "cost", 0.0), give_up=getattr(draft, "give_up", 0))

    def next(self, room: int, batch: int = 1) -> int:
        """tokens to draft now (room: the most the sequence can still take; batch: the sequences
        the pass holds)"""
        if self.give_up and self.failed >= self.give_up:
            return 0
        if self.wait > 0:
            self.wait -= 1
            if self.wait:
                return 0
            self.probing = True  # the pause's last token: a probe
            return max(0, min(2, self.kmax, room))
        k = self.best(batch)
        if k == 0:
            self.pause = min(MAX_PAUSE, max(2, 2 * self.pause))
            self.wait = self.pause
        else:
            self.pause = 0
        return max(0, min(k, room))

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.hits = DECAY * self.hits + accepted
        self.trials = DECAY * self.trials + accepted + (accepted < drafted)
        if self.probing:  # a probe fails unless what it saw makes drafting pay
            self.probing = False
            self.failed = 0 if self.best() else self.failed + 1


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n
    tokens (n = NGRAM_MAX .. NGRAM_MIN, longest first), anywhere in its prompt and output. An index
    per sequence (n-gram -> where it last ended) grows with the tokens."""
    name = "ngram"

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN):
        self.n_max, self.n_min = n_max, n_min
        self.index: dict = {}  # key -> (ids indexed so far, {ngram: end})

    def _indexed(self, key, ids: list[int]) -> dict:
        seen, table = self.index.get(key, (None, None))
        if seen is None or len(seen) > len(ids) or seen != ids[:len(seen)]:  # another sequence in this key
            seen, table = [], {}
        for end in range(len(seen) + 1, len(ids)):  # every n-gram ending before the last token
            for n in range(self.n_min, self.n_max + 1):
                if end >= n:
                    table[tuple(ids[end - n:end])] = end
        self.index[key] = (list(ids[:-1]) if len(ids) > 1 else [], table)
        return table

    def propose(self, key, ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(ids) <= self.n_min:
            return []
        table = self._indexed(key, ids)
        for n in range(min(self.n_max, len(ids) - 1), self.n_min - 1, -1):
            end = table.get(tuple(ids[-n:]))
            if end is not None:
                return list(ids[end:end + k])
        return []

    def propose_many(self, asks: list[tuple]) -> list[list[int]]:
        """asks: (key, ids, k) per sequence"""
        return [self.propose(key, ids, k) for key, ids, k in asks]

    def warm(self, key, ids: list[int]) -> None:
        """(a prompt, before its answer) index it now"""
        self._indexed(key, list(ids) + [-1])


@dataclass
class _Fed:
    ids: list[int] = field(default_factory=list)  # the tokens whose K/V (and state) the draft's slot holds
    snap: object = None  # a hybrid draft's state copy at position snap_at
    snap_at: int = -1


class ModelDrafter:
    """A draft model (a LiteModel with as many KV slots as the target's sequences) proposing its
    greedy continuation: per pass, each sequence's draft slot catches up with the tokens it has not
    seen (a few as rows of the first draft step, more through the prompt path), then k batched draft
    steps. A hybrid draft's state is copied where the accepted tokens may end, and restored when
    fewer were accepted than it saw."""
    name = "model"

    def __init__(self, draft, target_tokenizer, target_vocab: int, cost: float = 0.0):
        check_vocab(draft, target_tokenizer)
        self.m, self.s, self.limit = draft, draft.session, target_vocab  # (ids past the target's rows: no draft)
        self.cost = cost  # a draft step's cost in target steps (DraftLength)
        self.give_up = GIVE_UP  # a probe catches the draft up on the tokens it skipped: not for ever
        self.fed = [_Fed() for _ in range(draft.slots)]
        self.hybrid = bool(draft.state_buffers())
        self.cap = min(draft.cap, draft.max_model_len)

    def _snap(self, f: _Fed, slot: int) -> None:
        """a hybrid draft slot's state copied where a pass resumes (into its buffers of the last pass)"""
        f.snap = f.snap or [np.empty_like(a[slot]) for a in self.m.state_buffers()]
        for a, c in zip(self.m.state_buffers(), f.snap):
            np.copyto(c, a[slot])
        f.snap_at = len(f.ids)

    def _restore(self, slot: int, snap) -> None:
        for a, c in zip(self.m.state_buffers(), snap):
            a[slot] = c

    def warm(self, slot: int, ids: list[int]) -> None:
        """(a prompt, while the target prefills it) the draft's slot takes it now, not in the first pass"""
        if len(ids) < self.cap:
            self._catch_up(slot, list(ids) + [-1], rows=0)

    def _catch_up(self, slot: int, ids: list[int], rows: int = CATCH_UP_ROWS) -> list[int]:
        """The tokens of ids the slot has yet to take, ids[-1] last: a tail of up to ``rows`` of them
        as rows of the first draft step (the decode path's bits, as the model's own steps), a longer
        one through the prompt path first."""
        f = self.fed[slot]
        c = common_prefix(f.ids, ids[:-1])
        if self.hybrid and c < len(f.ids):  # the state holds more than the shared prefix: back to a copy
            if f.snap is not None and f.snap_at <= c:
                self._restore(slot, f.snap)
                c = f.snap_at
            else:
                c = 0
        f.ids = ids[:c]
        if len(ids) - 1 - c > rows:
            self.s.prefill(ids[c:-1], c, kvoff=slot * self.m.slot_elems)
            f.ids, c = ids[:-1], len(ids) - 1
        return ids[c:]

    def propose_many(self, asks: list[tuple]) -> list[list[int]]:
        """asks: (slot, ids, k) per sequence; each sequence's k greedy draft tokens after ids"""
        asks = [(slot, ids, min(k, self.cap - len(ids))) for slot, ids, k in asks]
        out = {slot: [] for slot, _, _ in asks}
        live = [(slot, ids, k) for slot, ids, k in asks if k > 0]
        feed = {slot: self._catch_up(slot, ids) for slot, ids, _ in live}  # each slot's rows of the first step
        while live:
            toks, pos, offs, last = [], [], [], []
            for slot, ids, _ in live:
                f = self.fed[slot]
                toks += feed[slot]
                pos += range(len(f.ids), len(f.ids) + len(feed[slot]))
                offs += [slot * self.m.slot_elems] * len(feed[slot])
                last.append(len(toks) - 1)
            logits = self.s.step_many(toks, pos, offs)
            for (slot, ids, k), i in zip(live, last):
                f = self.fed[slot]
                f.ids = f.ids + feed[slot]
                if self.hybrid and len(f.ids) == len(ids):  # the state after the context: where a pass resumes
                    self._snap(f, slot)
                out[slot].append(int(np.argmax(logits[i])))
                feed[slot] = out[slot][-1:]
            live = [a for a in live if len(out[a[0]]) < a[2]]
        return [_below(out[slot], self.limit) for slot, _, _ in asks]


def _below(d: list[int], limit: int) -> list[int]:
    """the draft up to its first id outside the target's embedding (a padded head's row)"""
    for i, t in enumerate(d):
        if t >= limit:
            return d[:i]
    return d


def check_vocab(draft, target_tokenizer) -> None:
    """A draft model must spell tokens as the target does: the same tokenizer vocabulary."""
    dt = draft.tokenizer
    if dt is None or target_tokenizer is None:
        raise RuntimeUserError("a draft model needs a tokenizer.json beside both models, to check they share a vocabulary")
    a, b = dt.tok.get_vocab(with_added_tokens=True), target_tokenizer.tok.get_vocab(with_added_tokens=True)
    if a != b:
        only = len(set(a.items()) ^ set(b.items()))
        raise RuntimeUserError(f"the draft model's vocabulary differs from the model's ({len(a)} vs {len(b)} tokens, "
                               f"{only} entries differ); use a draft of the same family and tokenizer, or --draft ngram")


def drafter(spec: str, target, *, slots: int = 1, threads: int | None = None, kv_dtype: str | None = None):
    """``ngram``, ``mtp`` (the artifact's MTP block) or a draft artifact's path / Hub id (loaded on the
    torch-free runtime, ``slots`` sequences) -> a drafter for ``target`` (a Generator)."""
    if spec == "ngram":
        return NgramDrafter()
    if spec == "mtp":  # the model's own multi-token-prediction block (runtime/mtp.py)
        from .mtp import mtp_drafter
        return mtp_drafter(target, slots=slots, threads=threads)
    from .common import DEFAULT_KV_DTYPE
    from .lite import load as load_lite
    from pathlib import Path

    from sparkq.formats import Artifact, ArtifactError
    from sparkq.formats.mixers import state_bytes

    from .common import kv_bytes_per_token, resolve
    try:
        dspec = Artifact.open(Path(resolve(spec, layouts=["rows32"])[0])).spec
    except ArtifactError as e:
        raise RuntimeUserError(f"--draft {spec}: {e}; pass ngram or a sparkq artifact") from None
    kv = kv_dtype or DEFAULT_KV_DTYPE
    n = min(target.capacity, dspec.max_position)  # the draft's cache holds as many positions as the target's
    budget = (n * kv_bytes_per_token(dspec, kv) + state_bytes(dspec)) * slots / 2**20 + 1
    d = load_lite(spec, max_model_len=n, slots=slots, kv_budget_mib=budget, kv_dtype=kv, threads=threads)
    mine, theirs = step_bytes(d), step_bytes(target)
    return ModelDrafter(d, target.tokenizer, (getattr(target, "spec", None) or target.model.spec).vocab,
                        mine / theirs if theirs else 0.5)


def step_bytes(gen) -> int:
    """the bytes of weights one decode step of a loaded model reads (0: unknown, a bf16 checkpoint)"""
    from .common import decode_read_bytes
    t = getattr(gen, "tensors", None) or {}
    return sum(decode_read_bytes(k, int(v.nbytes), int(v.shape[0])) for k, v in t.items()
               if len(v.shape) and not k.startswith("mtp."))  # (an MTP block is read by its drafter only)


def drafts_for(draft, reqs: list, kmax: int, cap: int) -> list[list[int]]:
    """(the server's engine) each decoding request's draft for this step, its DraftLength kept on it
    (``draft_ctl``); a request in its slot: the slot keys the drafter's sequence"""
    asks = []
    for r in reqs:
        ctl = r.draft_ctl = getattr(r, "draft_ctl", None) or DraftLength.of(kmax, draft)
        n = len(r.ids) + len(r.new)
        asks.append((r.slot, r.ids + r.new, ctl.next(min(r.max_tokens - len(r.new), cap - n) - 1, len(reqs))))
    return draft.propose_many(asks)


def decode(gen, draft, kmax: int, ids: list[int], tok: int, sample_next, stop: set, max_new: int, st):
    """(Generator.stream_ids) the tokens after the first one, ``tok``, checked ``kmax`` at most per
    pass: yields each token as decoding without a draft would; ``st`` (GenStats) counts them."""
    import time

    ctl = DraftLength.of(kmax, draft)
    out = list(ids) + [tok]
    pos = len(ids)
    cap = gen.capacity
    t1 = time.perf_counter()
    while st.new_tokens < max_new and tok not in stop:
        room = min(max_new - st.new_tokens - 1, cap - pos - 1)
        d = draft.propose_many([(0, out, ctl.next(room))])[0][:max(0, room)]
        rows = [tok] + d
        logits = gen.verify(rows, pos)
        used = hits = 0
        try:
            for j in range(len(rows)):
                tok = sample_next(logits[j])
                used += 1
                hits += j < len(d) and tok == d[j]
                out.append(tok)
                st.new_tokens += 1
                st.decode_s = time.perf_counter() - t1
                yield tok
                if j == len(d) or tok != d[j] or tok in stop or st.new_tokens >= max_new:
                    break
        finally:
            gen.keep(max(1, used))  # rows 0..used-1 were fed: tok, then the accepted drafts
            ctl.observe(len(d), hits)
            st.drafted, st.accepted, st.passes = ctl.drafted, ctl.accepted, st.passes + 1
        pos += used
