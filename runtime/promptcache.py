"""A prompt cache on disk (``sparkq serve --prompt-cache DIR``, ``sparkq chat --prompt-cache DIR``).

After a prompt is prefilled, the KV cache of its positions (and, in a model with recurrent layers,
its states at the positions the engine kept copies for) goes to a file in DIR (kvfile.py), written
by a background thread to a temp name and renamed. A later process with the same model setup that
gets a prompt sharing a prefix with a file's copies those positions back into its slot instead of
prefilling them: an agent's 8k-token system prompt costs a read after a restart, not a prefill.

A file belongs to one model setup (``PromptCache.key``): the artifact (the sha256 of its
manifest, which holds every tensor's digest), the KV dtype and geometry, the C-core build and
the prompt path's slicing. The prompt path gives the same bits whole or continued from any
position (engine.py), so a prefix read back changes no bit of an answer; where the prompt GEMM's
bits depend on the slice length (``grid``) prefixes are cut to whole slices. Files of other
setups are left alone (DIR may be shared); a file that is not intact (truncated, a flipped byte:
each file's header and payload carry sha256 digests) is ignored with one log line and removed.
DIR is bounded (``max_bytes``, all files in it): least recently used files go first.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..formats.constants import MANIFEST_FILE
from . import kvfile
from .chat import common_prefix

PROMPT_CACHE_MIB = 4096  # DIR's bound by default
MIN_TOKENS = 256  # shorter prompts are not written (prefilling them costs about what a read does)
# hybrids: recurrent states kept in memory for the file at every MILESTONE positions of a prompt (besides
# the latest slice boundaries: serve/prefix.py Snapshots); 2048: 4 copies of a 18 MiB state for an 8k prompt
MILESTONE = 2048


@dataclass
class Entry:
    path: Path
    ids: np.ndarray  # the prompt's first n ids
    states: list[int] = field(default_factory=list)  # positions with recurrent states (hybrids)
    header: dict | None = None
    start: int = 0


def _log(msg: str) -> None:
    print(f"sparkq: prompt cache: {msg}", file=sys.stderr, flush=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def kv_views(model, slot: int, n: int, a: int = 0) -> dict[str, np.ndarray]:
    """The slot's positions a..n-1 of each KV array, by file name (views: [layers, kv_heads, n - a(,
    head_dim)], or per layer where layers differ in head dim; K, V and an int8 cache's scales)"""
    out = {}
    for name, arr in (("k", model.k), ("v", model.v), ("k_scale", model.k_scale), ("v_scale", model.v_scale)):
        if isinstance(arr, list):
            out.update({f"{name}.{i}": x[slot, :, a:n] for i, x in enumerate(arr)})
        elif arr is not None:
            out[name] = arr[:, slot, :, a:n]
    return out


