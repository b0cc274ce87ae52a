"""The torch-free runtime: a rows32 artifact through the C core, with numpy and ctypes only.

``load_lite(path)`` maps the artifact with numpy (read-only, no copy), builds the C core's
model description over it (the same structs runtime/fastpath.py fills from torch tensors),
and generates: prompts through ``sq_prefill`` + ``sq_head`` (the last position's logits), every
new token through ``sq_step`` (embedding -> layers -> head, top logits exact).
torch is never imported, which saves ~200 MiB of resident memory (``import torch`` alone:
208 MiB RSS here) and its import time; what the process holds is the mapped weights, the KV
cache, the RoPE tables, the C core's buffers and the tokenizer.

It needs what the C core needs: a rows32 artifact (int4 rows32, int8 or bf16 linears) and a
C compiler. The same C calls as the torch runtime's default paths on the same tables (one
RoPE function for both), so the logits are the same bits (a final softcap aside: numpy's tanh) and greedy output is identical.
Sampling is numpy's: a seeded sample does not reproduce the torch runtime's draws.
"""
from __future__ import annotations

import ctypes
import math
import os
import time

import numpy as np
from sparkq.formats import constants as C
from sparkq.formats.artifact import Artifact, ArtifactError
from sparkq.formats.layout import ROWS32
from sparkq.formats.spec import rope_tables_bf16

from . import kernels as K
from .common import (DEFAULT_KV_BUDGET_MIB, DEFAULT_MAX_MODEL_LEN, REFINE_SPLIT, REFINE_TOP, LoadInfo, check_ids,
                     fix_malloc_mmap_threshold, kv_capacity, resolve)
from .errors import RuntimeUserError
from .generate import Generator, GenStats, check_request
from .tokenizer import ChatTokenizer


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


def _bf16_round(x: float) -> float:
    u = int(np.array(x, dtype=np.float32).view(np.uint32))
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return float(np.array(u, dtype=np.uint32).view(np.float32))


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sp = p[order]
        keep = np.cumsum(sp) - sp < top_p
        keep[0] = True
        q = np.zeros_like(p)
        q[order[keep]] = sp[keep]
        p = q / q.sum()
    return int(rng.choice(p.size, p=p))


