"""The torch-free runtime: a rows32 artifact through the C core, with numpy and ctypes only.

``load_lite(path)`` maps the artifact with numpy (read-only, no copy), describes it to the C
core (``core.Session``, the binding the torch runtime uses too) and generates through the
shared loop (generate.py): prompts through ``sq_prefill`` + ``sq_head`` (the last position's
logits), every new token through ``sq_step`` (embedding -> layers -> head, top logits exact).
torch is never imported, which saves ~200 MiB of resident memory (``import torch`` alone:
208 MiB RSS here) and its import time; what the process holds is the mapped weights, the KV
cache, the RoPE tables, the C core's buffers and the tokenizer.

It needs what the C core needs: a rows32 artifact (int4 rows32, int8 or bf16 linears) and a
C compiler. The same C calls as the torch runtime's default paths on the same tables (one
RoPE function for both), so the logits are the same bits and so are the tokens, sampled ones
included (one sampler for both).
"""
from __future__ import annotations

import os
import time

import numpy as np
from sparkq.formats.artifact import Artifact, ArtifactError
from sparkq.formats.layout import ROWS32
from sparkq.formats.mixers import mixer_state
from sparkq.formats.rope import rope_tables_bf16

from .. import core
from ..common import (DEFAULT_KV_BUDGET_MIB, DEFAULT_KV_DTYPE, DEFAULT_MAX_MODEL_LEN, LoadInfo, by_layer,
                     check_fits, check_kv_dtype, core_lacks, fix_malloc_mmap_threshold, kv_capacity, resolve)
from ..errors import RuntimeUserError
from ..generate import Generator
from ..tokenizer import ChatTokenizer


def physical_cores() -> int:
    """Distinct (physical id, core id) pairs this process may run on (torch's default thread
    count is the physical cores); falls back to the CPUs in the affinity mask."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores, cur, phys = set(), None, "0"
    try:
        for line in open("/proc/cpuinfo"):
            k, _, v = line.partition(":")
            k, v = k.strip(), v.strip()
            if k == "processor":
                cur = int(v)
            elif k == "physical id":
                phys = v
            elif k == "core id" and cur in cpus:
                cores.add((phys, v))
    except OSError:
        pass
    return len(cores) or len(cpus) or 1


def _clinear(name: str, li, t: dict) -> core.CLinear:
    """An artifact linear (formats LinearEntry) over the mapped arrays."""
    return core.clinear(li.kind, li.n, li.k, li.group_size, lambda s: t.get(f"{name}.{s}"))


def empty64(shape, dtype) -> np.ndarray:
    """np.empty on a 64-byte boundary, as torch's buffers are (numpy's large ones start 16 bytes past
    one): the kernels read cache rows whole and prefetch one line per 64 bytes of a row, which
    assumes rows start on a line (a 64-byte row at offset 16 spans two)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + 64, np.uint8)
    off = -raw.ctypes.data % 64
    return raw[off:off + n].view(dtype).reshape(shape)


