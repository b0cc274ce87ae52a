"""Continuous batching over one model (``sparkq serve``): requests in fixed KV slots, one decode
step for every running sequence per pass over the weights.

The KV budget is split into ``parallel`` fixed slots (lite.py: each slot a whole sequence's
cache, budget / parallel bytes); a request takes a free slot or waits in a bounded queue. The
engine thread loops: admit waiting requests into free slots; prefill one chunk of the oldest
unfinished prompt (so a long prompt never stalls running streams for more than a chunk); one
decode step for every sequence past its prompt (``Session.step_many``: the decode products for M =
running sequences, each row at its own position and slot). A row's logits are the bits the
single-sequence decode step gives, and a prompt is always cut into the same slices, so a
request's tokens do not depend on what else runs (batch invariance, tested).

Results leave through each request's ``emit`` callback (called on the engine thread): text
deltas (UTF-8 safe, held back while they could be the start of a stop string), then one final
event with the finish reason (``stop``: a stop token or string; ``length``: max_tokens or the
slot's end) and the token counts. ``cancel`` (a client that went away) frees the slot before the
next step.

Prefix cache: a slot keeps the prompt it last prefilled. A newcomer takes the free slot whose
kept prompt shares the longest prefix with its own (else the least recently used one) and
prefills only the rest, at least its last token; where another slot holds a longer prefix, those
positions are copied from it (prefix.py): n choices, a shared system prompt are prefilled once.
Only prompt-path positions are reused (the decode steps' products sum in another order), and the
prompt path gives the same bits whole or continued from any position (tested), so a reused prefix
changes no bit of the answer; where the prompt GEMM depends on the slice length (AVX512-BF16) the
reuse is cut to whole slices. With a prompt cache on disk (promptcache.py) a prompt's positions
also go to a file when it is prefilled, and a newcomer starts from the longest prefix a file holds
where that is longer than any slot's (files written by an earlier process). With a drafter (speculate.py) a sequence's step has its drafted
tokens as extra rows: the same tokens, fewer passes.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from ..errors import RuntimeUserError
from ..sampling import Sampler, SamplingParams, logprobs, top_tokens
from ..speculate import drafts_for
from .prefix import PrefixReuse, Snapshots
from .request import Request, new_text, run_one

# prompt tokens per prefill slice between decode steps: at the Qwen2.5-1.5B shape on 2 cores a
# 64-token slice is ~0.5 s, the longest a running stream waits for a newcomer's prompt
PREFILL_SLICE = 64
REFINE_EXACT = 64  # a grammar's best allowed tokens whose logits are recomputed exactly (_refined)


class QueueFull(Exception):
    pass


class Engine(PrefixReuse):
    """Continuous batching over a LiteModel loaded with ``slots = parallel``."""

    def __init__(self, model, *, max_queue: int = 64, prefill_slice: int = PREFILL_SLICE, prefix_cache: bool = True,
                 batch_tiles: int = 0, draft=None, draft_tokens: int = 8, disk=None):
        self.model, self.session, self.tok = model, model.session, model.tokenizer
        # speculative decoding (speculate.py): a drafter (its sequences keyed by slot), tokens per pass
        self.draft, self.draft_tokens = draft, int(draft_tokens)
        self.session.set_batch_tiles(batch_tiles)  # opt-in: steps of >= batch_tiles sequences on AMX tiles
        self.parallel = model.slots
        self.slot_cap = min(model.cap, model.max_model_len)  # positions per sequence
        self.max_queue, self.prefill_slice = max_queue, int(prefill_slice)
        self.stop_ids = set(self.tok.stop_ids) if self.tok else set()
        self.session.reserve_batch(self.parallel)
        self.free = list(range(self.parallel))[::-1]
        # the prefix cache: per slot the prompt ids whose K/V it holds and how many (prompt-path
        # positions only), the step it was last taken; reuse in whole slices where the prompt
        # GEMM's bits depend on the slice length
        self.prefix_cache = bool(prefix_cache)
        self.kept: list[tuple[list[int], int]] = [([], 0)] * self.parallel
        self.last_used, self.tick = [0] * self.parallel, 0
        self.reuse_grid = self.prefill_slice if self.session.lib.sq_prefill_bf16() else 1
        # a hybrid model's recurrent states at slice boundaries: a prefix is reused up to one of them
        # the prompt cache on disk: PromptCache's options (directory, max_bytes, ...) or None
        from ..promptcache import PromptCache
        self.disk = PromptCache(model=model, tag=f"slice{self.reuse_grid}", **disk) if disk and prefix_cache else None
        self.snaps = Snapshots(model, milestone=self.disk.milestone if self.disk else 0) if any(model.state) else None
        from ..core import build_name
        self.build = build_name(self.session.lib)  # the C-core build (/health; bench-serve reports it)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in a slot: prefilling (filled < len(ids)) or decoding
        self.cv = threading.Condition()
        self.closed = False
        self.error: BaseException | None = None
        self.metrics = None  # the server's hooks (metrics.py): token(r), finished(r)
        self.stats = {"steps": 0, "max_batch": 0, "decoded": 0, "prefilled": 0, "cached": 0, "completed": 0,
                      "cancelled": 0, "drafted": 0, "accepted": 0}
        self.thread = threading.Thread(target=self._loop, name="sparkq-engine", daemon=True)
        self.thread.start()

    # -- the caller's side (any thread) --

    def check(self, n_prompt: int, max_tokens: int | None, zero: bool = False) -> int:
        """The max_tokens a request of n_prompt tokens gets (None: up to the slot's end; 0 only
        with ``zero``: the prompt alone, for its log-probabilities); raises RuntimeUserError naming
        the limit when it cannot fit."""
        if n_prompt < 1:
            raise RuntimeUserError("empty prompt: give at least one token of text")
        if n_prompt >= self.slot_cap:
            raise RuntimeUserError(f"the prompt is {n_prompt} tokens; this server's context is {self.slot_cap} tokens "
                                   "per sequence (prompt + completion): shorten it, or restart with a larger "
                                   "--kv-budget-mib or a smaller --parallel")
        room = self.slot_cap - n_prompt
        if max_tokens is None:
            return room
        if max_tokens < (0 if zero else 1):
            raise RuntimeUserError(f"max_tokens must be >= {0 if zero else 1}, got {max_tokens}")
        if max_tokens > room:
            raise RuntimeUserError(f"the prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceed this server's "
                                   f"context of {self.slot_cap} tokens per sequence; lower max_tokens to at most {room}")
        return max_tokens

    def submit(self, req: Request) -> Request:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[Request]) -> list[Request]:
        """Queue requests together (a request's n choices or prompts): all of them, or none
        (QueueFull when the free slots and the queue's room cannot take them all now;
        RuntimeUserError when they never could)."""
        if len(reqs) > self.parallel + self.max_queue:
            raise RuntimeUserError(f"this request asks for {len(reqs)} sequences; this server holds at most "
                                   f"{self.parallel + self.max_queue} at once (--parallel {self.parallel} + --max-queue "
                                   f"{self.max_queue}): ask for fewer (n x prompts)")
        for req in reqs:
            req.max_tokens = self.check(len(req.ids), req.max_tokens, zero=True)  # 0: the prompt alone
            req.sampler = Sampler(req.sampling or SamplingParams(req.temperature, req.top_p, seed=req.seed), req.ids)
            req.t_submit = time.perf_counter()
        with self.cv:
            if self.closed:
                raise QueueFull("the server is shutting down")
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error}")
            room = self.max_queue - len(self.waiting) + len(self.free)
            if len(reqs) > room:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting for one of {self.parallel} slots"
                                + (f" (this request asks for {len(reqs)} sequences)" if len(reqs) > 1 else ""))
            self.waiting.extend(reqs)
            self.cv.notify()
        return reqs

    def cancel(self, req: Request) -> None:
        with self.cv:
            req.cancelled = True
            self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout=30)
        if self.disk is not None:
            self.disk.close()  # the queued writes finish

    def load(self) -> dict:
        with self.cv:
            return {"running": len(self.running), "waiting": len(self.waiting), "slots": self.parallel,
                    "slot_tokens": self.slot_cap, "build": self.build, "batch_tiles": self.session.tiles[0],
                    **({"state_bytes": self.model.state_nbytes, "snapshot_bytes": self.snaps.bytes}  # hybrids
                       if self.snaps is not None else {}),
                    **({"prompt_cache": dict(self.disk.stats)} if self.disk is not None else {}), **self.stats}

    # -- the engine thread --

    def _finish(self, r: Request, reason: str) -> None:
        """(under the lock) the request leaves its slot; the final event goes out"""
        if r.done:
            return
        r.done = True
        if r in self.running:
            self.running.remove(r)
        if r.slot >= 0:
            self.free.append(r.slot)
            r.slot = -1
        if reason == "cancelled":
            self.stats["cancelled"] += 1
            return
        self.stats["completed"] += 1
        if self.metrics is not None:
            self.metrics.finished(r)
        r.emit({"finish": reason, "prompt_tokens": len(r.ids), "completion_tokens": len(r.new), "cached_tokens": r.cached})

    def _admit(self) -> None:
        for r in [r for r in self.running if r.cancelled]:
            self._finish(r, "cancelled")
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            self.stats["cancelled"] += 1
        while self.waiting and self.free:
            r = self.waiting.popleft()
            reuse = {k: self._reusable(k, r.ids) if r.echo_logprobs is None else 0 for k in self.free}
            best = max(self.free, key=lambda k: (reuse[k], -self.last_used[k]))  # else the least recently used
            self.free.remove(best)
            r.slot, r.cached = best, reuse[best]
            r.filled = r.cached
            self.kept[best] = (r.ids, r.cached)  # the positions past it are about to be rewritten
            if self.snaps is not None:  # the state where the prompt continues
                self.snaps.resume(best, r.cached)
            self.tick += 1
            self.last_used[best] = self.tick
            self.stats["cached"] += r.cached
            self.running.append(r)

    def _text(self, r: Request, last: bool = False) -> str | None:
        """The new text of r to emit (None: r hit a stop string, finished here)."""
        return new_text(r, self.tok.decode([t for t in r.new if t not in self.stop_ids]), last)

    def _sample(self, r: Request, logits: np.ndarray, xn=None) -> None:
        """(engine thread, under the lock) r's next token from its logits row (xn: a function giving
        the row's final-normed hidden state, for a grammar's exact logits)"""
        if r.constraint is not None:  # the grammar's allowed tokens only (the rest -inf before sampling)
            mask = r.constraint.mask()
            token = r.sampler(self._refined(logits, mask, xn), mask)
            r.constraint.consume(token)
        else:
            token = r.sampler(logits)
        if r.logprobs is not None:  # the model's log-probabilities (the raw logits'), as OpenAI reports them
            lp = logprobs(logits)
            top = top_tokens(lp, r.logprobs or 0)
            r.emit({"logprob": {"id": token, "logprob": float(lp[token]),
                                "top": [(int(t), float(lp[t])) for t in top]}})
        self._accept(r, token)
        if r.constraint is not None and r.constraint.done and not r.done:  # (even with ignore_eos)
            self._accept_end(r)

    def _prompt_logprobs(self, r: Request, a: int, b: int, xn: np.ndarray) -> list[dict]:
        """(engine thread) the log-probabilities of prompt tokens a + 1 .. b (each from the logits
        of the one before it, hidden states xn of a..b-1), the first token's entry without one"""
        out = [{"id": r.ids[0], "logprob": None, "top": None}] if a == 0 else []
        n = min(b, len(r.ids) - 1) - a  # rows whose next token is in the prompt
        if n > 0:
            for i, row in enumerate(self.session.head_many(xn[:n])):
                lp = logprobs(row)
                t = r.ids[a + i + 1]
                top = top_tokens(lp, r.echo_logprobs)
                out.append({"id": t, "logprob": float(lp[t]), "top": [(int(k), float(lp[k])) for k in top]})
        return out

    def _refined(self, logits: np.ndarray, mask: np.ndarray, xn) -> np.ndarray:
        """The head refines its top candidates exactly (both planes of a split head); where a grammar
        masks out the best of them, the REFINE_EXACT best allowed tokens are recomputed exactly here
        (the same bits for those the head already refined)."""
        if xn is None or mask[int(np.argmax(logits))]:  # the head's own best token is allowed: its exact
            return logits  # top candidates are among the allowed, the rest approximate as unconstrained
        allowed = np.flatnonzero(mask)
        if not allowed.size:
            return logits
        k = min(REFINE_EXACT, allowed.size)
        cand = allowed[np.argpartition(-logits[allowed], k - 1)[:k]] if allowed.size > k else allowed
        out = logits.copy()
        out[cand] = self.session.head_exact(xn(), cand)
        return out

    def _accept_end(self, r: Request) -> None:
        """a constrained reply whose grammar is complete: its held-back text out, then the end"""
        piece = self._text(r, last=True)
        if piece:
            r.emit({"delta": piece})
        self._finish(r, "stop")

    def _accept(self, r: Request, token: int) -> None:
        """(engine thread, under the lock) a sampled token of r: emit its text, finish r if done"""
        r.new.append(token)
        if not r.t_first:
            r.t_first = time.perf_counter()
        if self.metrics is not None:
            self.metrics.token(r)
        stop_tok = token in self.stop_ids and not r.ignore_eos
        at_end = len(r.new) >= r.max_tokens or len(r.ids) + len(r.new) >= self.slot_cap
        piece = self._text(r, last=stop_tok or at_end)
        if piece is None:
            return self._finish(r, "stop")
        if piece:
            r.emit({"delta": piece})
        if stop_tok:
            self._finish(r, "stop")
        elif at_end:
            self._finish(r, "length")

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # the engine must not die silently: fail every request
            with self.cv:
                self.error = e
                for r in list(self.running) + list(self.waiting):
                    r.done = True
                    r.emit({"error": f"the engine failed: {e.__class__.__name__}: {e}"})
                self.running.clear()
                self.waiting.clear()

    def _run(self) -> None:
        s = self.session
        while True:
            with self.cv:
                self._admit()
                while not self.running and not self.closed:
                    self.cv.wait()
                    self._admit()
                if self.closed:
                    return
                pre = next((r for r in self.running if r.filled < len(r.ids)), None)
                dec = [r for r in self.running if r.filled == len(r.ids) and r.new]
            if pre is not None:  # one slice of the oldest unfinished prompt
                if self.prefix_cache and pre.filled == pre.cached and pre.echo_logprobs is None:
                    if self.disk is not None:
                        self._from_disk(pre)
                    self._share(pre)
                a = pre.filled  # slices end at multiples of the slice (prefix copies and snapshots line up)
                b = min(len(pre.ids), (a // self.prefill_slice + 1) * self.prefill_slice)
                echo = pre.echo_logprobs is not None
                xn = s.prefill(pre.ids[a:b], a, last_only=not echo, kvoff=pre.slot * self.model.slot_elems,
                               chunk=self.prefill_slice)
                # the last row's hidden state is the same bits either way (sq_prefill), its logits
                # from the one-row head as without echo
                logits = s.head_many(xn[-1:]) if b == len(pre.ids) else None
                plps = self._prompt_logprobs(pre, a, b, xn) if echo and not pre.cancelled else []
                if self.snaps is not None and self.prefix_cache and pre.slot >= 0:
                    self.snaps.take(pre.slot, b)
                if self.disk is not None and b == len(pre.ids) and not echo and pre.slot >= 0:
                    self.disk.save(pre.ids, b, pre.slot, self.snaps.at[pre.slot] if self.snaps is not None else None)
                if self.draft is not None and b == len(pre.ids) and pre.slot >= 0:
                    self.draft.warm(pre.slot, pre.ids)  # the drafter's prompt (a draft model prefills it) now
                with self.cv:
                    pre.filled = b
                    if pre.slot >= 0:
                        self.kept[pre.slot] = (pre.ids, b)
                    self.stats["prefilled"] += b - a
                    if not pre.cancelled:
                        for ev in plps:
                            pre.emit({"prompt_logprob": ev})
                    if logits is not None and not pre.cancelled:
                        if pre.max_tokens == 0:
                            self._finish(pre, "length")
                        else:
                            self._sample(pre, logits[0], lambda xn=xn: xn[-1])
            if dec:
                self._decode(dec)

    def _decode(self, dec: list[Request]) -> None:
        """(engine thread) one step for every decoding sequence: its last token, and its drafted
        tokens after it where a drafter is on (rows of one slot: each accepted while it is the token
        the row before picks; the rest rewound: speculate.py)"""
        s = self.session
        drafts = drafts_for(self.draft, dec, self.draft_tokens, self.slot_cap) if self.draft else [[]] * len(dec)
        toks, pos, offs = [], [], []
        for r, d in zip(dec, drafts):
            p0 = len(r.ids) + len(r.new) - 1
            toks += [r.new[-1]] + d
            pos += range(p0, p0 + 1 + len(d))
            offs += [r.slot * self.model.slot_elems] * (1 + len(d))
        logits = s.step_many(toks, pos, offs, rewind=self.draft is not None)
        with self.cv:
            st, i = self.stats, 0
            st["steps"], st["decoded"], st["max_batch"] = st["steps"] + 1, st["decoded"] + len(dec), max(st["max_batch"], len(dec))
            for r, d in zip(dec, drafts):
                used = hits = 0
                for j in range(1 + len(d)):
                    if r.cancelled or r.done:
                        break
                    self._sample(r, logits[i + j], lambda k=i + j: s.batch_xn(k))
                    used += 1
                    if j == len(d) or r.new[-1] != d[j]:
                        break
                    hits += 1
                if d:
                    s.rewind(offs[i], max(1, used))
                    r.draft_ctl.observe(len(d), hits)
                    st["drafted"], st["accepted"] = st["drafted"] + len(d), st["accepted"] + hits
                i += 1 + len(d)

    # -- a blocking helper (tests, scripts) --

    def generate(self, ids: list[int], max_tokens: int | None = None, **kw) -> dict:
        """Run one request to its end: {"ids", "text", "finish"} (from any thread: request.run_one)."""
        return run_one(self, ids, max_tokens, **kw)
