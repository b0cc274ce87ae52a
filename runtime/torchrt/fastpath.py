"""The torch runtime's use of the C core: which models it can run, and the Session over the
torch model's tensors.

The decode step goes through the C core (``core.Session``: pointers into the artifact's
mapping, the KV cache and the RoPE tables; no weight is copied; one call per token) when every
linear is a rows32 int4, an int8 or a bf16 linear; artifacts in torch's int4 layouts keep the
torch path. Prompts go through the same C core (``sq_prefill``) when every layer linear has a
C prompt GEMM (``prefill_supported``); otherwise through the torch model, whose rows32/int8
linears call the C products (``attach_linears``). Every path shares the KV cache (bf16, or int8
codes + scales: the same buffers and arithmetic in C and torch).
"""
from __future__ import annotations

from sparkq.formats import constants as C
from sparkq.formats.layout import ROWS32

from .. import core
from ..common import by_layer, core_lacks
from .weights import DenseLinear, Int4Linear, Int8Linear, c_gemm_pairs


def supported(model) -> str | None:
    """None if the C step can run this model, else why not."""
    return core_lacks(model.spec) or linears_supported(model)


def linears_supported(model) -> str | None:
    """None if the C products can multiply every linear of this model, else why not."""
    for name, lin in model.lin.items():
        if isinstance(lin, Int4Linear):
            if lin.layout.name != ROWS32:
                return f"{name} is packed in torch's {lin.layout.name} layout (the C path reads rows32)"
        elif not isinstance(lin, (Int8Linear, DenseLinear)):
            return f"{name}: unsupported linear {type(lin).__name__}"
        if lin.k % 32:
            return f"{name}: K={lin.k} is not a multiple of 32"
    return None


def prefill_supported(model, lib) -> str | None:
    """None if sq_prefill can run this model's prompts with its GEMM, else why not."""
    why = supported(model)
    if why:
        return why
    for name, lin in model.lin.items():
        if not name.startswith("layers."):
            continue
        if isinstance(lin, DenseLinear) and not name.endswith("." + C.ROLE_GATE):  # (the gate's few rows: per token)
            return f"{name} is bf16 (no W4A8 GEMM)"
        if isinstance(lin, Int4Linear):
            if lin.prefill_dequant is not None:
                return "--prefill kernel/dequant picks the torch prefill"
            if lib.sq_simd() >= 2 and not c_gemm_pairs(lin.k, lin.g):
                return f"{name}: K={lin.k}, g={lin.g}: the SIMD GEMMs pair 64 columns (K a multiple of 64, g 32 or a multiple of 64)"
    return None


def clinear(lin) -> core.CLinear:
    """A torch-runtime linear's buffers for the C core (a bf16 one as contiguous bf16)."""
    return core.clinear(lin.kind, lin.n, lin.k, getattr(lin, "g", None), lin.tensor, bias=getattr(lin, "bias", None))


def session(model, lib, threads: int, pinned: bool = False) -> core.Session:
    """The C core over the torch model's tensors (linears, norms, RoPE tables, KV cache)."""
    ropes = [(cfg.rope.cos, cfg.rope.sin) for cfg in model.layer_cfg]
    embed_mult = model.embed_mult or 0.0
    return core.Session(lib, model.spec, {n: clinear(lin) for n, lin in model.lin.items()}, model.norms, ropes,
                        by_layer(model.spec, model.cache.k), by_layer(model.spec, model.cache.v), model.cache.capacity,
                        threads=threads, attn_scale=model.scale, embed_mult=embed_mult,
                        kscale=by_layer(model.spec, model.cache.k_scale), vscale=by_layer(model.spec, model.cache.v_scale),
                        pinned=pinned,
                        states=[tuple(st.values()) if st else None for st in model.state])


def attach_linears(model, lib) -> None:
    """Give rows32/int8 linears the C W4A8 kernel for few-row products (short prompts, the
    head of the last position); bf16 linears keep torch's GEMM."""
    for lin in model.lin.values():
        if isinstance(lin, (Int4Linear, Int8Linear)):
            lin.c = (lib, core.linear_struct(lib, clinear(lin)))
