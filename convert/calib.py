"""Calibration for activation-aware methods (``--method gptq``).

The converter runs the source model itself, layer by layer and in step with the writer:
for each linear it hands out the Hessian ``H = X^T X`` of that linear's inputs, then takes
back the linear's *quantized* weight and moves the activations forward through it, so
later layers are calibrated on what the quantized model really computes (the sequential
variant of GPTQ). Only the current activations (tokens x hidden, fp32) and one linear's
weight live in memory at a time; the model is never materialised.

The math mirrors the runtime's decoder (RMSNorm with optional offset, SwiGLU/GeGLU,
rotate-half RoPE per layer type, causal attention with sliding windows, qk norm, qkv
bias, sandwich norms, embedding scale) in fp32; the two never import each other, so the
shared definitions (RoPE frequencies, shapes) live in ``sparkq.formats.spec``. The quantized
linears' products are the C core's prompt products on the packed weight (``CoreLinear``: what
the runtime computes) where the core is loaded, else float32 GEMMs on the dequantized weight.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sparkq.formats import constants as C
from sparkq.formats.spec import ModelSpec, rope_attention_factor, rope_inv_freq

from .errors import ConvertError

SEQ_LEN = 512


# The default calibration text, written for sparkq (Apache-2.0 like the rest of the project;
# no third-party text): ~34 KB of varied English -- encyclopedic paragraphs, fiction and
# dialogue, chat turns, instructions, code, numbers, letters, a few lines in other scripts.
# About 8,300 tokens with SmolLM2's tokenizer. It is not drawn from the corpus that
# ``sparkq fidelity`` reads, so default conversions are measured on text they never saw.
BUNDLED = Path(__file__).parent / "data" / "calibration.txt"


def has_tokenizer(source) -> bool:
    """Whether the source ships a tokenizer.json (checked without parsing it)."""
    return "tokenizer.json" in source.extra_files or (
        source.directory is not None and (source.directory / "tokenizer.json").is_file())


def source_tokenizer(source):
    """The source's tokenizer (tokenizers.Tokenizer), or None when it ships no tokenizer.json."""
    from tokenizers import Tokenizer

    if "tokenizer.json" in source.extra_files:
        return Tokenizer.from_str(source.extra_files["tokenizer.json"].decode())
    if has_tokenizer(source):
        return Tokenizer.from_file(str(source.directory / "tokenizer.json"))
    return None


