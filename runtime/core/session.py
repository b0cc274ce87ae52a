"""One model described to the C core, from numpy arrays or torch tensors alike.

``Session`` fills the C structs once (pointers into the caller's buffers: the artifact's
mapping, the KV cache, the RoPE tables; nothing is copied) and runs the three calls both
runtimes are made of: ``prefill`` (a prompt's tokens through every layer, K/V cached),
``step`` (one token -> logits) and ``head`` (a final-normed hidden state -> logits), with
numpy results. A final softcap, where the model has one, is applied here, so both runtimes
return the same bits.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np
from sparkq.formats import constants as C
from sparkq.formats.kinds import KINDS

from ..common import REFINE_SPLIT, REFINE_TOP, check_ids
from ..errors import RuntimeUserError
from . import abi
from .lib import kind_code
from .rewind import Rewind, _runs
from .threads import OVERSUB_PARAMS, Governor

# the fewest sequences whose batched step takes the AMX int8 tile products when a server asks for
# them (--batch-tiles): where they beat the W4A8 products on the Qwen3-1.7B shape (docs/serving.md
# "Tiles": 8 sequences 0.97x, 16 1.34-1.47x; re-measure with tools/stepbench.py ART --rows 8,16 --tiles 1)
BATCH_TILES_MIN_M = 16

# prompt tokens per sq_prefill chunk: bounds the activation buffers (at the Qwen3-1.7B shape
# ~48 MiB fp32 for 512 tokens, from the buffer sizes) while each chunk reads every weight once
# (and, on AVX512-BF16 CPUs, dequantizes it once: 512 against 256 tokens, pp512 at the 1.7B
# shape 251 vs 239 tok/s; docs/performance.md)
PREFILL_CHUNK = 512
# ModelSpec.act -> sq_model.act (csrc/sq_abi.h)
ACT_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu2": 3}


@dataclass
class CLinear:
    """A linear's buffers as the C core reads them (csrc/sq_abi.h sq_linear): ``kind`` a
    formats/constants.py KIND_*, ``g`` the int4 group size (0 otherwise)."""
    kind: str
    n: int
    k: int
    g: int
    q: object
    sz: object = None
    bias: object = None
    res: object = None
    rsc: object = None
    lut: object = None  # lut4: int8 [N, 16] levels
    rmap: object = None  # a partial split: int32 [N] rows of res / rsc, -1 where it has none


def clinear(kind: str, n: int, k: int, g: int | None, tensor, bias=None) -> CLinear:
    """A linear of weight kind ``kind`` (formats/kinds.py) for the C core: ``tensor(suffix)`` gives
    each of the kind's tensors (None where absent: e.g. no residual plane); the one mapper for the
    torch-free runtime, the torch runtime and the converter's calibration."""
    wk = KINDS[kind]
    return CLinear(kind, n, k, (g or 0) if wk.grouped else 0, bias=bias, **{f: tensor(s) for f, s in wk.core})


def ptr(buf) -> int | None:
    """The address of a contiguous numpy array or torch tensor (None stays None)."""
    if buf is None:
        return None
    if hasattr(buf, "data_ptr"):  # torch, without importing it
        if not buf.is_contiguous():
            raise ValueError("the C core needs contiguous buffers")
        return buf.data_ptr()
    if not buf.flags.c_contiguous:
        raise ValueError("the C core needs contiguous buffers")
    return buf.ctypes.data


def _f32(buf):
    """A GDN layer's fp32 parameter or state, checked (the C core reads and writes fp32 in place)."""
    dt = str(getattr(buf, "dtype", ""))
    if dt not in ("float32", "torch.float32"):
        raise ValueError(f"the C core needs fp32 GDN parameters and states, got {dt or type(buf).__name__}")
    return buf


def linear_struct(lib, lin: CLinear) -> abi.SqLinear:
    return abi.SqLinear(ptr(lin.q), ptr(lin.sz), ptr(lin.bias), kind_code(lib, lin.kind), lin.n, lin.k, lin.g,
                        ptr(lin.res), ptr(lin.rsc), ptr(lin.lut), ptr(lin.rmap))