class LiteModel(Generator):
    def __init__(self, art: Artifact, path, *, max_model_len: int, kv_budget_mib: float, threads: int, lib, hub: dict):
        t0 = time.perf_counter()
        spec = self.spec = art.spec
        self.art, self.lib = art, lib
        self.tensors = t = art.map_numpy()
        self.max_model_len = max_model_len
        cap = kv_capacity(spec, max_model_len, kv_budget_mib)
        self.k = np.empty((spec.layers, spec.kv_heads, cap, spec.head_dim), np.uint16)  # bf16 bits; pages
        self.v = np.empty_like(self.k)  # are touched only as tokens are written
        self.cap = cap
        self._keep = []  # arrays the C structs point into
        lin = {name: self._linear(name, li, t) for name, li in art.linears.items()}
        ropes = {}
        layers = (K.SqLayer * spec.layers)()
        for i in range(spec.layers):
            L = layers[i]
            theta, rot, window = spec.layer_attention(i)
            if (theta, rot) not in ropes:
                ropes[(theta, rot)] = rope_tables_bf16(spec, max_model_len, rot, theta)
            cos, sin = ropes[(theta, rot)]
            bias = t.get(f"layers.{i}.qkv.bias") if spec.qkv_bias else None
            L.qkv = self._linear(f"layers.{i}.qkv", art.linears[f"layers.{i}.qkv"], t, bias)
            L.o, L.gate_up, L.down = lin[f"layers.{i}.o"], lin[f"layers.{i}.gate_up"], lin[f"layers.{i}.down"]
            for f in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"):
                setattr(L, f, self._ptr(t.get(f"layers.{i}.{f}.weight")))
            L.cos, L.sin, L.rot = self._ptr(cos), self._ptr(sin), rot
            L.kcache, L.vcache = self._ptr(self.k[i]), self._ptr(self.v[i])
            L.window = window or 0
        self.ropes = ropes  # (theta, rotary dim) -> (cos, sin) bf16 bits [max_model_len, rot]
        self.rope_bytes = sum(c.nbytes + s.nbytes for c, s in ropes.values())
        m = self.m = K.SqModel()
        m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim = spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim
        m.inter, m.vocab, m.cap = spec.intermediate, lin["lm_head"].n, cap
        m.act = 0 if spec.act == "silu" else 1
        m.norm_offset = int(bool(spec.norm_offset))
        m.refine_top = REFINE_SPLIT if art.linears["lm_head"].residual else REFINE_TOP
        m.eps = spec.rms_eps
        m.attn_scale = spec.attn_scale or 1.0 / math.sqrt(spec.head_dim)
        m.embed_mult = _bf16_round(spec.hidden ** 0.5) if spec.embed_scale else 0.0
        self.layers = layers
        m.layer = ctypes.cast(layers, ctypes.POINTER(K.SqLayer))
        m.head, m.embed = lin["lm_head"], lin.get("embed", lin["lm_head"])
        m.final_norm = self._ptr(t["norm.weight"])
        lib.sq_set_threads(threads)
        self.work = lib.sq_work_new(ctypes.byref(m))
        if not self.work:
            raise MemoryError("sq_work_new failed")
        self.x = np.empty(spec.hidden, np.float32)
        self.logits = np.empty(m.vocab, np.float32)
        config = art.config
        tok = ChatTokenizer.from_dir(path, config) if (path / "tokenizer.json").exists() else None
        super().__init__(self, tok)
        extra = {"hub": hub} if hub else {}
        extra["decode_path"] = f"c ({K.simd_name(lib)}, {threads} threads, lite: no torch)"
        extra["prefill_path"] = "c"
        extra["threads"] = threads
        self.info = LoadInfo(str(path), "artifact", art.layout, time.perf_counter() - t0, cap, self.k.nbytes * 2,
                             self.rope_bytes, max_model_len, extra)

    def __del__(self):
        if getattr(self, "work", None):
            self.lib.sq_work_free(self.work)
            self.work = None

    def _ptr(self, a: np.ndarray | None) -> int | None:
        if a is None:
            return None
        if not a.flags.c_contiguous:
            raise ValueError("C core needs contiguous arrays")
        self._keep.append(a)
        return a.ctypes.data

    def _linear(self, name: str, li, t: dict, bias: np.ndarray | None = None) -> K.SqLinear:
        if li.kind == C.KIND_INT4:
            return K.SqLinear(self._ptr(t[f"{name}.qweight"]), self._ptr(t[f"{name}.scales_zeros"]), self._ptr(bias), 0,
                              li.n, li.k, li.group_size, self._ptr(t.get(f"{name}.residual")),
                              self._ptr(t.get(f"{name}.residual_scales")))
        if li.kind == C.KIND_INT8:
            return K.SqLinear(self._ptr(t[f"{name}.qweight"]), self._ptr(t[f"{name}.scales"]), self._ptr(bias), 1,
                              li.n, li.k, 0)
        return K.SqLinear(self._ptr(t[f"{name}.weight"]), None, self._ptr(bias), 2, li.n, li.k, 0)

    # ------------------------------------------------------------------ model interface
    @property
    def capacity(self) -> int:
        return min(self.cap, self.max_model_len)

    def check_fits(self, total_tokens: int) -> None:
        if total_tokens > self.capacity:
            which = ("max_model_len", "--max-model-len") if self.max_model_len <= self.cap else ("KV budget", "--kv-budget-mib")
            raise RuntimeUserError(
                f"{total_tokens} tokens (prompt + generation) exceed the {which[0]} capacity of {self.capacity} tokens; "
                f"shorten the prompt, lower --max-new-tokens, or raise {which[1]}")

    def step(self, token: int, pos: int) -> np.ndarray:
        """Logits fp32 [vocab] of one token at pos (K/V cached); a view reused by the next call."""
        if not 0 <= pos < self.cap:
            raise RuntimeUserError(f"position {pos} is beyond the KV cache ({self.cap} tokens)")
        check_ids(int(token), self.m.embed.n)
        self.lib.sq_step(ctypes.byref(self.m), self.work, int(token), int(pos), self.x.ctypes.data, self.logits.ctypes.data)
        c = self.spec.final_softcap
        return np.tanh(self.logits / c) * c if c else self.logits

    def prefill(self, ids, pos0: int = 0) -> np.ndarray:
        """Logits of the last of ``ids`` (at pos0..), every token's K/V cached."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise RuntimeUserError("empty prompt: give at least one token of text")
        self.check_fits(pos0 + ids.size)
        check_ids((int(ids.min()), int(ids.max())), self.m.embed.n)
        if ids.size == 1:
            return self.step(int(ids[0]), pos0)
        xn = np.empty(self.spec.hidden, np.float32)
        rc = self.lib.sq_prefill(ctypes.byref(self.m), ids.ctypes.data, ids.size, int(pos0), K.PREFILL_CHUNK,
                                 xn.ctypes.data, 0)
        if rc:
            raise MemoryError("sq_prefill could not allocate its activation buffers")
        self.lib.sq_head(ctypes.byref(self.m), self.work, xn.ctypes.data, self.logits.ctypes.data)
        c = self.spec.final_softcap
        return np.tanh(self.logits / c) * c if c else self.logits

    def stream_ids(self, ids: list[int], max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   seed: int | None = None, stop_ids=None):
        """Yields generated token ids; raises before any compute if it cannot fit."""
        check_request(ids, max_new_tokens, temperature, top_p)
        self.check_fits(len(ids) + max_new_tokens)
        stop = (self.tokenizer.stop_ids if self.tokenizer else set()) if stop_ids is None else set(stop_ids)
        rng = np.random.default_rng(seed)
        st = self.last_stats = GenStats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        tok = sample(self.prefill(ids), temperature, top_p, rng)
        st.prefill_s = st.ttft_s = time.perf_counter() - t0
        st.new_tokens = 1
        yield tok
        pos = len(ids)
        t1 = time.perf_counter()
        while st.new_tokens < max_new_tokens and tok not in stop:
            tok = sample(self.step(tok, pos), temperature, top_p, rng)
            pos += 1
            st.new_tokens += 1
            st.decode_s = time.perf_counter() - t1
            yield tok


def load(path_or_repo_id: str, *, max_model_len: int | None = None, kv_budget_mib: float = DEFAULT_KV_BUDGET_MIB,
         threads: int | None = None, verify: bool = False) -> LiteModel:
    """A rows32 artifact (local dir or Hub repo id) on the torch-free runtime (see module doc)."""
    t0 = time.perf_counter()
    fix_malloc_mmap_threshold()
    path, hub = resolve(str(path_or_repo_id), layouts=[ROWS32])
    try:
        art = Artifact.open(path)
    except ArtifactError as e:
        raise RuntimeUserError(str(e)) from None
    if art.layout != ROWS32:
        raise RuntimeUserError(f"{path}: the torch-free runtime reads rows32 artifacts, this one is {art.layout}; "
                               "use sparkq without --lite, or convert with --target rows32")
    if verify:
        bad = art.verify()
        if bad:
            raise RuntimeUserError(f"{path}: tensor {bad!r} does not match its sha256; the artifact is corrupt, re-download or re-convert it")
    try:
        lib = K.load()
    except (K.KernelUnavailable, OSError) as e:
        fix = "unset SPARKQ_KERNEL" if os.environ.get("SPARKQ_KERNEL") else "install a C compiler"
        raise RuntimeUserError(f"the torch-free runtime needs the C core ({e}); {fix} or drop --lite") from None
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, art.spec.max_position)
    m = LiteModel(art, path, max_model_len=max_model_len, kv_budget_mib=kv_budget_mib,
                  threads=int(threads) if threads else physical_cores(), lib=lib, hub=hub)
    m.info.load_seconds = time.perf_counter() - t0
    return m