def calibration_ids(source, text_path: str | None, tokens: int, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, dict]:
    """Token windows [S, seq_len] and a record of what was used. A given file is read from
    its *second half* (so the first half, where ``sparkq fidelity`` reads by default, stays
    held out); ``text_path=None`` takes the bundled text whole, as many full windows as it
    gives up to ``tokens`` (the count depends on the model's tokenizer)."""
    p = BUNDLED if text_path is None else Path(text_path)
    if not p.is_file():
        raise ConvertError(f"calibration text {p}: no such file; pass --calib FILE (any UTF-8 text)")
    tok = source_tokenizer(source)
    if tok is None:
        raise ConvertError("the source has no tokenizer.json, so calibration text cannot be tokenized; "
                           "use --method clip or add tokenizer.json to the checkpoint")
    raw = p.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    start = 0 if text_path is None else len(text) // 2
    seqs = max(1, math.ceil(tokens / seq_len))
    ids = tok.encode(text[start:start + seqs * seq_len * 12], add_special_tokens=False).ids
    if text_path is None:
        seqs = max(1, min(seqs, len(ids) // seq_len))
    if len(ids) < seqs * seq_len:
        raise ConvertError(f"calibration text {p} gives only {len(ids)} tokens from its second half; "
                           f"need {seqs * seq_len}: lower --calib-tokens or pass a longer file")
    ids = torch.tensor(ids[: seqs * seq_len]).view(seqs, seq_len)
    info = {"file": p.name + (" (bundled)" if text_path is None else ""), "sha256": hashlib.sha256(raw).hexdigest(),
            "start_char": start, "sequences": seqs, "seq_len": seq_len, "tokens": seqs * seq_len}
    return ids, info


GRAM_BLOCK = 1024


def gram(x: torch.Tensor, use_c: bool = True) -> torch.Tensor:
    """X^T X (float32 [K, K]) for X [T, K] (float32, or bf16 read in float32 blocks): for large
    K, only the blocks on and above the diagonal are multiplied (the rest is their transpose),
    about half the work of ``x.T @ x``. bf16 X goes to the C core's vdpbf16ps gram on AVX512-BF16
    builds (``sq_gram_bf16``: the same exact products, summed in another order); this is its
    reference."""
    k, b = x.shape[1], GRAM_BLOCK
    if x.dtype == torch.bfloat16 and use_c:
        from .gptq import _lib

        lib, h = _lib(), torch.empty(k, k)
        x = x.contiguous()
        rc = -2 if lib is None else lib.sq_gram_bf16(x.data_ptr(), x.shape[0], k, h.data_ptr())
        if rc == -1:
            raise MemoryError("the C core could not allocate the Hessian's pair buffer")
        if rc == 0:
            return h
    if x.dtype != torch.float32:
        h = torch.empty(k, k)
        for i in range(0, k, b):
            xi = x[:, i:i + b].float()
            for j in range(i, k, b):
                h[i:i + b, j:j + b] = xi.T @ (xi if j == i else x[:, j:j + b].float())
            h[i + b:, i:i + b] = h[i:i + b, i + b:].T
        return h
    if k <= 2 * b:
        return x.T @ x
    h = torch.empty(k, k)
    for i in range(0, k, b):
        h[i:i + b, i:] = x[:, i:i + b].T @ x[:, i:]
        h[i + b:, i:i + b] = h[i:i + b, i + b:].T
    return h


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * (1.0 + w) if offset else x * w


class RowBlocks:
    """A weight [N, K] that is read ``block`` rows at a time (``rows(r0, r1)``, float32), for a
    product that never holds it whole (the key scaling's forward of the source model)."""

    def __init__(self, rows, n: int, k: int, block: int):
        self.rows, self.shape, self.block = rows, (n, k), block


class CoreLinear:
    """A quantized linear as the artifact stores it (rows32 int4 / lut4 codes with their scales and
    zeros and levels, or int8 rows with their scales), multiplied by the C core's prompt products
    (``sq_linear_batch``): the calibration moves forward through what the runtime computes, several
    times faster than a float32 GEMM over the dequantized weight (docs/quality.md "Conversion
    cost"), and the packed weight is an eighth of that float copy."""

    def __init__(self, lib, kind: str, n: int, k: int, q: np.ndarray, sz: torch.Tensor, g: int = 0,
                 lut: torch.Tensor | None = None):
        from sparkq.runtime.core.abi import SqLinear
        from sparkq.runtime.core.lib import kind_code

        q, sz = np.ascontiguousarray(q), sz.contiguous()
        lut = None if lut is None else lut.contiguous()
        self.lib, self.shape = lib, (n, k)
        self.keep = (q, sz, lut)  # the buffers the descriptor points into
        self.desc = SqLinear(q=q.ctypes.data, sz=sz.data_ptr(), kind=kind_code(lib, kind), n=n, k=k, g=g,
                             lut=None if lut is None else lut.data_ptr())

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32 or bf16 [M, K]) @ W^T -> float32 [M, N]."""
        import ctypes

        x = x.contiguous()
        y = torch.empty(x.shape[0], self.shape[0])
        if self.lib.sq_linear_batch(ctypes.byref(self.desc), x.data_ptr(), int(x.dtype == torch.bfloat16),
                                    x.shape[0], y.data_ptr(), None):
            raise MemoryError("the C core could not allocate the calibration product's buffers")
        return y


def _mm(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T (float32) for a weight tensor (float32, or bf16: a bf16 product), RowBlocks or CoreLinear."""
    if isinstance(w, torch.Tensor):
        return (x.to(torch.bfloat16) @ w.T).float() if w.dtype == torch.bfloat16 else x @ w.T
    if isinstance(w, CoreLinear):
        out = torch.empty(x.shape[0], w.shape[0])
        for t0 in range(0, x.shape[0], SEQ_LEN):  # windows: the activation codes and the result stay small
            out[t0:t0 + SEQ_LEN] = w.mm(x[t0:t0 + SEQ_LEN])
        return out
    out = torch.empty(x.shape[0], w.shape[0])
    for r0 in range(0, w.shape[0], w.block):
        r1 = min(w.shape[0], r0 + w.block)
        out[:, r0:r1] = x @ w.rows(r0, r1).T
    return out


class Calibration:
    """Activations of the partly quantized model, advanced one linear at a time.

    Call ``hessian(name)`` then ``advance(name, w)`` for each linear in file order
    (per layer: qkv, o, gate_up, down; then lm_head)."""

    def __init__(self, source, spec: ModelSpec, srcs: dict, ids: torch.Tensor, threads: int | None = None):
        self.source, self.spec, self.srcs = source, spec, srcs
        self.seqs, self.seq_len = ids.shape
        embed_name = srcs[C.ROLE_EMBED if not spec.tied else C.ROLE_LM_HEAD][0]
        uniq, inverse = ids.reshape(-1).unique(return_inverse=True)  # one read per distinct token
        rows = torch.cat([source.read_rows(embed_name, t, t + 1) for t in uniq.tolist()]).float()
        self.x = rows[inverse]
        if spec.embed_scale:
            self.x *= torch.tensor(spec.hidden ** 0.5).to(torch.bfloat16).float()
        self.inp: torch.Tensor | None = None  # input of the next linear
        self.inp_of: str | None = None  # the linear self.inp was computed for by inputs()
        # linear name -> (sequence j, E [N, K]): that sequence's tokens see W - E there instead of W
        # (convert/sensitivity.py); the relative output error it made goes into self.rel_error
        self.errors: dict[str, tuple[int, torch.Tensor]] = {}
        self.rel_error: dict[str, float] = {}
        pos = torch.arange(self.seq_len, dtype=torch.float32)
        self.rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(spec.layers):
            theta, rot, _ = spec.layer_attention(i)
            key = spec.layer_rope_key(i)
            if key not in self.rope:
                f = torch.outer(pos, torch.from_numpy(rope_inv_freq(spec, rot, theta, i)))
                emb = torch.cat([f, f], -1)
                att = rope_attention_factor(spec, i)  # YaRN scales cos and sin
                self.rope[key] = (emb.cos() * att, emb.sin() * att)

    def _vec(self, name: str) -> torch.Tensor:
        parts = [self.source.read_rows(p, 0, self.source.shapes[p][0]) for p in self.srcs[name]]
        return torch.cat(parts).float()

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return _rms(x, self._vec(name), self.spec.rms_eps, self.spec.norm_offset)

    def inputs(self, name: str) -> torch.Tensor:
        """X (float32 [tokens, K]): the inputs the linear ``name`` sees."""
        layer, _, role = name.rpartition(".")
        if self.inp_of == name:  # asked again before the forward moved (key scaling, then the Hessian)
            return self.inp
        if role in (C.ROLE_QKV, C.ROLE_GATE_UP) or name == C.ROLE_LM_HEAD:
            self.inp = None  # before the next one is computed: one copy at a time
        if role == C.ROLE_QKV:
            self.inp = self._norm(self.x, f"{layer}.attn_norm.weight")
        elif role == C.ROLE_GATE_UP:
            self.inp = self._norm(self.x, f"{layer}.mlp_norm.weight")
        elif name == C.ROLE_LM_HEAD:
            self.inp = self._norm(self.x, "norm.weight")
        assert self.inp is not None, f"inputs({name}) out of order"
        self.inp_of = name
        return self.inp

    def hessian(self, name: str) -> torch.Tensor:
        """H = X^T X (float32 [K, K]) of the inputs the linear ``name`` sees."""
        return gram(self.inputs(name))

    def importance(self, name: str) -> torch.Tensor:
        """diag(X^T X) (float32 [K]): how much each input of ``name`` fires (llama.cpp's imatrix)."""
        x, t = self.inputs(name), self.seq_len
        return sum(x[t0:t0 + t].float().pow(2).sum(0) for t0 in range(0, x.shape[0], t))

    def perturb(self, name: str, x: torch.Tensor, y: torch.Tensor, t0: int = 0) -> torch.Tensor:
        """y = x W^T (rows t0.. of the batch's tokens), with W - E on sequence j's rows where
        ``self.errors`` names this linear (in place)."""
        if name not in self.errors:
            return y
        j, e = self.errors[name]
        a, b = max(0, j * self.seq_len - t0), min(y.shape[0], (j + 1) * self.seq_len - t0)
        if a < b:
            d = x[a:b].float() @ e.T
            self.rel_error[name] = float(d.pow(2).sum(dtype=torch.float64) / y[a:b].pow(2).sum(dtype=torch.float64))
            y[a:b] -= d
        return y

    def advance(self, name: str, w) -> None:
        """Move the activations through the quantized linear ``name`` (w: float32 [N, K],
        ``RowBlocks`` read a block at a time, or the packed ``CoreLinear``)."""
        s = self.spec
        self.inp_of = None
        layer, _, role = name.rpartition(".")
        if role not in C.LAYER_LINEARS:  # the head ends the forward: no logits needed
            self.inp = None
            return
        if role == C.ROLE_GATE_UP:  # per window: the [tokens, 2*intermediate] product is the largest transient
            # the down projection's inputs, the largest activations, kept in bf16 (their Hessian and
            # product read them in float32 blocks): -150 MB peak at 1.5B, far finer than the W4A8 runtime
            act = F.silu if s.act == "silu" else lambda g: F.gelu(g, approximate="tanh")
            half = w.shape[0] // 2
            out = torch.empty(self.inp.shape[0], half, dtype=torch.bfloat16)
            if isinstance(w, RowBlocks):  # gate and up rows a block at a time: no [tokens, 2I] product
                assert not self.errors, "a weight error needs the whole product"
                for j0 in range(0, half, w.block):
                    j1 = min(half, j0 + w.block)
                    out[:, j0:j1] = act(self.inp @ w.rows(j0, j1).T) * (self.inp @ w.rows(half + j0, half + j1).T)
                self.inp = out
                return
            for t0 in range(0, out.shape[0], self.seq_len):
                x = self.inp[t0:t0 + self.seq_len]
                g, u = self.perturb(name, x, _mm(x, w), t0).chunk(2, dim=-1)
                out[t0:t0 + self.seq_len] = act(g) * u
            self.inp = out
            return
        if self.inp.dtype == torch.float32 or isinstance(w, CoreLinear):  # (the C core reads bf16 rows itself)
            y = _mm(self.inp, w)
        else:
            y = torch.empty(self.inp.shape[0], w.shape[0])
            step = 128 if isinstance(w, RowBlocks) else self.seq_len  # (blocks re-read: the float copy stays small)
            for t0 in range(0, y.shape[0], step):
                y[t0:t0 + step] = _mm(self.inp[t0:t0 + step].float(), w)
        y = self.perturb(name, self.inp, y)
        if role == C.ROLE_QKV:
            if s.qkv_bias:
                y += self._vec(f"{layer}.qkv.bias")
            self.inp = self._attention(int(layer.split(".")[1]), y)
        else:  # o, down: residual add
            if s.sandwich_norms:
                y = self._norm(y, f"{layer}.{'post_attn_norm' if role == C.ROLE_O else 'post_mlp_norm'}.weight")
            self.x += y
            self.inp = None

    def _attention(self, i: int, qkv: torch.Tensor) -> torch.Tensor:
        s, n, t = self.spec, self.seqs, self.seq_len
        q, k, v = qkv.split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
        q = q.reshape(n, t, s.heads, s.head_dim)
        k = k.reshape(n, t, s.kv_heads, s.head_dim)
        v = v.reshape(n, t, s.kv_heads, s.head_dim)
        if s.qk_norm:
            q = self._norm(q, f"layers.{i}.q_norm.weight")
            k = self._norm(k, f"layers.{i}.k_norm.weight")
        theta, rot, window = s.layer_attention(i)
        cos, sin = self.rope[s.layer_rope_key(i)]
        q, k = self._rotate(q, cos, sin, rot), self._rotate(k, cos, sin, rot)
        pos = torch.arange(t)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        out = torch.empty(n, t, s.heads, s.head_dim)
        grp = s.heads // s.kv_heads
        for j in range(n):  # one window and one KV head's query group at a time bounds the score transients
            for h in range(s.kv_heads):
                qh = q[j, :, h * grp:(h + 1) * grp].transpose(0, 1)
                kh, vh = k[j, :, h:h + 1].transpose(0, 1), v[j, :, h:h + 1].transpose(0, 1)
                o = F.scaled_dot_product_attention(qh, kh.expand(grp, -1, -1), vh.expand(grp, -1, -1), attn_mask=mask,
                                                   scale=s.attn_scale or 1.0 / math.sqrt(s.head_dim))
                out[j, :, h * grp:(h + 1) * grp] = o.transpose(0, 1)
        return out.view(n * t, s.q_dim)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
        xr, h = x[..., :r], r // 2
        rot = torch.cat([-xr[..., h:], xr[..., :h]], dim=-1)
        out = xr * cos[:, None, :] + rot * sin[:, None, :]
        return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)