class PromptCache:
    """The files in ``directory`` that belong to ``model``'s setup (``tag``: the prompt path's
    slicing), with ``lookup`` / ``restore`` on the engine's thread and ``save`` in the background."""

    def __init__(self, directory, model, *, tag: str, max_bytes: int = PROMPT_CACHE_MIB << 20,
                 min_tokens: int = MIN_TOKENS, milestone: int = MILESTONE, log=_log):
        from .core import build_name

        self.dir, self.model, self.max_bytes, self.min_tokens, self.log = Path(directory), model, int(max_bytes), \
            int(min_tokens), log
        self.milestone = int(milestone)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            from .errors import RuntimeUserError
            raise RuntimeUserError(f"--prompt-cache {directory}: cannot create the directory ({e.strerror}); "
                                   "give a writable directory") from None
        self.recurrent = bool(model.state_buffers())
        manifest = hashlib.sha256((Path(model.art.path) / MANIFEST_FILE).read_bytes()).hexdigest()
        shapes = {n: list(a.shape[:1]) + list(a.shape[2:-1]) + [a.dtype.name]
                  for n, a in kv_views(model, 0, 0).items()}
        states = [list(a.shape[1:]) for a in model.state_buffers()]
        self.key = hashlib.sha256(json.dumps([manifest, model.info.extra.get("kv_dtype"), build_name(model.lib), tag,
                                              shapes, states]).encode()).hexdigest()
        self.lock = threading.Lock()
        self.entries: dict[Path, Entry] = {}
        self.stats = {"hits": 0, "hit_tokens": 0, "written": 0, "ignored": 0}
        self._scan()
        self.todo: queue.Queue = queue.Queue(maxsize=2)
        self.writer = threading.Thread(target=self._write_loop, name="sparkq-prompt-cache", daemon=True)
        self.writer.start()

    # -- listing --

    def _scan(self) -> None:
        others = 0
        for p in sorted(self.dir.iterdir()):
            if p.name.endswith(kvfile.TEMP_SUFFIX):  # a write that never finished: its writer is gone
                pid = p.name[:-len(kvfile.TEMP_SUFFIX)].rsplit(".", 1)[-1]
                if not pid.isdigit() or not _pid_alive(int(pid)):
                    self.log(f"removing {p.name}: an unfinished write (its process ended)")
                    p.unlink(missing_ok=True)
                continue
            if not p.name.endswith(kvfile.SUFFIX):
                continue
            try:
                header, start = kvfile.read_header(p)
            except kvfile.KVFileError as e:
                self._drop(p, str(e))
                continue
            if header[kvfile.K_KEY] != self.key:
                others += 1
                continue
            self.entries[p] = Entry(p, np.asarray(header[kvfile.K_IDS][:header[kvfile.K_N]], np.int64),
                                    sorted(int(s) for s in header[kvfile.K_STATES]), header, start)
        if others:
            self.log(f"{others} file(s) in {self.dir} are another model's or setup's (another artifact, KV dtype, "
                     "build or slicing): left alone, not used")

    def _drop(self, p: Path, why: str) -> None:
        self.stats["ignored"] += 1
        self.log(f"ignoring {p.name}: {why}; removed")
        with self.lock:
            self.entries.pop(p, None)
        p.unlink(missing_ok=True)

    # -- the engine's side --

    def lookup(self, ids: list[int], grid: int = 1, limit: int | None = None) -> tuple[int, Entry | None]:
        """The longest prefix of ids (at most ``limit`` tokens, default all but the last; whole
        slices of ``grid``; in a hybrid model a position with a kept state) a file holds."""
        limit = len(ids) - 1 if limit is None else min(limit, len(ids) - 1)
        if limit <= 0:
            return 0, None
        want = np.asarray(ids[:limit], np.int64)
        best, found = 0, None
        with self.lock:
            entries = list(self.entries.values())
        for e in entries:
            m = common_prefix(e.ids, want) // grid * grid
            if self.recurrent:
                m = max((p for p in e.states if p <= m), default=0)
            if m > best:
                best, found = m, e
        return best, found

    def restore(self, e: Entry, n: int, slot: int) -> bool:
        """Positions 0..n-1 (and the state at n) of e's file into the slot, after its digest checks;
        False (one log line, the file removed) when it does not."""
        try:
            arrays = kvfile.read_payload(e.path, e.header, e.start)
            views = kv_views(self.model, slot, n)
            if set(views) - set(arrays):
                raise kvfile.KVFileError(f"it lacks {sorted(set(views) - set(arrays))}")
            for name, dst in views.items():  # (positions: the last axis of scales, else the one before)
                src = arrays[name]
                dst[...] = src[..., :n] if "scale" in name else src[..., :n, :]
            if self.recurrent:
                for j, buf in enumerate(self.model.state_buffers()):
                    buf[slot] = arrays[f"state.{n}.{j}"]
        except (kvfile.KVFileError, KeyError, ValueError, OSError) as err:
            self._drop(e.path, str(err))
            return False
        os.utime(e.path)  # recently used
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += n
        return True

    def save(self, ids: list[int], n: int, slot: int, states: dict[int, list[np.ndarray]] | None = None) -> bool:
        """Queue the slot's first n positions of ids (and hybrids' ``states``: position -> copies of
        the state buffers' rows there) for writing; False where it is too short, where files hold
        all but fewer than ``min_tokens`` of it (a system prompt's file and another question after
        it: one file, not one per question), or where the writer is busy."""
        states = {p: s for p, s in (states or {}).items() if 0 < p <= n}
        if n < self.min_tokens or (self.recurrent and not states):
            return False
        if n - self.lookup(list(ids[:n]) + [-1])[0] < self.min_tokens:
            return False
        key = np.asarray(ids[:n], np.int64)
        arrays = {name: np.ascontiguousarray(v) for name, v in kv_views(self.model, slot, n).items()}
        for p, bufs in states.items():
            arrays.update({f"state.{p}.{j}": np.ascontiguousarray(b) for j, b in enumerate(bufs)})
        try:
            self.todo.put_nowait((key, arrays, {p: [f"state.{p}.{j}" for j in range(len(s))] for p, s in states.items()}))
        except queue.Full:
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            job = self.todo.get()
            try:
                if job is not None:
                    self._write(*job)
            except OSError as e:
                self.log(f"cannot write to {self.dir} ({e.strerror}); the prompt is not cached")
            finally:
                self.todo.task_done()
            if job is None:
                return

    def _write(self, ids: np.ndarray, arrays: dict, states: dict) -> None:
        size = sum(a.nbytes for a in arrays.values())
        if size > self.max_bytes:
            return
        name = hashlib.sha256(self.key.encode() + ids.tobytes()).hexdigest()[:40] + kvfile.SUFFIX
        path = self.dir / name
        header, start = kvfile.write(path, self.key, ids.tolist(), len(ids), arrays, states)
        new = Entry(path, ids, sorted(states), header, start)
        with self.lock:  # files this one holds all of are dropped
            old = [e for e in self.entries.values() if e.path != path and len(e.ids) <= len(ids)
                   and np.array_equal(e.ids, ids[:len(e.ids)]) and set(e.states) <= set(states)]
            for e in old:
                self.entries.pop(e.path, None)
            self.entries[path] = new
        for e in old:
            e.path.unlink(missing_ok=True)
        self.stats["written"] += 1
        self._evict(keep=path)

    def _evict(self, keep: Path) -> None:
        """Least recently used files of DIR (any setup's) go until it fits max_bytes."""
        files = []
        for p in self.dir.iterdir():
            if p.name.endswith(kvfile.SUFFIX):
                try:
                    st = p.stat()
                except OSError:
                    continue
                files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, s, p in sorted(files):
            if total <= self.max_bytes:
                break
            if p != keep:
                with self.lock:
                    self.entries.pop(p, None)
                p.unlink(missing_ok=True)
                total -= s

    def flush(self) -> None:
        """Wait for queued writes (a clean shutdown keeps them)."""
        self.todo.join()

    def close(self) -> None:
        self.flush()
        self.todo.put(None)
        self.writer.join(timeout=60)