class LiteModel(Generator):
    def __init__(self, art: Artifact, path, *, max_model_len: int, kv_budget_mib: float, threads: int, lib, hub: dict,
                 slots: int = 1, kv_dtype: str = DEFAULT_KV_DTYPE, pinned: bool = False):
        t0 = time.perf_counter()
        spec = self.spec = art.spec
        self.art, self.lib = art, lib
        self.tensors = t = art.map_numpy()
        self.max_model_len = max_model_len
        if slots < 1:
            raise RuntimeUserError(f"the KV cache needs at least one sequence slot, got {slots}")
        # fixed slots: the budget split evenly, each slot a whole sequence's cache (serving.py)
        cap = kv_capacity(spec, max_model_len, kv_budget_mib / slots, kv_dtype)
        # [attention layers, slots, kv_heads, cap, head_dim]: bf16 bits, or int8 codes with bf16 scales
        # [attention layers, slots, kv_heads, cap]; pages are touched only as tokens are written
        shape = (len(spec.kv_layers), slots, spec.kv_heads, cap, spec.head_dim)
        dt = np.uint16 if kv_dtype == "bf16" else np.int8

        def alloc(d, last=True):  # (per-layer head dims, Gemma 4: one array per layer)
            if not spec.head_dims:
                return empty64(shape if last else shape[:-1], d)
            return [empty64((slots, spec.kv_heads, cap) + ((spec.hd(i),) if last else ()), d) for i in spec.kv_layers]
        self.k, self.v = alloc(dt), alloc(dt)
        self.k_scale = self.v_scale = None
        if kv_dtype == "int8":
            self.k_scale, self.v_scale = alloc(np.uint16, False), alloc(np.uint16, False)
        # the recurrent mixers' state per layer (formats/mixers.py), [slots, ...] fp32; a slot's is
        # zeroed when a sequence starts at position 0 (Session)
        self.state = mixer_state(spec, slots, lambda shape: empty64(shape, np.float32))
        self.state_nbytes = sum(a.nbytes for st in self.state if st for a in st.values())
        self.kv_nbytes = sum(a.nbytes for p in (self.k, self.v, self.k_scale, self.v_scale) if p is not None
                             for a in (p if isinstance(p, list) else [p]))
        self.cap, self.slots = cap, slots
        self.slot_elems = spec.kv_heads * cap * spec.max_head_dim  # the element offset between slots (C core units)
        ropes = {}  # spec.layer_rope_key -> (cos, sin) bf16 bits [max_model_len, rot], one per distinct key
        per_layer = []
        for i in range(spec.layers):
            theta, rot, _ = spec.layer_attention(i)
            key = spec.layer_rope_key(i)
            if key not in ropes:
                ropes[key] = rope_tables_bf16(spec, max_model_len, rot, theta, i)
            per_layer.append(ropes[key])
        self.ropes = ropes
        self.rope_bytes = sum(c.nbytes + s.nbytes for c, s in ropes.values())
        linears = {name: _clinear(name, li, t) for name, li in art.linears.items()}
        vectors = {n: t[n] for n in spec.vector_shapes()}
        self.session = core.Session(lib, spec, linears, vectors, per_layer, by_layer(spec, self.k), by_layer(spec, self.v),
                                    cap, threads=threads, attn_scale=core.attn_scale(spec),
                                    embed_mult=spec.embed_mult or 0.0, kscale=by_layer(spec, self.k_scale),
                                    vscale=by_layer(spec, self.v_scale), pinned=pinned,
                                    states=[tuple(st.values()) if st else None for st in self.state])
        config = art.config
        tok = ChatTokenizer.from_dir(path, config) if (path / "tokenizer.json").exists() else None
        super().__init__(tok)
        extra = {"hub": hub} if hub else {}
        adaptive = "" if pinned or threads == 1 else " (adaptive)"  # fewer while other programs take cores
        extra["decode_path"] = f"c ({core.build_name(lib)}, {threads} threads{adaptive}, lite: no torch)"
        extra["prefill_path"] = "c"
        extra["threads"] = threads
        extra["kv_dtype"] = kv_dtype
        if self.state_nbytes:
            extra["state_bytes"] = self.state_nbytes  # the recurrent layers' state, besides the KV cache
        self.info = LoadInfo(str(path), "artifact", art.layout, time.perf_counter() - t0, cap, self.kv_nbytes,
                             self.rope_bytes, max_model_len, extra)

    @property
    def capacity(self) -> int:
        return min(self.cap, self.max_model_len)

    def check_fits(self, total_tokens: int) -> None:
        check_fits(total_tokens, self.max_model_len, self.cap)

    def step(self, token: int, pos: int) -> np.ndarray:
        """Logits fp32 [vocab] of one token at pos (K/V cached); a view reused by the next call."""
        return self.session.step(token, pos)

    def prefill(self, ids, pos0: int = 0) -> np.ndarray:
        """Logits of the last of ``ids`` (at pos0..), every token's K/V cached; a view reused by the next call."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise RuntimeUserError("empty prompt: give at least one token of text")
        self.check_fits(pos0 + ids.size)
        return self.session.prompt(ids, pos0)

    def first_logits(self, ids: list[int]) -> np.ndarray:
        return self.prefill(ids)

    def next_logits(self, token: int, pos: int) -> np.ndarray:
        return self.session.step(token, pos)

    def prefill_from(self, ids, pos0: int) -> np.ndarray:
        return self.prefill(list(ids)[pos0:], pos0)

    def verify(self, tokens: list[int], pos: int) -> np.ndarray:
        """(Generator.verify) the rows in one pass: the batched step's run in slot 0"""
        self.check_fits(pos + len(tokens))
        return self.session.step_many(tokens, range(pos, pos + len(tokens)), [0] * len(tokens), rewind=True)

    def keep(self, n: int) -> None:
        self.session.rewind(0, n)


def load(path_or_repo_id: str, *, max_model_len: int | None = None, kv_budget_mib: float = DEFAULT_KV_BUDGET_MIB,
         threads: int | None = None, verify: bool = False, slots: int = 1,
         kv_dtype: str = DEFAULT_KV_DTYPE) -> LiteModel:
    """A rows32 artifact (local dir or Hub repo id) on the torch-free runtime (see module doc);
    ``slots``: sequences the KV cache holds at once (the budget split evenly; serving.py);
    ``kv_dtype``: the KV cache's element type (common.KV_DTYPES); ``threads``: a fixed count (None: the
    physical cores, fewer while other programs take some: runtime/core/threads.py)."""
    t0 = time.perf_counter()
    check_kv_dtype(kv_dtype)
    fix_malloc_mmap_threshold()
    path, hub = resolve(str(path_or_repo_id), layouts=[ROWS32])
    try:
        art = Artifact.open(path)
    except ArtifactError as e:
        raise RuntimeUserError(str(e)) from None
    if core_lacks(art.spec):
        raise RuntimeUserError(f"{path}: the torch-free runtime needs the C core, and {core_lacks(art.spec)}; "
                               "run it on the torch runtime (--torch)")
    if art.layout != ROWS32:
        raise RuntimeUserError(f"{path}: the torch-free runtime reads rows32 artifacts, this one is {art.layout}; "
                               "use sparkq without --lite, or convert with --target rows32")
    if verify:
        bad = art.verify()
        if bad:
            raise RuntimeUserError(f"{path}: tensor {bad!r} does not match its sha256; the artifact is corrupt, re-download or re-convert it")
    try:
        lib = core.load()
    except (core.KernelUnavailable, OSError) as e:
        fix = "unset SPARKQ_KERNEL" if os.environ.get("SPARKQ_KERNEL") else \
            "install a C compiler (apt-get install gcc, or xcode-select --install)"
        raise RuntimeUserError(f"the torch-free runtime needs the C core ({str(e).splitlines()[0]}); {fix}") from None
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, art.spec.max_position)
    m = LiteModel(art, path, max_model_len=max_model_len, kv_budget_mib=kv_budget_mib,
                  threads=int(threads) if threads else physical_cores(), lib=lib, hub=hub, slots=slots,
                  kv_dtype=kv_dtype, pinned=bool(threads))
    m.info.load_seconds = time.perf_counter() - t0
    return m
