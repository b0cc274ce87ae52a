"""The torch decoder over its KV cache: the layer math of layers.py (shared with the converter's
calibration) around swappable linears (weights.py: a mapped artifact's kinds, or ``DenseLinear``
for a bf16 checkpoint). Per-layer attention settings (``LayerCfg``: RoPE table, sliding window)
are data, so families that vary them per layer are additions, not a second model. Batch size 1;
activations bf16, 2-D ``[tokens, features]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from sparkq.formats import constants as C
from sparkq.formats.rope import rope_tables_bf16
from sparkq.formats.mixers import mixer_state
from sparkq.formats.spec import ModelSpec

from ..common import DEFAULT_KV_DTYPE, REFINE_SPLIT, REFINE_TOP, check_fits, check_kv_dtype, kv_bytes_per_token
from ..errors import RuntimeUserError
from .layers import Layers, attend, rotate


class Rope:
    """cos/sin tables sized to max_model_len (never max_position_embeddings), bf16 [L, rotary_dim]."""

    def __init__(self, spec: ModelSpec, max_len: int, layer: int):
        theta, rotary_dim, _ = spec.layer_attention(layer)
        cos, sin = rope_tables_bf16(spec, max_len, rotary_dim, theta, layer)  # shared with runtime/lite/model.py
        self.cos = torch.from_numpy(cos.view(np.int16)).view(torch.bfloat16)
        self.sin = torch.from_numpy(sin.view(np.int16)).view(torch.bfloat16)
        self.rotary_dim = rotary_dim
        self.key = spec.layer_rope_key(layer)

    def apply(self, x: torch.Tensor, pos0: int) -> torch.Tensor:
        """x: [T, heads, D] -> rotated (first rotary_dim features)."""
        t = x.shape[0]
        return rotate(x, self.cos[pos0:pos0 + t, None, :], self.sin[pos0:pos0 + t, None, :])

    @property
    def nbytes(self) -> int:
        return self.cos.numel() * 2 + self.sin.numel() * 2


@dataclass
class LayerCfg:
    rope: Rope
    window: int | None = None  # sliding window (tokens), None = full attention


class KVCache:
    """Allocated once: k and v [layers, kv_heads, capacity, head_dim], bf16, or int8 codes with
    bf16 scales k_scale, v_scale [layers, kv_heads, capacity] (one per position and KV head; the
    C core's layout, csrc/sq_abi.h, which reads and writes these same buffers). Layers of different
    head dims (Gemma 4): lists of per-layer [kv_heads, capacity, head_dim] instead."""

    def __init__(self, spec: ModelSpec, capacity: int, dtype: str = DEFAULT_KV_DTYPE):
        # the attention layers' caches, in order (spec.kv_layers); layer -> its index here
        self.index = {layer: j for j, layer in enumerate(spec.kv_layers)}
        shape = (len(spec.kv_layers), spec.kv_heads, capacity, spec.head_dim)
        # empty, not zeros: pages are touched only as tokens are written (zeroing 192 MiB cost
        # 0.29 s of load and made the whole budget resident); no read ever reaches an unwritten
        # position (attention reads [start, end) after writing up to end)
        self.dtype = check_kv_dtype(dtype)
        dt = torch.bfloat16 if dtype == "bf16" else torch.int8

        def alloc(d, last=True):
            if not spec.head_dims:
                return torch.empty(shape if last else shape[:-1], dtype=d)
            return [torch.empty((spec.kv_heads, capacity, spec.hd(i)) if last else (spec.kv_heads, capacity), dtype=d)
                    for i in spec.kv_layers]
        self.k, self.v = alloc(dt), alloc(dt)
        self.k_scale = self.v_scale = None
        if dtype == "int8":
            self.k_scale, self.v_scale = alloc(torch.bfloat16, False), alloc(torch.bfloat16, False)
        self.capacity = capacity

    @staticmethod
    def bytes_per_token(spec: ModelSpec, dtype: str = DEFAULT_KV_DTYPE) -> int:
        return kv_bytes_per_token(spec, dtype)

    @property
    def nbytes(self) -> int:
        parts = [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        return sum(t.numel() * t.element_size() for p in parts for t in (p if isinstance(p, list) else [p]))

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [..., D] -> int8 codes and bf16 scales [...]: the C core's quant_row_q8 (s =
        bf16(max|x| / 127), code = round-half-even(x / s) within +-127, 0 where s is 0)"""
        xf = x.float()
        s = (xf.abs().amax(-1) / 127).to(torch.bfloat16)
        sf = s.float()[..., None]
        q = torch.where(sf > 0, xf / torch.where(sf > 0, sf, 1), 0).round_().clamp_(-127, 127).to(torch.int8)
        return q, s

    def write(self, layer: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [kv_heads, T, D] of positions pos0.. into the layer's cache"""
        end, layer = pos0 + k.shape[1], self.index[layer]
        if self.dtype == "bf16":
            self.k[layer][:, pos0:end] = k
            self.v[layer][:, pos0:end] = v
            return
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = self.quantize(x)
            codes[layer][:, pos0:end] = q
            scales[layer][:, pos0:end] = s

    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys and values [kv_heads, end - start, D] in bf16 (int8: code * scale in fp32, rounded)"""
        layer = self.index[layer]
        if self.dtype == "bf16":
            return self.k[layer][:, start:end], self.v[layer][:, start:end]
        return tuple((c[layer][:, start:end].float() * s[layer][:, start:end, None].float()).to(torch.bfloat16)
                     for c, s in ((self.k, self.k_scale), (self.v, self.v_scale)))


class Model:
    def __init__(self, spec: ModelSpec, linears: dict, norms: dict[str, torch.Tensor], *,
                 max_model_len: int, kv_capacity: int, rope_len: int | None = None, kv_dtype: str = DEFAULT_KV_DTYPE):
        self.spec = spec
        self.lin = linears
        self.norms = norms
        self.max_model_len = max_model_len
        self.embedding = linears["embed"] if "embed" in linears else linears["lm_head"]
        self.head = linears["lm_head"]
        ropes: dict[tuple, Rope] = {}  # one table per distinct spec.layer_rope_key, shared by its layers
        self.layer_cfg = []
        for i in range(spec.layers):
            _, _, window = spec.layer_attention(i)
            key = spec.layer_rope_key(i)
            if key not in ropes:
                ropes[key] = Rope(spec, rope_len or max_model_len, i)
            self.layer_cfg.append(LayerCfg(ropes[key], window))
        self.ropes = list(ropes.values())
        self.cache = KVCache(spec, kv_capacity, kv_dtype)
        # the recurrent mixers' state of the one sequence (formats/mixers.py: per layer its buffers,
        # [1, ...] fp32, the C core's too), started afresh by a forward from position 0
        self.state = mixer_state(spec, 1, lambda shape: torch.zeros(shape, dtype=torch.float32))
        self.layers = Layers(spec, norms.__getitem__)  # the math between the products (layers.py)
        self.scale = self.layers.scale
        self.embed_mult = spec.embed_mult  # Gemma's sqrt(hidden) in bf16, Granite's, or None
        self.fast = None  # core.Session (runtime/torchrt/fastpath.py) when the C decode step applies
        self.prefill_off: str | None = "no C core"  # why prompts do not go through the C core (None: they do)
        self.c_prefill = True  # prompts through the C core where prefill_off is None (False: the torch prefill)

    @property
    def capacity(self) -> int:
        return min(self.cache.capacity, self.max_model_len)

    def check_fits(self, total_tokens: int) -> None:
        check_fits(total_tokens, self.max_model_len, self.cache.capacity)

    def _attention(self, i: int, x: torch.Tensor, pos0: int) -> torch.Tensor:
        s, t = self.spec, x.shape[0]
        q, k, v = self.layers.qkv_heads(self.lin[f"layers.{i}.qkv"](x), i)
        cfg = self.layer_cfg[i]
        q = cfg.rope.apply(q, pos0)
        end = pos0 + t
        if k is not None:  # (a KV-sharing layer reads the cache its source layer just wrote)
            self.cache.write(i, pos0, cfg.rope.apply(k, pos0).transpose(0, 1), v.transpose(0, 1))
        start = 0 if cfg.window is None else max(0, end - cfg.window - t + 1)
        keys, vals = self.cache.read(s.kv_from[i] if s.kv_from else i, start, end)
        g = self.lin[f"layers.{i}.{C.ROLE_GATE}"](x) if s.attn_gate else None
        if t == 1:  # decode: the cache slice is exactly the visible window, no mask needed
            o = self._decode_attention(q, keys, vals)
        else:
            o = attend(q.transpose(0, 1), keys, vals, pos0, start, cfg.window, self.scale).transpose(0, 1).reshape(t, -1)
        return self.lin[f"layers.{i}.o"](self.layers.gate(o, g))

    def _recurrent(self, i: int, x: torch.Tensor, pos0: int, roles=(C.ROLE_QKV, C.ROLE_GATE, C.ROLE_O)) -> torch.Tensor:
        """a recurrent mixer (formats/mixers.py) over the sequence's state, emptied at position 0;
        roles: its linears (a parallel layer's Mamba-2 branch: ssm_in, ssm_gate, ssm_out)"""
        st = self.state[i]
        if pos0 == 0:
            for t in st.values():
                t.zero_()
        gate = self.lin.get(f"layers.{i}.{roles[1]}")
        o, after = self.layers.recurrent(i, self.lin[f"layers.{i}.{roles[0]}"](x)[None], None if gate is None else gate(x)[None], st)
        for n, t in after.items():
            st[n].copy_(t)
        return self.lin[f"layers.{i}.{roles[2]}"](o[0])

    def _decode_attention(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """One query token, GQA as a grouped matmul (SDPA takes its slow math path for this
        shape on CPU): q [1, H, D], keys/vals [KV, L, D] -> [1, H*D]."""
        s = self.spec
        qg = q.view(s.kv_heads, s.heads // s.kv_heads, q.shape[-1])
        att = torch.matmul(qg, keys.transpose(1, 2)).float().mul_(self.scale).softmax(-1)
        o = torch.matmul(att.to(vals.dtype), vals)  # [KV, G, D]
        return o.reshape(1, -1)

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.lin[f"layers.{i}.down"](self.layers.glu(self.lin[f"layers.{i}.gate_up"](x)))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos0: int, last_only: bool = True) -> torch.Tensor:
        """ids: int64 [T] at positions pos0..pos0+T-1; returns float32 logits [T or 1, vocab]."""
        s = self.spec
        if self.fast is not None and ids.numel() == 1:  # the C step; top logits exact, softcap applied
            out = torch.empty(1, self.head.n, dtype=torch.float32)
            self.fast.step(int(ids[0]), pos0, out=out.numpy()[0])
            return out
        if self.fast is not None and self.prefill_off is None and self.c_prefill:
            self.check_fits(pos0 + ids.numel())
            if last_only:  # the head of the last position in C, as the decode step's: what
                # runtime/lite/model.py does, so both runtimes give the same logits and tokens
                out = torch.empty(1, self.head.n, dtype=torch.float32)
                self.fast.prompt(ids.numpy(), pos0, out=out.numpy()[0])
                return out
            x = torch.from_numpy(self.fast.prefill(ids.numpy(), pos0, False))  # fp32, final-normed
            return self._head(x if getattr(self.head, "c", None) is not None else x.to(torch.bfloat16))
        x = self.embedding.embed(ids)
        if self.embed_mult is not None:
            x = x * self.embed_mult
        lay = self.layers
        ple = lay.ple_inputs(self.lin[C.ROLE_PLE_EMBED].embed(ids), self.lin[C.ROLE_PLE_MODEL](x)) if s.ple_dim else None
        for i in range(s.layers):
            mix = self._attention if s.has_attention(i) else self._recurrent
            h = lay.attn_in(x, i)
            x = lay.residual(x, mix(i, h, pos0), i, C.ROLE_O)
            if s.mixers[i] == C.MIXER_PARALLEL:  # its Mamba-2 branch, from the same normed input
                x = lay.residual(x, self._recurrent(i, h, pos0, (C.ROLE_SSM_IN, C.ROLE_SSM_GATE, C.ROLE_SSM_OUT)), i, C.ROLE_O)
            if s.has_mlp(i):
                x = lay.residual(x, self._mlp(i, lay.mlp_in(x, i)), i, C.ROLE_DOWN)
            if ple is not None or s.layer_scalar:
                x = lay.ple_branch(x, i, None if ple is None else ple[:, i], self.lin.get(f"layers.{i}.{C.ROLE_PLE_GATE}"),
                                   self.lin.get(f"layers.{i}.{C.ROLE_PLE_PROJ}"))
        if last_only:
            x = x[-1:]
        return self._head(lay.final(x).contiguous())

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x, out_dtype=torch.float32)
        if getattr(self.head, "residual", None) is not None:
            self._refine_split(logits, x)
        elif self.head.uses_kernel(x.shape[0]):
            self._refine_top(logits, x)
        return self.layers.logits(logits)

    def _refine_top(self, logits: torch.Tensor, x: torch.Tensor) -> None:
        """Recompute the top REFINE_TOP logits of each row in fp32.

        A bf16 logit near 20 has a resolution of 0.125, so greedy decoding from bf16
        logits ties and flips between numerically different paths; the few candidates
        that matter are recomputed exactly from their (gathered) weight rows."""
        k = min(REFINE_TOP, logits.shape[-1])
        cand = logits.topk(k, dim=-1).indices  # [T, k]
        w = self.head.rows(cand.reshape(-1), torch.float32).view(*cand.shape, -1)  # [T, k, D]
        exact = torch.einsum("td,tkd->tk", x.float(), w)
        logits.scatter_(1, cand, exact)

    def _refine_split(self, logits: torch.Tensor, x: torch.Tensor) -> None:
        """A split head (formats/constants.py): the product above read its first plane only; the
        REFINE_SPLIT largest logits of each row are recomputed in fp32 from both planes, as the
        C core does (sq_step / sq_head)."""
        k = min(REFINE_SPLIT, logits.shape[-1])
        cand = logits.topk(k, dim=-1).indices  # [T, k]
        if x.shape[0] <= 4:  # gather the candidates' rows
            w = self.head.rows(cand.reshape(-1), torch.float32).view(*cand.shape, -1)
            exact = torch.einsum("td,tkd->tk", x.float(), w)
        else:  # many positions: every logit exactly, row block by row block, then pick
            exact = self.head.exact(x).gather(1, cand)
        logits.scatter_(1, cand, exact)

    def logits(self, token_ids) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] (float32) for a sequence starting at position 0."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise RuntimeUserError("logits() needs at least one token")
        self.check_fits(ids.numel())
        return self.forward(ids, 0, last_only=False)
