"""Calibration for activation-aware methods (``--method gptq``).

The converter runs the source model itself, layer by layer and in step with the writer:
for each linear it hands out the Hessian ``H = X^T X`` of that linear's inputs, then takes
back the linear's *quantized* weight and moves the activations forward through it, so
later layers are calibrated on what the quantized model really computes (the sequential
variant of GPTQ). Only the current activations (tokens x hidden, fp32) and one linear's
weight live in memory at a time; the model is never materialised.

The layer math is the torch runtime's own (``sparkq.runtime.torchrt.layers``: norms, RoPE,
attention with windows, the gated MLP, sandwich norms, embedding scale), run here in fp32 over
whole windows; RoPE tables come from ``sparkq.formats.rope``. The quantized linears' products are
the C core's prompt products on the packed weight (``CoreLinear``: what the runtime computes)
where the core is loaded, else float32 GEMMs on the dequantized weight.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from sparkq.formats import constants as C
from sparkq.formats.spec import ModelSpec
from sparkq.runtime.torchrt.layers import Layers, attend, rope_cos_sin, rotate

from .ccore import CoreLinear
from .ccore import lib as core_lib
from .errors import ConvertError

SEQ_LEN = 512


# The default calibration text, written for sparkq (Apache-2.0 like the rest of the project;
# no third-party text): ~34 KB of varied English -- encyclopedic paragraphs, fiction and
# dialogue, chat turns, instructions, code, numbers, letters, a few lines in other scripts.
# About 8,300 tokens with SmolLM2's tokenizer. It is not drawn from the corpus that
# ``sparkq fidelity`` reads, so default conversions are measured on text they never saw.
BUNDLED = Path(__file__).parent / "data" / "calibration.txt"


def uncalibrated(config: dict) -> str | None:
    """What in a config the calibration forward does not run (None: it runs the model): Gemma 4's
    per-layer inputs and shared KV caches."""
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if c.get("hidden_size_per_layer_input") or c.get("num_kv_shared_layers"):
        return "per-layer inputs or shared KV caches (Gemma 4)"
    return None


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
        lib, h = core_lib(), torch.empty(k, k)
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


class RowBlocks:
    """A weight [N, K] that is read ``block`` rows at a time (``rows(r0, r1)``, float32), for a
    product that never holds it whole (the key scaling's forward of the source model)."""

    def __init__(self, rows, n: int, k: int, block: int):
        self.rows, self.shape, self.block = rows, (n, k), block


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
        if spec.embed_mult is not None:
            self.x *= spec.embed_mult
        self.inp: torch.Tensor | None = None  # input of the next linear
        self.inp_of: str | None = None  # the linear self.inp was computed for by inputs()
        self.mix_in: torch.Tensor | None = None  # a parallel layer's normed input, for its Mamba-2 branch
        # linear name -> (sequence j, E [N, K]): that sequence's tokens see W - E there instead of W
        # (convert/sensitivity.py); the relative output error it made goes into self.rel_error
        self.errors: dict[str, tuple[int, torch.Tensor]] = {}
        self.rel_error: dict[str, float] = {}
        self.layers = Layers(spec, self._vec)  # the runtime's layer math (runtime/torchrt/layers.py)
        self.rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(spec.layers):
            key = spec.layer_rope_key(i)
            if key not in self.rope:
                cos, sin = rope_cos_sin(spec, i, self.seq_len)
                self.rope[key] = (cos[:, None, :], sin[:, None, :])

    def _vec(self, name: str) -> torch.Tensor:
        parts = [self.source.read_rows(p, 0, self.source.shapes[p][0]) for p in self.srcs[name]]
        v = torch.cat(parts).float()
        shapes = self.spec.vector_shapes()
        return v.reshape(shapes[name]) if name in shapes else v  # (a conv weight [C, 1, K] as [C, K])

    def extend(self, x: torch.Tensor) -> int:
        """Append whole sequences (rows: a multiple of seq_len) to the stream, e.g. copies that will
        see a perturbed weight (convert/sensitivity.py); returns the first new sequence's index."""
        assert x.shape[0] % self.seq_len == 0, "whole sequences only"
        first = self.seqs
        self.x = torch.cat([self.x, x])
        self.seqs += x.shape[0] // self.seq_len
        return first

    def set_error(self, name: str, seq: int, e: torch.Tensor) -> None:
        """Sequence ``seq`` sees W - e at the linear ``name`` (its relative output error goes into
        ``rel_error[name]``), for the next ``advance(name, ...)`` only."""
        self.errors[name] = (seq, e)

    def final_states(self) -> torch.Tensor:
        """The stream after the last layer, final-normed: the head's inputs."""
        return self.layers.final(self.x)

    def inputs(self, name: str) -> torch.Tensor:
        """X (float32 [tokens, K]): the inputs the linear ``name`` sees."""
        layer, _, role = name.rpartition(".")
        if self.inp_of == name:  # asked again before the forward moved (key scaling, then the Hessian)
            return self.inp
        if role in (C.ROLE_QKV, C.ROLE_GATE, C.ROLE_GATE_UP) or name == C.ROLE_LM_HEAD:
            self.inp = None  # before the next one is computed: one copy at a time
        if role in (C.ROLE_QKV, C.ROLE_GATE):  # (the gate reads the mixer's input too)
            self.inp = self.layers.attn_in(self.x, int(layer.split(".")[1]))
            # a parallel layer's Mamba-2 branch reads the same normed input after attention's output is in
            self.mix_in = self.inp if self.spec.mixers[int(layer.split(".")[1])] == C.MIXER_PARALLEL else None
        elif role in (C.ROLE_SSM_IN, C.ROLE_SSM_GATE):
            self.inp = self.mix_in
        elif role == C.ROLE_GATE_UP:
            self.inp = self.layers.mlp_in(self.x, int(layer.split(".")[1]))
        elif name == C.ROLE_LM_HEAD:
            self.inp = self.final_states()
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
        ``RowBlocks`` read a block at a time, or the packed ``CoreLinear``); a ``set_error`` for
        it applies to this pass only."""
        try:
            self._advance(name, w)
        finally:
            self.errors.pop(name, None)

    def _advance(self, name: str, w) -> None:
        self.inp_of = None
        layer, _, role = name.rpartition(".")
        if role not in C.FORWARD_LINEARS:  # the head ends the forward: no logits needed
            self.inp = None
            return
        if role == C.ROLE_GATE_UP:  # per window: the [tokens, 2*intermediate] product is the largest transient
            # the down projection's inputs, the largest activations, kept in bf16 (their Hessian and
            # product read them in float32 blocks): -150 MB peak at 1.5B, far finer than the W4A8 runtime
            act = self.layers.act
            half = w.shape[0] // 2 if self.spec.gated_mlp else w.shape[0]  # (relu2: up rows alone)
            out = torch.empty(self.inp.shape[0], half, dtype=torch.bfloat16)
            if isinstance(w, RowBlocks) and not self.spec.gated_mlp:
                for j0 in range(0, half, w.block):
                    out[:, j0:min(half, j0 + w.block)] = act(self.inp @ w.rows(j0, min(half, j0 + w.block)).T)
                self.inp = out
                return
            if isinstance(w, RowBlocks):  # gate and up rows a block at a time: no [tokens, 2I] product
                assert not self.errors, "a weight error needs the whole product"
                for j0 in range(0, half, w.block):
                    j1 = min(half, j0 + w.block)
                    out[:, j0:j1] = act(self.inp @ w.rows(j0, j1).T) * (self.inp @ w.rows(half + j0, half + j1).T)
                self.inp = out
                return
            for t0 in range(0, out.shape[0], self.seq_len):
                x = self.inp[t0:t0 + self.seq_len]
                out[t0:t0 + self.seq_len] = self.layers.glu(self.perturb(name, x, _mm(x, w), t0))
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
        i = int(layer.split(".")[1])
        if role == C.ROLE_SSM_IN:  # a parallel layer's Mamba-2 branch (its z | dt from ssm_gate's bf16 rows)
            n, t = self.seqs, self.seq_len
            zdt = (self.inp.float() @ self._vec(f"layers.{i}.{C.ROLE_SSM_GATE}").to(torch.bfloat16).float().T).view(n, t, -1)
            self.inp = self.layers.recurrent(i, y.view(n, t, -1), zdt, None)[0].reshape(n * t, -1)
            self.mix_in = None
        elif role == C.ROLE_QKV and self.spec.mixers[i] not in (C.MIXER_ATTENTION, C.MIXER_PARALLEL):
            # a recurrent mixer: its gate linear (if any: GDN's z | b | a, Mamba's z | dt) from the
            # mixer's input, its bf16 weight as stored (the pipeline quantizes it uncalibrated, as the
            # attention output gate); each window from an empty state
            n, t = self.seqs, self.seq_len
            zba = None
            if C.ROLE_GATE in self.spec.roles(i):
                zba = (self.inp.float() @ self._vec(f"layers.{i}.{C.ROLE_GATE}").to(torch.bfloat16).float().T).view(n, t, -1)
            self.inp = self.layers.recurrent(i, y.view(n, t, -1), zba, None)[0].reshape(n * t, -1)
        elif role == C.ROLE_QKV:
            g = None
            if self.spec.attn_gate:  # the output gate, from the attention's input (its bf16 weight as stored)
                g = self.inp.float() @ self._vec(f"layers.{i}.{C.ROLE_GATE}").to(torch.bfloat16).float().T
            self.inp = self.layers.gate(self._attention(i, y), g)
        else:  # o, down, ssm_out: residual add
            self.x += self.layers.branch(y, i, C.ROLE_O if role == C.ROLE_SSM_OUT else role)  # in place: one stream alive
            self.inp = None

    def _attention(self, i: int, qkv: torch.Tensor) -> torch.Tensor:
        s, n, t = self.spec, self.seqs, self.seq_len
        q, k, v = self.layers.qkv_heads(qkv.view(n, t, -1), i)
        cos, sin = self.rope[s.layer_rope_key(i)]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        _, _, window = s.layer_attention(i)
        out = torch.empty(n, t, s.heads, s.head_dim)
        for j in range(n):  # one window and one KV head's query group at a time bound the score transients
            out[j] = attend(q[j].transpose(0, 1), k[j].transpose(0, 1), v[j].transpose(0, 1), 0, 0, window,
                            self.layers.scale, per_group=True).transpose(0, 1)
        return out.view(n * t, s.q_dim)
