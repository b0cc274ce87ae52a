"""Cutting a checked run back (runtime/speculate.py): the batched step's rows of one sequence at
consecutive positions, of which the first n stand. Attention needs nothing (positions past the kept
rows are written again before they are read); a hybrid model's recurrent state is restored from a
copy taken before the step and advanced over the kept rows' saved inputs (sq_mix: the bits of n
single steps). A mixin of core.Session."""
from __future__ import annotations

import ctypes

import numpy as np

from sparkq.formats.mixers import recurrent_widths


class Rewind:
    def _hold(self, M: int, pos: np.ndarray, off: np.ndarray, rewind: bool) -> None:
        """(step_many) for a rewind: each run's slot states copied, the recurrent layers' inputs kept"""
        self._pending = {}
        runs = [(a, b - a) for a, b in zip(*_runs(pos, off)) if b - a > 1] if rewind and self.rec_layers else []
        if not runs:
            self.lib.sq_batch_keep(self.batch, None, None)
            return
        (wq, wz, _), n = recurrent_widths(self.spec), len(self.rec_layers)
        kq = np.empty((n, M, wq), np.float32)
        kz = np.empty((n, M, max(wz, 1)), np.float32)
        for a, T in runs:
            slot = int(off[a]) // self._slot_elems()
            saved = self._copies.get(slot)  # one buffer set per slot, reused (a Qwen3.5-0.8B slot's is 19 MiB)
            if saved is None:
                saved = self._copies[slot] = [tuple(np.empty_like(x[slot]) for x in st) for st in self._states]
            for st, cp in zip(self._states, saved):
                for x, c in zip(st, cp):
                    np.copyto(c, x[slot])
            self._pending[int(off[a])] = (a, T, saved, kq, kz)
        self.lib.sq_batch_keep(self.batch, kq.ctypes.data, kz.ctypes.data)

    def _slot_elems(self) -> int:
        return self.spec.kv_heads * self.cap * self.spec.max_head_dim

    def rewind(self, kvoff: int, n: int) -> None:
        """Keep the first n >= 1 rows of the last step_many's run in slot kvoff (taken with
        ``rewind=True``): a hybrid model's states become those after row n - 1 (the copy from
        before the run, then the DeltaNet over the kept rows' inputs: the bits of n single steps).
        An attention layer needs nothing: positions past the kept rows are written again before
        they are read."""
        if kvoff not in self._pending:
            return
        a, T, saved, kq, kz = self._pending.pop(kvoff)
        if not 1 <= n <= T:
            raise ValueError(f"rewind: keep 1..{T} rows, got {n}")
        if n == T:
            return
        slot = kvoff // self._slot_elems()
        out = np.empty((n, recurrent_widths(self.spec)[2]), np.float32)
        for j, (li, st, copy) in enumerate(zip(self.rec_layers, self._states, saved)):
            for x, c in zip(st, copy):
                x[slot] = c
            q, z = np.ascontiguousarray(kq[j, a:a + n]), np.ascontiguousarray(kz[j, a:a + n])
            if self.lib.sq_mix(ctypes.byref(self.m), ctypes.byref(self.layers[li]), int(kvoff), q.ctypes.data,
                                   z.ctypes.data, n, out.ctypes.data):
                raise MemoryError("sq_mix: out of memory")


def _runs(pos: np.ndarray, off: np.ndarray) -> tuple[list[int], list[int]]:
    """the runs of step_many's rows (adjacent rows of one slot at consecutive positions): starts, ends"""
    new = np.ones(pos.size, bool)
    new[1:] = (off[1:] != off[:-1]) | (pos[1:] != pos[:-1] + 1)
    starts = np.flatnonzero(new).tolist()
    return starts, starts[1:] + [pos.size]
