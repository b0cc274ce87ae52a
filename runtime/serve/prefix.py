"""The engine's prefix cache (engine.py): how much of a prompt a slot's kept prompt-path positions
already hold, copying such positions from one slot to another, a hybrid model's state copies
(Snapshots), and the engine's side of it (PrefixReuse: a slot's, another slot's, a file's prefix)."""
from __future__ import annotations

import numpy as np

from ..chat import common_prefix
from ..promptcache import kv_views


def shared_prefix(have: list[int], n: int, ids: list[int], grid: int) -> int:
    """Prompt tokens of ids among the first n of have (a slot's prompt, n of its positions written
    by the prompt path), cut to whole slices of grid tokens; never the last one of ids (its logits
    start the answer)."""
    n = min(n, len(ids) - 1)
    return common_prefix(have[:n], ids[:n]) // grid * grid if n > 0 else 0


def copy_positions(model, src: int, dst: int, a: int, b: int) -> None:
    """positions a..b-1 of KV slot src into slot dst, in every layer (K, V and an int8 cache's scales)"""
    for d, s in zip(kv_views(model, dst, b, a).values(), kv_views(model, src, b, a).values()):
        d[...] = s


SNAPSHOTS = 4  # per slot: a hybrid model's recurrent states kept at slice boundaries (the latest ones)


class Snapshots:
    """A hybrid model's recurrent state per slot at the prompt path's slice boundaries.

    A KV cache can be cut back to any prefix; a recurrent state (formats/mixers.py) holds the whole
    sequence seen so far and cannot. So the engine copies a slot's state after each prompt slice
    (``take``), reuses a prefix only up to a position it holds a copy for (``best``) and starts
    there from that copy (``restore``, also into another slot: a prompt copy). The latest
    ``SNAPSHOTS`` per slot are kept: ``bytes`` is their memory. With a prompt cache on disk
    (promptcache.py) the copies at multiples of ``milestone`` positions are kept as well, so that a
    long prompt's file holds states a later prompt can restart from (an agent's system prompt
    followed by another question)."""

    def __init__(self, model, keep: int = SNAPSHOTS, milestone: int = 0):
        self.model, self.keep, self.milestone = model, keep, milestone
        self.arrays = model.state_buffers()  # each [slots, ...]
        self.at: list[dict[int, list[np.ndarray]]] = [{} for _ in range(model.slots)]

    @property
    def bytes(self) -> int:
        return sum(a[0].nbytes for a in self.arrays) * sum(len(d) for d in self.at)

    def take(self, slot: int, pos: int) -> None:
        d = self.at[slot]
        d[pos] = [a[slot].copy() for a in self.arrays]
        latest = [p for p in d if not (self.milestone and p % self.milestone == 0)]
        for p in sorted(latest)[:-self.keep]:
            del d[p]

    def best(self, slot: int, n: int) -> int:
        """The largest position <= n this slot's state can restart from (0: the empty state)."""
        return max((p for p in self.at[slot] if p <= n), default=0)

    def restore(self, slot: int, pos: int, src: int | None = None) -> None:
        """Slot's live state := the copy at pos (of slot src, default its own); pos 0 needs none."""
        if pos == 0:
            return
        src = slot if src is None else src
        for a, saved in zip(self.arrays, self.at[src][pos]):
            a[slot] = saved
        if src != slot:
            self.at[slot][pos] = [s.copy() for s in self.at[src][pos]]

    def resume(self, slot: int, n: int) -> None:
        """A prompt continues in slot from position n (one of its copies, or 0): the copies past n
        no longer hold (those positions are about to be rewritten), the live state is the copy at n."""
        for p in [p for p in self.at[slot] if p > n]:
            del self.at[slot][p]
        self.restore(slot, n)


class PrefixReuse:
    """The engine's prefix cache (engine.py): a slot's kept prompt, another slot's, a file's."""

    def _from_disk(self, r) -> None:
        """(engine thread, r at the start of its prompt) a longer prefix of r's prompt than its slot
        holds, read from a file into the slot (outside the lock: submitting requests never waits)"""
        n, e = self.disk.lookup(r.ids, self.reuse_grid)
        if n > r.cached and self.disk.restore(e, n, r.slot):
            if self.snaps is not None:
                self.snaps.take(r.slot, n)  # the state restore() put in the slot
            with self.cv:
                self.stats["cached"] += n - r.cached
                r.cached = r.filled = n
                self.kept[r.slot] = (r.ids, n)

    def _reusable(self, slot: int, ids: list[int]) -> int:
        """prompt tokens of ids whose K/V slot already holds (and, in a hybrid model, a state copy at)"""
        n = shared_prefix(*self.kept[slot], ids, self.reuse_grid) if self.prefix_cache else 0
        return self.snaps.best(slot, n) if self.snaps is not None else n

    def _share(self, r) -> None:
        """(engine thread, r at the start of its prompt) the longest prefix of r's prompt that another
        slot's prompt path holds, copied into r's slot: n choices of one prompt, a shared system
        prompt or few-shot context prefill it once (the same bits: prompt-path positions only)"""
        best, src = r.filled, -1
        for k in range(self.parallel):
            if k != r.slot and (m := self._reusable(k, r.ids)) > best:
                best, src = m, k
        if src >= 0:
            copy_positions(self.model, src, r.slot, r.filled, best)
            if self.snaps is not None:
                self.snaps.restore(r.slot, best, src)
            with self.cv:
                self.stats["cached"] += best - r.filled
                r.cached = r.filled = best
                self.kept[r.slot] = (r.ids, best)
