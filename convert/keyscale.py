"""Key channel scaling: powers of two moved from K's channels onto Q's, offline.

The int8 KV cache keeps one scale per (position, KV head), so a few large key channels (Qwen2's
k bias puts some at ~300 where most stay under 4) leave the rest a handful of int8 steps. Per layer
the converter measures each key channel's range on calibration tokens and writes the model with
``k_c * 2^-e_c`` and ``q_c * 2^e_c`` (q and k projection rows and biases, or the q/k norm weights
where the model normalizes them per head):

- ``q . k`` is unchanged: the same ``e`` for the two channels RoPE rotates together (rotate-half
  pairs ``c`` and ``c + rot/2``), so the scaling commutes with RoPE;
- powers of two are exact in bf16 and fp32, and every encoding here scales with its row (4-bit
  codes unchanged, scales and zeros times ``2^e``), so with a bf16 cache the artifact computes the
  same logits as without it; only the int8 cache's rounding sees the flatter keys.

Not applied to RMSNorm with a ``(1 + w)`` offset (Gemma): ``(1 + w) 2^e - 1`` is not exact in bf16.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sparkq.formats import constants as C
from sparkq.runtime.torchrt.layers import rms_norm
from tqdm import tqdm

from .quantize import CALIBRATED

if TYPE_CHECKING:
    from sparkq.formats.spec import ModelSpec

    from .options import Options
    from .source import Source

from .source import read_fused_rows

LIMIT = 8  # e <= 8: weights and biases stay far inside bf16's range


def exponents(k: torch.Tensor, rot: int, shared: bool, round_up: bool = False) -> torch.Tensor:
    """k: keys before RoPE [tokens, kv_heads, head_dim] (float32) -> integer exponents 0 <= e <=
    LIMIT [kv_heads, head_dim] ([head_dim] when ``shared``: one q/k norm weight for every head):
    channels whose range exceeds the head's median channel's come down to about it (``max |k_c|
    2^-e_c``, e rounded to nearest, or up for a short pass whose maxima underestimate the ranges);
    smaller channels stay (raising them measured no better). docs/long-context.md has the runs."""
    h = rot // 2
    pair = (k[..., :h].square() + k[..., h:rot].square()).sqrt()  # what RoPE can rotate into either channel
    m = torch.cat([pair, pair, k[..., rot:].abs()], -1).amax(0)
    if shared:
        m = m.amax(0, keepdim=True)
    ref = m.median(-1, keepdim=True).values
    e = torch.where((m > 0) & (ref > 0), torch.log2(m / ref.clamp_min(1e-30)), torch.zeros_like(m))
    e = (e.ceil() if round_up else e.round()).clamp(0, LIMIT).to(torch.int32)
    return e[0] if shared else e


def qkv_row_multipliers(spec, e: torch.Tensor) -> torch.Tensor:
    """The fused qkv rows' multipliers [q_dim + 2 kv_dim] for a layer's exponents e [kv_heads,
    head_dim] (all ones where the model normalizes q/k per head: its norm weights carry them)."""
    if spec.qk_norm:
        return torch.ones(spec.q_dim + 2 * spec.kv_dim)
    e = torch.as_tensor(e, dtype=torch.float32)
    qm = torch.exp2(e).repeat_interleave(spec.heads // spec.kv_heads, 0).reshape(-1)  # query head j reads KV head j // group
    return torch.cat([qm, torch.exp2(-e).reshape(-1), torch.ones(spec.kv_dim)])


class KeyScaling:
    """The per-layer exponents and the source reads they change (``source.read_rows`` of the q/k
    projection rows, biases and norm weights, through ``ScaledSource``)."""

    def __init__(self, spec, srcs: dict, round_up: bool = False):
        self.spec, self.srcs, self.round_up = spec, srcs, round_up
        self.mult: dict[str, torch.Tensor] = {}  # source tensor name -> multiplier per row (or element)
        self.layers: dict[int, torch.Tensor] = {}

    @staticmethod
    def unsupported(spec) -> str | None:
        if any(m != C.MIXER_ATTENTION for m in spec.mixers):
            return "layers other than attention (a hybrid model): not measured yet"
        if spec.ple_dim or spec.kv_from or spec.head_dims:
            return "per-layer inputs, shared KV caches or per-layer head dims (Gemma 4): not measured yet"
        if spec.qk_norm and spec.norm_offset:
            return "q/k norms with a (1 + w) offset: a power of two is not exact there"
        if spec.qk_norm and spec.qk_norm_full:
            return "q/k norms over the whole projection width (OLMo2): not measured per channel yet"
        return None

    def _set(self, fused: str, parts_rows: list[int], m: torch.Tensor) -> None:
        """Multipliers over the rows of the virtual concatenation ``fused``, per source part."""
        base = 0
        for p, rows in zip(self.srcs[fused], parts_rows):
            seg = m[base:base + rows]
            if bool((seg != 1).any()):
                self.mult[p] = seg.clone()
            base += rows
        assert base == m.numel()

    def measure(self, source, cal, i: int) -> None:
        """Layer ``i``'s exponents from the keys of the calibration's current activations (read
        with the unscaled source) and the multipliers for its q/k tensors."""
        s = self.spec
        name = f"layers.{i}.{C.ROLE_QKV}"
        x = cal.inputs(name)
        rows = s.part_rows(name, len(self.srcs[name]))
        w = read_fused_rows(source, self.srcs[name], rows, s.q_dim, s.q_dim + s.kv_dim).float()
        k = torch.empty(x.shape[0], s.kv_dim)
        for t0 in range(0, x.shape[0], 1024):
            k[t0:t0 + 1024] = x[t0:t0 + 1024].float() @ w.T
        if s.qkv_bias:  # the bias's parts have the weight's row counts
            k += read_fused_rows(source, self.srcs[f"{name}.bias"], rows, s.q_dim, s.q_dim + s.kv_dim).float()
        k = k.view(-1, s.kv_heads, s.head_dim)
        if s.qk_norm:
            kn = f"layers.{i}.k_norm.weight"
            wn = torch.cat([source.read_rows(p, 0, source.shapes[p][0]) for p in self.srcs[kn]]).float()
            k = rms_norm(k, wn, s.rms_eps)  # (no offset: unsupported() refuses it)
        _, rot, _ = s.layer_attention(i)
        e = exponents(k, rot, shared=s.qk_norm, round_up=self.round_up)
        self.layers[i] = e
        if s.qk_norm:  # one weight per channel, every head: scale the norms, not the rows
            self._set(f"layers.{i}.q_norm.weight", [s.head_dim], torch.exp2(e.float()))
            self._set(f"layers.{i}.k_norm.weight", [s.head_dim], torch.exp2(-e.float()))
            return
        m = qkv_row_multipliers(s, e)
        self._set(name, rows, m)
        if s.qkv_bias:
            self._set(f"{name}.bias", rows, m)

    def summary(self) -> dict:
        moved = sum(int((e != 0).sum()) for e in self.layers.values())
        total = sum(e.numel() for e in self.layers.values())
        return {"layers": len(self.layers), "channels_scaled": moved, "channels": total,
                "max_exponent": max((int(e.max()) for e in self.layers.values()), default=0)}


class ScaledSource:
    """A source whose reads of the tensors ``scaling`` names come back multiplied per row (per
    element for vectors); everything else passes through."""

    def __init__(self, base, scaling: KeyScaling):
        self.base, self.scaling = base, scaling

    def __getattr__(self, name):
        return getattr(self.base, name)

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        t = self.base.read_rows(name, r0, r1)
        m = self.scaling.mult.get(name)
        if m is None:
            return t
        return t * m[r0:r1].view(-1, *([1] * (t.dim() - 1))).to(t.dtype)


# -- the converter's use: whether to scale, the uncalibrated prepass, the manifest's record
KEY_PREPASS_TOKENS = 256  # uncalibrated conversions: the key ranges' window (its activations are the pass's memory)


def key_scaling(source: Source, spec: ModelSpec, srcs: dict, opts: Options):
    """(KeyScaling or None, a record of why not)."""
    from .calib import has_tokenizer
    
    if not opts.key_scaling:
        return None, {"applied": False, "why": "--no-key-scaling"}
    why = KeyScaling.unsupported(spec)
    if why is None and opts.method not in CALIBRATED and not has_tokenizer(source):
        why = "the source has no tokenizer.json to read calibration text with"
    if why:
        return None, {"applied": False, "why": why}
    # the calibration's 8,192 tokens: exponents rounded to nearest; the uncalibrated pass's 256
    # see smaller maxima: rounded up (docs/long-context.md, both measured on Qwen2.5-Coder-1.5B)
    return KeyScaling(spec, srcs, round_up=opts.method not in CALIBRATED), {"applied": True}


def key_prepass(base: Source, scaled, spec: ModelSpec, srcs: dict, scaling, opts: Options, trim_heap) -> None:
    """The key ranges of an uncalibrated conversion: one window of the calibration text through the
    (unquantized, scaled as it goes) source model, layer by layer, its weights read in row blocks."""
    from .calib import Calibration, RowBlocks, calibration_ids
    from .writers import ROW_CHUNK_ELEMS

    ids, _ = calibration_ids(base, opts.calib, KEY_PREPASS_TOKENS, seq_len=KEY_PREPASS_TOKENS)
    cal = Calibration(scaled, spec, srcs, ids[:1])
    shapes = spec.linear_shapes()
    for i in tqdm(range(spec.layers), desc="key ranges", disable=not opts.progress, leave=False):
        scaling.measure(base, cal, i)
        for role in C.LAYER_LINEARS:
            name = f"layers.{i}.{role}"
            if role in (C.ROLE_QKV, C.ROLE_GATE_UP):
                cal.inputs(name)
            n, k = shapes[name]
            rows = lambda r0, r1, name=name: read_fused_rows(scaled, srcs[name], spec.part_rows(name, len(srcs[name])), r0, r1).float()  # noqa: E731
            cal.advance(name, RowBlocks(rows, n, k, max(64, (ROW_CHUNK_ELEMS // k) // 64 * 64)))
            trim_heap()


def key_record(info: dict, scaling) -> dict:
    """The manifest's record: whether the keys were scaled, and each layer's exponents."""
    if scaling is None:
        return {"applied": False, "why": info["why"]}
    return {"applied": True, "exponents": {str(i): e.tolist() for i, e in sorted(scaling.layers.items())}}
