"""The C decode step: one ctypes call per generated token.

``FastDecoder`` describes the loaded model to ``kernels/sq_decode.c`` once (pointers
into the artifact's mapping, the KV cache and the RoPE tables; no weight is copied)
and then runs each decode step as a single call. It applies when every linear is a
rows32 int4, an int8 or a bf16 linear; artifacts in torch's int4 layouts keep the torch
path. Prompts (``FastDecoder.prefill``, ``sq_prefill``) go through the same C core a chunk
of tokens at a time when every layer linear has a W4A8 GEMM (``prefill_supported``): fp32
residual and pointwise parts as the decode step, C attention over the cache. Otherwise
they go through the torch model, whose rows32/int8 linears call the C products
(``attach_linears``). Every path shares the bf16 KV cache.
"""
from __future__ import annotations

import ctypes

import torch
from sparkq.formats.layout import ROWS32

from . import kernels as K
from .common import check_ids
from .model import REFINE_SPLIT, REFINE_TOP
from .weights import DenseLinear, Int4Linear, Int8Linear

KIND = {"int4": 0, "int8": 1, "bf16": 2}


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("C decode path needs contiguous tensors")
    return t.data_ptr()


def supported(model) -> str | None:
    """None if the C step can run this model, else why not."""
    for name, lin in model.lin.items():
        if isinstance(lin, Int4Linear):
            if lin.layout.name != ROWS32:
                return f"{name} is packed in torch's {lin.layout.name} layout (the C path reads rows32)"
        elif not isinstance(lin, (Int8Linear, DenseLinear)):
            return f"{name}: unsupported linear {type(lin).__name__}"
        if lin.k % 32:
            return f"{name}: K={lin.k} is not a multiple of 32"
    return None


PREFILL_CHUNK = K.PREFILL_CHUNK  # tests patch this one


def prefill_supported(model, lib) -> str | None:
    """None if sq_prefill can run this model's prompts with its GEMM, else why not."""
    why = supported(model)
    if why:
        return why
    for name, lin in model.lin.items():
        if not name.startswith("layers."):
            continue
        if isinstance(lin, DenseLinear):
            return f"{name} is bf16 (no W4A8 GEMM)"
        if isinstance(lin, Int4Linear):
            if lin.prefill_dequant is not None:
                return "--prefill kernel/dequant picks the torch prefill"
            if lib.sq_simd() >= 2 and (lin.k % 64 or lin.g % 64):
                return f"{name}: K={lin.k}, g={lin.g} are not multiples of 64 (the SIMD GEMMs pair 64 columns)"
    return None


def _linear(lin, bias: torch.Tensor | None = None) -> K.SqLinear:
    if isinstance(lin, Int4Linear):
        return K.SqLinear(_ptr(lin.qweight), _ptr(lin.scales_zeros), _ptr(bias), KIND["int4"], lin.n, lin.k, lin.g,
                          _ptr(lin.residual), _ptr(lin.rscales))
    if isinstance(lin, Int8Linear):
        return K.SqLinear(_ptr(lin.qweight), _ptr(lin.scales), _ptr(bias), KIND["int8"], lin.n, lin.k, 0)
    w = lin.weight.to(torch.bfloat16).contiguous()
    lin._c_weight = w  # keep alive (a no-op view for bf16 checkpoints)
    b = bias if lin.bias is None else lin.bias
    return K.SqLinear(_ptr(w), None, _ptr(b), KIND["bf16"], lin.n, lin.k, 0)


def attach_linears(model, lib) -> None:
    """Give rows32/int8 linears the C W4A8 kernel for few-row products (short prompts, the
    head of the last position); bf16 linears keep torch's GEMM."""
    for lin in model.lin.values():
        if isinstance(lin, (Int4Linear, Int8Linear)):
            lin.c = (lib, _linear(lin))


