"""A conversation over one model's KV cache (``sparkq chat``).

Each turn renders the whole history with the model's chat template and prefills only the tokens
after the longest prefix already in the cache, so a new turn costs its own tokens, not the
history's. A turn stopped early (Ctrl-C) keeps what it generated; the cache is trusted only up to
the last token that was certainly fed back. With a prompt cache on disk (promptcache.py) a
conversation's first turn starts from the longest prefix a file holds (a system prompt read back
after a restart) and its prompt, all of it prompt-path positions, goes to a file."""
from __future__ import annotations

import numpy as np

from .errors import RuntimeUserError


def common_prefix(a, b) -> int:
    """How many leading token ids two sequences (lists or arrays) share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class ChatSession:
    def __init__(self, gen, system: str | None = None, disk: dict | None = None, **sampling):
        if gen.tokenizer is None:
            raise RuntimeUserError("this model has no tokenizer.json: chat needs its tokenizer and chat template")
        self.disk = None
        if disk:
            if not hasattr(gen, "art") or not hasattr(gen, "session"):
                raise RuntimeUserError("--prompt-cache runs on the torch-free runtime: give a rows32 artifact "
                                       "(without --torch)")
            from .promptcache import PromptCache
            from .serve.engine import PREFILL_SLICE
            # the server's slices where the prompt GEMM's bits depend on them: chat and serve share files
            self.grid = PREFILL_SLICE if gen.session.lib.sq_prefill_bf16() else 1
            if self.grid > 1:
                gen.session.prefill_chunk = self.grid
            self.disk = PromptCache(model=gen, tag=f"slice{self.grid}", **disk)
        from .sampling import SamplingParams

        (sampling.get("sampling") or SamplingParams(sampling.get("temperature", 0.0), sampling.get("top_p", 1.0))).check()
        self.gen, self.system, self.sampling = gen, system, sampling
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.cached: list[int] = []  # the tokens whose K/V are in the cache, from position 0
        self.last = {"prompt_tokens": 0, "prefilled": 0, "new_tokens": 0, "interrupted": False}

    def capacity(self) -> int:
        info = self.gen.info
        return min(info.kv_capacity, info.max_model_len)

    def turn(self, text: str, max_new_tokens: int = 512):
        """Yields the answer's text pieces as they decode; the answer joins the history at the end
        (also when the caller stops early: KeyboardInterrupt inside, or closing the generator)."""
        tok = self.gen.tokenizer
        msgs = self.messages + [{"role": "user", "content": text}]
        ids = tok.encode_chat(msgs)
        room = self.capacity() - len(ids)
        if room < 1:
            raise RuntimeUserError(f"the conversation is {len(ids)} tokens, the KV cache holds {self.capacity()}: "
                                   "/reset, or raise --kv-budget-mib / --max-model-len")
        fresh = not self.cached  # the first turn: every position it prefills is a prompt-path one
        if fresh and self.disk is not None:
            n, e = self.disk.lookup(ids, self.grid)
            if n and self.disk.restore(e, n, 0):
                self.cached = ids[:n]
        # (a hybrid model's recurrent state continues only from where it stands: the whole history)
        reuse = self.gen.resumable(min(common_prefix(self.cached, ids), len(ids) - 1), len(self.cached))
        new: list[int] = []
        shown, out = 0, ""
        self.last = {"prompt_tokens": len(ids), "prefilled": len(ids) - reuse, "new_tokens": 0, "interrupted": False,
                     "from_disk": reuse if fresh else 0}
        answered = False  # the turn joins the history: it ran, or was stopped
        try:
            for t in self.gen.stream_ids(ids, max_new_tokens=min(max_new_tokens, room), cached=reuse,
                                         **self.sampling):
                new.append(t)
                # the prompt's K/V (and state) is in: prompt-path positions (its last one too, unless it
                # was a single token's decode step)
                if fresh and len(new) == 1 and self.disk is not None and len(ids) - reuse > 1:
                    states = [b[0].copy() for b in self.gen.state_buffers()]
                    self.disk.save(ids, len(ids), 0, {len(ids): states} if states else None)
                if t in tok.stop_ids:
                    break
                out = tok.decode([x for x in new if x not in tok.stop_ids])
                if out.endswith("\ufffd"):
                    continue
                if len(out) > shown:
                    yield out[shown:]
                    shown = len(out)
            answered = True
        except KeyboardInterrupt:  # inside a product: the answer so far stays
            answered = self.last["interrupted"] = True
        except GeneratorExit:  # the caller stopped reading (its own Ctrl-C)
            answered = True
            raise
        finally:
            # every yielded token but the last was fed back; before the first, the prefill may not
            # have finished: only the prefix reused from the last turn is certain then
            self.cached = ids + new[:-1] if new else ids[:reuse]
            self.last["new_tokens"] = len(new)
            if answered or new:
                self.messages = msgs + [{"role": "assistant", "content": out}]

    def close(self) -> None:
        """(at exit) the prompt cache's queued write finishes"""
        if self.disk is not None:
            self.disk.close()