def _recurrent_layer(lib, L, spec, i: int, linears: dict, vectors: dict, states) -> None:
    """Layer i's recurrent mixer fields (csrc/sq_abi.h): its gate linear where it has one, its fp32
    parameters (formats/mixers.py names; absent: NULL) and its states' buffers."""
    for role in (C.ROLE_GATE, C.ROLE_SSM_IN, C.ROLE_SSM_GATE, C.ROLE_SSM_OUT):  # (ssm_*: a parallel layer's branch)
        if f"layers.{i}.{role}" in linears:
            setattr(L, role, linear_struct(lib, linears[f"layers.{i}.{role}"]))
    params = spec.params(i)
    for field, name in (("conv_w", C.GDN_CONV), ("conv_b", C.CONV_BIAS), ("a_log", C.GDN_A_LOG),
                        ("dt_bias", C.GDN_DT_BIAS), ("gnorm", C.GDN_NORM), ("ssm_d", C.SSM_D)):
        if name in params:
            setattr(L, field, ptr(_f32(vectors[f"layers.{i}.{name}"])))
    if states is None or states[i] is None:
        raise ValueError(f"layer {i} is a {spec.mixers[i]} layer: Session needs its states")
    for field, b in zip(("conv_state", "rec_state"), states[i]):
        setattr(L, field, ptr(_f32(b)))