class FastDecoder:
    def __init__(self, model, lib, threads: int):
        s, n = model.spec, model.norms
        self.lib, self.model = lib, model
        layers = (K.SqLayer * s.layers)()
        for i in range(s.layers):
            L, cfg = layers[i], model.layer_cfg[i]
            bias = n.get(f"layers.{i}.qkv.bias") if s.qkv_bias else None
            L.qkv = _linear(model.lin[f"layers.{i}.qkv"], bias)
            L.o = _linear(model.lin[f"layers.{i}.o"])
            L.gate_up = _linear(model.lin[f"layers.{i}.gate_up"])
            L.down = _linear(model.lin[f"layers.{i}.down"])
            for f in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"):
                setattr(L, f, _ptr(n.get(f"layers.{i}.{f}.weight")))
            L.cos, L.sin, L.rot = _ptr(cfg.rope.cos), _ptr(cfg.rope.sin), cfg.rope.rotary_dim
            L.kcache, L.vcache = _ptr(model.cache.k[i]), _ptr(model.cache.v[i])
            L.window = cfg.window or 0
        self.layers = layers
        m = self.m = K.SqModel()
        m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim = s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim
        m.inter, m.vocab, m.cap = s.intermediate, model.head.n, model.cache.capacity
        m.act = 0 if s.act == "silu" else 1
        m.norm_offset = int(bool(s.norm_offset))
        # the top logits are recomputed exactly in C, as Model._refine_top / _refine_split do
        m.refine_top = REFINE_SPLIT if getattr(model.head, "residual", None) is not None else REFINE_TOP
        m.eps, m.attn_scale = s.rms_eps, model.scale
        m.embed_mult = float(model.embed_mult) if model.embed_mult is not None else 0.0
        m.layer = ctypes.cast(layers, ctypes.POINTER(K.SqLayer))
        m.head, m.embed = _linear(model.head), _linear(model.embedding)
        m.final_norm = _ptr(n["norm.weight"])
        self.work = lib.sq_work_new(ctypes.byref(m))
        if not self.work:
            raise MemoryError("sq_work_new failed")
        lib.sq_set_threads(threads)
        self.x = torch.empty(s.hidden, dtype=torch.float32)
        self.prefill_off = prefill_supported(model, lib)  # None: prompts go through sq_prefill

    def __del__(self):
        if getattr(self, "work", None):
            self.lib.sq_work_free(self.work)
            self.work = None

    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits fp32 [1, vocab] for one token (the top REFINE_TOP recomputed exactly)."""
        check_ids(token, self.m.embed.n)
        logits = torch.empty(1, self.m.vocab, dtype=torch.float32)
        if self.lib.sq_step(ctypes.byref(self.m), self.work, int(token), int(pos), self.x.data_ptr(), logits.data_ptr()):
            raise IndexError(f"position {pos} is outside the KV cache ({self.m.cap})")
        return logits

    def prefill(self, ids: torch.Tensor, pos0: int, last_only: bool) -> torch.Tensor:
        """Final-normed hidden states fp32 [T or 1, hidden] of prompt tokens at pos0.. (K/V cached)."""
        ids = ids.to(torch.int64).contiguous()
        t = ids.numel()
        check_ids((int(ids.min()), int(ids.max())), self.m.embed.n)
        out = torch.empty(1 if last_only else t, self.m.hidden, dtype=torch.float32)
        rc = self.lib.sq_prefill(ctypes.byref(self.m), ids.data_ptr(), t, int(pos0), PREFILL_CHUNK, out.data_ptr(),
                                 int(not last_only))
        if rc == -2:
            raise IndexError(f"positions {pos0}..{pos0 + t - 1} are outside the KV cache ({self.m.cap})")
        if rc:
            raise MemoryError("sq_prefill could not allocate its activation buffers")
        return out

    def head(self, xn: torch.Tensor) -> torch.Tensor:
        """Logits fp32 [1, vocab] from one final-normed hidden state (as sq_step's last part)."""
        xn = xn.reshape(-1).contiguous()
        logits = torch.empty(1, self.m.vocab, dtype=torch.float32)
        self.lib.sq_head(ctypes.byref(self.m), self.work, xn.data_ptr(), logits.data_ptr())
        return logits
