"""RoPE as the model defines it (inverse frequencies with linear / llama3 / YaRN / LongRoPE scaling,
YaRN's and LongRoPE's attention factor, the bf16 cos/sin tables): one implementation for the
converter's calibration and both runtimes.

LongRoPE (Phi-3.5, Phi-4-mini) has short and long per-frequency factors; transformers switches to
the long ones once a sequence passes original_max_position_embeddings and recomputes every
position. Here the choice is made once per table, by its length (``context``: the runtime's
max_model_len, the calibration's window), as llama.cpp does by its context size: a process whose
KV cache can hold more than original_max_position_embeddings tokens runs long factors for every
sequence, short ones otherwise, so a cached K/V row (and the server's prefix cache) never mixes the
two."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .spec import ModelSpec


def longrope_original(spec: ModelSpec, rs: dict) -> int:
    """LongRoPE's original_max_position_embeddings (the rope parameters' or the config's)."""
    return int(rs.get("original_max_position_embeddings") or spec.original_max_position or spec.max_position)


def rope_inv_freq(spec: ModelSpec, rotary_dim: int, theta: float, layer: int | None = None,
                  context: int | None = None) -> np.ndarray:
    """RoPE inverse frequencies (float32 [rotary_dim/2], numpy) with the RoPE scaling of ``layer``
    (None: the config's rope_scaling): part of the model's definition, shared by the runtime and the
    converter's calibration. ``context``: the positions the table serves (LongRoPE's switch)."""
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    rs = (spec.rope_scaling if layer is None else spec.layer_rope_scaling(layer)) or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "longrope":  # transformers' _compute_longrope_parameters, in fp32 as there
        long = context is not None and context > longrope_original(spec, rs)
        ext = np.asarray(rs["long_factor" if long else "short_factor"], dtype=np.float32)
        shape = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
        return (np.float32(1.0) / (ext * np.power(np.float32(theta), shape, dtype=np.float32))).astype(np.float32)
    if kind == "proportional":  # Gemma 4's full layers: the whole head's pairs (i, i + D/2), the first
        # partial_rotary_factor * D/2 of them at theta^(-2i/D), the rest unrotated (frequency 0)
        inv[int(float(rs.get("partial_rotary_factor", 1.0)) * rotary_dim // 2):] = 0.0
    elif kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "yarn":  # transformers' _compute_yarn_parameters
        factor, old = _yarn_factor(spec, rs), float(rs.get("original_max_position_embeddings") or spec.max_position)
        fast, slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

        def corr_dim(rot):
            return rotary_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = corr_dim(fast), corr_dim(slow)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extra = 1 - ramp  # 1: keep the frequency (high frequencies), 0: interpolate by the factor
        inv = inv / factor * (1 - extra) + inv * extra
    return inv.astype(np.float32)


def _yarn_factor(spec: ModelSpec, rs: dict) -> float:
    f = rs.get("factor")
    if f is None:  # DeepSeek-style: the ratio of the extended to the original context
        return spec.max_position / float(rs["original_max_position_embeddings"])
    return float(f)


def rope_attention_factor(spec: ModelSpec, layer: int | None = None) -> float:
    """The factor YaRN and LongRoPE apply to cos and sin (1.0 for the other RoPE types)."""
    rs = (spec.rope_scaling if layer is None else spec.layer_rope_scaling(layer)) or {}
    if rs.get("rope_type", rs.get("type")) == "longrope":
        if rs.get("attention_factor") is not None:
            return float(rs["attention_factor"])
        orig = longrope_original(spec, rs)
        factor = spec.max_position / orig if (rs.get("original_max_position_embeddings") or spec.original_max_position) \
            else float(rs.get("factor") or 1.0)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    if rs.get("rope_type", rs.get("type")) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = _yarn_factor(spec, rs)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return float(mscale(factor, float(rs["mscale"])) / mscale(factor, float(rs["mscale_all_dim"])))
    return mscale(factor)


def _rope_blocks(spec: "ModelSpec", max_len: int, rotary_dim: int, theta: float, layer: int | None):
    """(p0, p1, cos, sin) per block of positions: float32 [p1 - p0, rotary_dim / 2] halves, angles
    pos * inv_freq in fp32, cos/sin in float64 rounded to fp32 (YaRN: then scaled in fp32, as
    transformers does before its cast). Blocks keep the float64 temporaries small at 1M positions."""
    inv = rope_inv_freq(spec, rotary_dim, theta, layer, context=max_len)
    att = np.float32(rope_attention_factor(spec, layer))
    for p0 in range(0, max_len, 1 << 14):
        p1 = min(max_len, p0 + (1 << 14))
        ang = (np.arange(p0, p1, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)
        c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        if att != 1:
            c, s = c * att, s * att
        yield p0, p1, c, s


def rope_tables_bf16(spec: "ModelSpec", max_len: int, rotary_dim: int, theta: float,
                     layer: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_len, rotary_dim] as bf16 bit patterns (uint16, nearest even), rotate-half
    order: one implementation for the torch runtime and the torch-free one, so both use the same tables."""
    cos = np.empty((max_len, rotary_dim), np.uint16)
    sin = np.empty((max_len, rotary_dim), np.uint16)

    def bf16_bits(x: np.ndarray) -> np.ndarray:
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    half = rotary_dim // 2
    for p0, p1, c, s in _rope_blocks(spec, max_len, rotary_dim, theta, layer):
        c, s = bf16_bits(c), bf16_bits(s)
        cos[p0:p1, :half], cos[p0:p1, half:] = c, c
        sin[p0:p1, :half], sin[p0:p1, half:] = s, s
    return cos, sin


# -- the config's RoPE fields (ModelSpec.from_config) --

def flat_rope(cfg: dict) -> dict:
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and not any(isinstance(v, dict) for v in rp.values()):
        return rp
    if isinstance(rp, dict):
        return rp.get("full_attention") or {}
    return {}


def rope_scaling_by_type(cfg: dict) -> dict:
    """layer type -> its RoPE scaling (None: unscaled), where the config gives one per type:
    ``rope_parameters`` keyed by layer type, or Gemma3's older ``rope_scaling`` (its global layers)
    beside ``rope_local_base_freq`` (its local ones, unscaled); {} otherwise."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and any(isinstance(v, dict) for v in rp.values()):
        return {t: (v if v.get("rope_type", "default") not in (None, "default") else None)
                for t, v in rp.items() if isinstance(v, dict)}
    if cfg.get("rope_local_base_freq") and cfg.get("rope_scaling"):
        return {"full_attention": cfg["rope_scaling"], "sliding_attention": None}
    return {}


def rope_by_type(cfg: dict, head_dim: int, type_dims: dict | None = None) -> tuple:
    """((layer type, theta, rotary dim), ...) from the config's RoPE fields (``type_dims``: a layer
    type's own head dim where it differs; a "proportional" type rotates its whole head, see
    rope_inv_freq).

    Reads transformers-5 style ``rope_parameters`` (flat, or keyed by layer type, each with
    optional ``partial_rotary_factor``), the older ``rope_theta`` / ``rope_local_base_freq``
    (Gemma3) and a top-level ``partial_rotary_factor``."""
    rp = cfg.get("rope_parameters")
    top_factor = float(cfg.get("partial_rotary_factor", 1.0))
    base = float(cfg.get("rope_theta") or 10000.0)
    out = {}
    if isinstance(rp, dict) and any(isinstance(v, dict) for v in rp.values()):
        for t, v in rp.items():
            if isinstance(v, dict):
                d = (type_dims or {}).get(t, head_dim)
                f = 1.0 if v.get("rope_type") == "proportional" else float(v.get("partial_rotary_factor", top_factor))
                out[t] = (float(v.get("rope_theta", base)), int(d * f) // 2 * 2)
    else:
        if isinstance(rp, dict):
            base = float(rp.get("rope_theta", base))
            top_factor = float(rp.get("partial_rotary_factor", top_factor))
        out["full_attention"] = (base, int(head_dim * top_factor) // 2 * 2)
        if cfg.get("rope_local_base_freq"):
            out["sliding_attention"] = (float(cfg["rope_local_base_freq"]), out["full_attention"][1])
    return tuple(sorted((t, th, rd) for t, (th, rd) in out.items()))