class Session(Rewind):
    """The C core over one model's buffers.

    linears: name -> CLinear (formats names: layers.L.qkv ..., lm_head, embed if untied);
    vectors: name -> bf16 buffer (norms, the qkv bias); ropes: per layer (cos, sin) bf16
    [rope_len, rotary_dim]; kcache, vcache: per layer [(slots,) kv_heads, cap, head_dim], bf16, or
    int8 codes with kscale, vscale: per layer bf16 [(slots,) kv_heads, cap] (x = code * scale).
    A recurrent layer (``spec.mixers[i]`` not attention: formats/mixers.py): its linears, fp32
    parameters (vectors) and ``states[i]`` (its state buffers [slots, ...] in the mixer's order, fp32;
    slot s: KV slot s, the one at kvoff s * kv_heads * cap * head_dim); no rope or KV cache (None)."""

    def __init__(self, lib, spec, linears: dict, vectors: dict, ropes: list, kcache, vcache, cap: int, *,
                 threads: int, attn_scale: float, embed_mult: float = 0.0, kscale=None, vscale=None,
                 pinned: bool = False, states=None, fc=None):
        self.lib, self.spec, self.cap, self.threads = lib, spec, cap, int(threads)
        # each call's thread count: `threads` while the cores are ours, fewer while another program
        # takes some (runtime/core/threads.py); `pinned` (--threads N): always `threads`
        per_layer = sum(lin.n * lin.k for name, lin in linears.items() if name.startswith("layers.")) / max(1, spec.layers)
        self.gov = Governor(self.threads, pinned, oversubscribe=per_layer >= OVERSUB_PARAMS)
        self.prefill_chunk = PREFILL_CHUNK
        # every buffer the structs point into
        self._keep = [linears, vectors, ropes, kcache, vcache, kscale, vscale, states]
        mixers = getattr(spec, "mixers", None) or (C.MIXER_ATTENTION,) * spec.layers
        gdn = getattr(spec, "gdn", None)
        layers = (abi.SqLayer * spec.layers)()
        for i in range(spec.layers):
            L = layers[i]
            qkv = linears[f"layers.{i}.qkv"]
            if spec.qkv_bias and mixers[i] == C.MIXER_ATTENTION:
                qkv = CLinear(**{**qkv.__dict__, "bias": vectors[f"layers.{i}.qkv.bias"]})
            L.qkv = linear_struct(lib, qkv)
            L.o = linear_struct(lib, linears[f"layers.{i}.o"])
            if f"layers.{i}.gate_up" in linears:  # (none: a layer without an MLP, gate_up.q NULL)
                L.gate_up, L.down = (linear_struct(lib, linears[f"layers.{i}.{p}"]) for p in ("gate_up", "down"))
            for f in abi.LAYER_NORMS:
                setattr(L, f, ptr(vectors.get(f"layers.{i}.{f}.weight")))
            L.mixer = abi.MIXERS[mixers[i]]
            if mixers[i] != C.MIXER_ATTENTION:  # a recurrent mixer (formats/mixers.py)
                _recurrent_layer(lib, L, spec, i, linears, vectors, states)
                if not spec.has_attention(i):  # (no rope, no KV cache; a parallel layer has both)
                    continue
            if spec.attn_gate:
                L.gate = linear_struct(lib, linears[f"layers.{i}.{C.ROLE_GATE}"])
            if spec.head_dims or spec.kv_from:  # Gemma 4: its head dim; a KV-sharing layer writes no K/V
                L.head_dim, L.kv_shared = spec.hd(i), int(not spec.owns_kv(i))
            _, rot, window = spec.layer_attention(i)
            L.cos, L.sin = ptr(ropes[i][0]), ptr(ropes[i][1])
            L.rot, L.window = rot, window or 0
            L.kcache, L.vcache = ptr(kcache[i]), ptr(vcache[i])
            if kscale is not None:
                L.kscale, L.vscale = ptr(kscale[i]), ptr(vscale[i])
        for i in range(spec.layers):  # Gemma 4: each layer's scalar and per-layer input branch
            L = layers[i]
            if spec.layer_scalar:
                L.scalar = bf16_scalar(vectors[f"layers.{i}.{C.LAYER_SCALAR}.weight"])
            if spec.ple_dim:
                L.ple_gate, L.ple_proj = (linear_struct(lib, linears[f"layers.{i}.{r}"]) for r in (C.ROLE_PLE_GATE, C.ROLE_PLE_PROJ))
                L.ple_norm = ptr(vectors[f"layers.{i}.{C.PLE_NORM}.weight"])
        head = linears[C.ROLE_LM_HEAD]
        m = self.m = abi.SqModel()
        m.layers, m.hidden, m.heads, m.kv_heads = spec.layers, spec.hidden, spec.heads, spec.kv_heads
        m.head_dim = spec.max_head_dim  # (per-layer head dims: the largest; each layer's in sq_layer)
        m.inter, m.vocab, m.cap = max(spec.inters or (spec.intermediate,)), head.n, cap
        m.v_norm, m.ple_dim = int(spec.v_norm), spec.ple_dim
        if spec.ple_dim:
            m.ple_embed, m.ple_model = (linear_struct(lib, linears[r]) for r in (C.ROLE_PLE_EMBED, C.ROLE_PLE_MODEL))
            m.ple_in_norm = ptr(vectors[C.PLE_IN_NORM])
        m.act = ACT_CODES[spec.act]
        m.gate_width = spec.attn_gate
        m.norm_offset = int(bool(spec.norm_offset))
        # the top logits are recomputed exactly (a split head: from both planes), as the torch
        # runtime's Model._refine_top / _refine_split do
        m.refine_top = REFINE_SPLIT if head.res is not None else REFINE_TOP
        m.kv_int8 = int(kscale is not None)
        m.eps, m.attn_scale, m.embed_mult = spec.rms_eps, attn_scale, embed_mult
        m.res_mult, m.qk_norm_full = spec.residual_multiplier, int(spec.qk_norm and spec.qk_norm_full)
        if gdn is not None:  # the Gated DeltaNet layers' shape (csrc/gdn.c)
            m.lin_k_heads, m.lin_v_heads, m.lin_k_dim, m.lin_v_dim = gdn.k_heads, gdn.v_heads, gdn.k_dim, gdn.v_dim
            m.conv_k, m.beta_scale, m.gnorm_eps = gdn.conv_kernel, float(gdn.beta_scale), float(gdn.norm_eps)
        if getattr(spec, "sconv", None) is not None:  # the short convolutions' (csrc/ssm.c)
            m.sc_dim, m.conv_k = spec.sconv.channels, spec.sconv.kernel
        if getattr(spec, "ssm", None) is not None:  # the Mamba-2 layers' (csrc/ssm.c)
            g = spec.ssm
            m.ssm_heads, m.ssm_head_dim, m.ssm_state, m.ssm_groups = g.heads, g.head_dim, g.state, g.groups
            m.ssm_norm_groups, m.conv_k, m.gnorm_eps = g.norm_groups, g.conv_kernel, float(g.norm_eps)
        self.layers = layers
        m.layer = ctypes.cast(layers, ctypes.POINTER(abi.SqLayer))
        m.head, m.embed = linear_struct(lib, head), linear_struct(lib, linears.get(C.ROLE_EMBED, head))
        m.final_norm = ptr(vectors["norm.weight"])
        if fc is not None:  # a multi-token-prediction block: (its fc CLinear, enorm, hnorm) (runtime/mtp.py)
            m.fc, m.fc_enorm, m.fc_hnorm = linear_struct(lib, fc[0]), ptr(fc[1]), ptr(fc[2])
        # tap(kvoff, pos0, rows): the final-normed hidden states [T, hidden] of every prompt and step_many row
        # (a multi-token-prediction drafter reads them; runtime/mtp.py), or None
        self.tap = None
        self.vocab, self.embed_rows = head.n, m.embed.n
        lib.sq_set_threads(self.threads)
        self.batch, self.batch_rows = None, 0  # step_many's workspace (reserve_batch)
        # the GDN layers and their states as numpy [slots, ...] (a rewind's copies), the last
        # step_many's saved runs (rewind)
        self.rec_layers = [i for i in range(spec.layers) if mixers[i] != C.MIXER_ATTENTION]  # (every recurrent mixer's)
        self._states = [tuple(_np(b) for b in states[i]) for i in self.rec_layers]
        self._pending: dict = {}
        self._copies: dict = {}  # slot -> its states' copies before a run (rewind)
        self.tiles = (0, 0)  # step_many's tile products: (from how many sequences, hardware): set_batch_tiles
        self.work = lib.sq_work_new(ctypes.byref(m))
        if not self.work:
            raise MemoryError("sq_work_new: out of memory")
        self.x = np.empty(spec.hidden, np.float32)
        self.logits = np.empty(head.n, np.float32)

    def __del__(self):
        if getattr(self, "work", None):
            self.lib.sq_work_free(self.work)
            self.work = None
        if getattr(self, "batch", None):
            self.lib.sq_batch_free(self.batch)
            self.batch = None

    def _softcap(self, logits: np.ndarray) -> np.ndarray:
        """The logits as the model returns them: divided (Granite's logits_scaling), soft-capped
        (runtime/torchrt/layers.py Layers.logits, in place)."""
        if self.spec.logits_divisor != 1.0:
            logits /= np.float32(self.spec.logits_divisor)
        c = self.spec.final_softcap
        if c:
            np.tanh(logits / c, out=logits)
            logits *= c
        return logits

    def step(self, token: int, pos: int, out: np.ndarray | None = None) -> np.ndarray:
        """Logits fp32 [vocab] of one token at pos (its K/V cached), in ``out`` or the session's
        buffer (overwritten by the next call)."""
        if not 0 <= pos < self.cap:
            raise RuntimeUserError(f"position {pos} is beyond the KV cache ({self.cap} tokens)")
        check_ids(int(token), self.embed_rows)
        out = self.logits if out is None else out
        self.lib.sq_set_threads(self.gov.threads())
        self.lib.sq_step(ctypes.byref(self.m), self.work, int(token), int(pos), self.x.ctypes.data, ptr(out))
        return self._softcap(out)

    def prefill(self, ids, pos0: int = 0, last_only: bool = True, kvoff: int = 0, chunk: int | None = None,
                hin=None) -> np.ndarray:
        """Final-normed hidden states fp32 [T, hidden] (or [1, hidden] of the last) of prompt
        tokens at pos0.., every token's K/V cached (kvoff: the element offset of a KV slot in every
        layer's cache, serving.py; chunk: tokens per sq_prefill chunk; hin [T, hidden]: an MTP block's
        hidden-state inputs)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise RuntimeUserError("empty prompt: give at least one token of text")
        check_ids((int(ids.min()), int(ids.max())), self.embed_rows)
        every = not last_only or self.tap is not None
        out = np.empty((ids.size if every else 1, self.spec.hidden), np.float32)
        chunk = int(chunk or self.prefill_chunk)
        if pos0 + ids.size > self.cap or pos0 < 0:
            raise RuntimeUserError(f"positions {pos0}..{pos0 + ids.size - 1} are beyond the KV cache ({self.cap} tokens)")
        self.lib.sq_set_threads(self.gov.prompt_threads())
        args = (ids.ctypes.data, ids.size, int(pos0), chunk, out.ctypes.data, int(every))
        if hin is not None:
            hin = np.ascontiguousarray(hin, dtype=np.float32).reshape(ids.size, self.spec.hidden)
            rc = self.lib.sq_prefill_in_at(ctypes.byref(self.m), int(kvoff), ids.ctypes.data, hin.ctypes.data, *args[1:])
        else:
            rc = (self.lib.sq_prefill_at(ctypes.byref(self.m), int(kvoff), *args) if kvoff
                  else self.lib.sq_prefill(ctypes.byref(self.m), *args))
        self.gov.after_prompt()
        if rc:
            raise MemoryError("sq_prefill could not allocate its activation buffers")
        if self.tap is not None:
            self.tap(int(kvoff), int(pos0), out)
        return out[-1:] if last_only else out

    def head(self, xn, out: np.ndarray | None = None) -> np.ndarray:
        """Logits fp32 [vocab] of one final-normed hidden state (the tail of sq_step)."""
        xn = np.ascontiguousarray(xn, dtype=np.float32).reshape(-1)
        out = self.logits if out is None else out
        self.lib.sq_set_threads(self.gov.threads())
        self.lib.sq_head(ctypes.byref(self.m), self.work, xn.ctypes.data, ptr(out))
        return self._softcap(out)

    # -- continuous batching (csrc/batch.c): sequences in KV slots of one cache --

    def reserve_batch(self, rows: int) -> None:
        """step_many's buffers for ``rows`` sequences, allocated once and kept"""
        if rows <= self.batch_rows:
            return
        if self.batch:
            self.lib.sq_batch_free(self.batch)
        self.batch, self.batch_rows = self.lib.sq_batch_new(ctypes.byref(self.m), int(rows)), int(rows)
        if not self.batch:
            self.batch_rows = 0
            raise MemoryError("sq_batch_new: out of memory")

    def set_batch_tiles(self, min_m: int = 0, *, model: bool = False) -> None:
        """step_many's int4 / lut4 products on AMX-INT8 tiles with 15-bit activations from
        ``min_m`` sequences on (0: off, the default W4A8 products; csrc/gemv_tiles.c). A sequence's
        bits then depend on whether its step had ``min_m`` sequences, not on which. ``model``: the
        portable tile model instead of the hardware (any CPU, slow: tests)."""
        hw = 0 if model or not min_m else 1
        if min_m < 0:
            raise ValueError(f"set_batch_tiles: min_m must be >= 0, got {min_m}")
        if min_m and self.lib.sq_batch_tiles(int(min_m), hw) == -3:
            raise RuntimeUserError("tile products need AMX tiles (an Intel Xeon with amx_int8) and the amx build; "
                                   "this process runs another build: drop the option or set SPARKQ_KERNEL=amx")
        self.tiles = (int(min_m), hw)

    def step_many(self, tokens, positions, kvoffs, rewind: bool = False, hin=None) -> np.ndarray:
        """Decode tokens (token, position, KV slot offset each) through every layer and the head,
        each weight read once: logits fp32 [M, vocab], each row the bits ``step`` gives that token
        in its sequence alone. A sequence may have several rows, adjacent and at consecutive
        positions (a run: its drafted tokens, runtime/speculate.py). ``rewind``: a hybrid model's
        runs can then be cut back to their first rows (``rewind``, before the next call). ``hin``
        [M, hidden]: an MTP block's hidden-state inputs."""
        tok = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1)
        pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
        off = np.ascontiguousarray(kvoffs, dtype=np.int64).reshape(-1)
        if not tok.size == pos.size == off.size:
            raise ValueError("step_many: one position and one KV slot per token")
        if tok.size:
            check_ids((int(tok.min()), int(tok.max())), self.embed_rows)
        self.reserve_batch(tok.size)
        out = np.empty((tok.size, self.vocab), np.float32)
        self.lib.sq_set_threads(self.gov.threads())
        if self.lib.sq_batch_tiles(*self.tiles):
            raise RuntimeUserError("tile products need AMX tiles: this process runs another build")
        self._hold(tok.size, pos, off, rewind)
        args = (ctypes.byref(self.m), self.work, self.batch, tok.size, tok.ctypes.data, pos.ctypes.data, off.ctypes.data)
        if hin is not None:
            hin = np.ascontiguousarray(hin, dtype=np.float32).reshape(tok.size, self.spec.hidden)
            rc = self.lib.sq_step_many_in(*args, hin.ctypes.data, out.ctypes.data)
        else:
            rc = self.lib.sq_step_many(*args, out.ctypes.data)
        if rc == -2:
            raise RuntimeUserError(f"a position of {pos.tolist()} is beyond the KV cache ({self.cap} tokens)")
        if rc == -4:
            raise ValueError("step_many: a sequence's rows must be adjacent, at consecutive positions")
        if rc:
            raise MemoryError("sq_step_many could not allocate its activation buffers")
        if self.tap is not None:
            for a, b in zip(*_runs(pos, off)):
                self.tap(int(off[a]), int(pos[a]), np.stack([self.batch_xn(t) for t in range(a, b)]))
        return self._softcap(out)

    def head_many(self, xn) -> np.ndarray:
        """Logits fp32 [M, vocab] of final-normed hidden states [M, hidden], each row the same
        bits whatever the other rows are."""
        xn = np.ascontiguousarray(xn, dtype=np.float32).reshape(-1, self.spec.hidden)
        out = np.empty((xn.shape[0], self.vocab), np.float32)
        self.lib.sq_set_threads(self.gov.threads())
        if self.lib.sq_head_many(ctypes.byref(self.m), self.work, xn.shape[0], xn.ctypes.data, out.ctypes.data):
            raise MemoryError("sq_head_many could not allocate its activation buffers")
        return self._softcap(out)

    def batch_xn(self, t: int) -> np.ndarray:
        """The final-normed hidden state of row t of the last step_many"""
        out = np.empty(self.spec.hidden, np.float32)
        if self.batch is None or self.lib.sq_batch_xn(ctypes.byref(self.m), self.batch, int(t), out.ctypes.data):
            raise ValueError(f"batch_xn: no row {t} in the last step_many")
        return out

    def head_exact(self, x, ids) -> np.ndarray:
        """Exact logits (the bits the step gives the rows it refines, then the divisor and softcap)
        of the head rows ``ids`` for a final-normed state x [hidden]."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
        out = np.empty(ids.size, np.float32)
        if self.lib.sq_head_exact(ctypes.byref(self.m), x.ctypes.data, ids.ctypes.data, ids.size, out.ctypes.data):
            raise MemoryError("sq_head_exact: out of memory")
        return self._softcap(out)

    def prompt(self, ids, pos0: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """Logits of the last of ``ids`` (at pos0..), every token's K/V cached."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 1 and self.tap is None:
            return self.step(int(ids[0]), pos0, out)
        return self.head(self.prefill(ids, pos0, True), out)


def bf16_scalar(v) -> float:
    """the first value of a bf16 vector (numpy bf16 bits, or a torch tensor)"""
    if isinstance(v, np.ndarray):
        return float(np.array([int(v.reshape(-1)[0]) << 16], np.uint32).view(np.float32)[0])
    return float(v.reshape(-1)[0].float())


def _np(buf) -> np.ndarray:
    """a numpy view of a numpy array or a CPU torch tensor (the same memory)"""
    return buf.numpy() if hasattr(buf, "numpy") and not isinstance(buf, np.ndarray) else buf


def attn_scale(spec) -> float:
    return spec.attn_scale or 1.0 / math.sqrt(spec.head_dim)
