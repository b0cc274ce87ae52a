"""Model geometry from a Hugging Face config, recipes, and the artifact's expected tensors.

``ModelSpec`` is the architecture-neutral description both sides agree on; ``Recipe``
(a TOML data file in ``recipes/``) maps a family's HF tensor names to sparkq roles.
``expected_linears`` / ``expected_vectors`` give every artifact tensor's name and
logical shape, so the converter writes and the runtime reads against one definition.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import tomllib

import numpy as np

from . import constants as C


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class Recipe:
    family: str
    architectures: tuple[str, ...]
    global_names: dict
    layer_prefix: str
    layer_names: dict
    group_size: int = 128
    group_size_fallbacks: tuple[int, ...] = (64, 32)
    keep_bf16: tuple[str, ...] = ()
    keep_int8: tuple[str, ...] = ()
    head_group_size: int | None = None  # int4 group size for lm_head/embed only (None: as the body)
    features: tuple = ()  # sorted (name, value) pairs of the recipe's [features] table (FEATURES)
    path: str = ""

    def feature(self, name: str):
        return dict(self.features).get(name, FEATURES[name])

    def layer_sources(self, role: str, i: int) -> list[str]:
        v = self.layer_names[role]
        names = v if isinstance(v, list) else [v]
        pre = self.layer_prefix.format(i=i)
        return [pre + n for n in names]

    def source_names(self, spec: "ModelSpec") -> dict[str, list[str]]:
        """Artifact linear name or vector tensor name -> HF source tensor names (parts in
        fusion order; fused vectors such as the qkv bias are concatenated)."""
        out: dict[str, list[str]] = {}
        for i in range(spec.layers):
            for role in C.LAYER_LINEARS:
                out[f"layers.{i}.{role}"] = self.layer_sources(role, i)
            for role in spec.layer_norms:
                out[f"layers.{i}.{role}.weight"] = self.layer_sources(role, i)
            if spec.qkv_bias:
                out[f"layers.{i}.qkv.bias"] = self.layer_sources("qkv_bias", i)
        out["norm.weight"] = [self.global_names["norm"]]
        if spec.tied:
            out[C.ROLE_LM_HEAD] = [self.global_names["embed"]]
        else:
            out[C.ROLE_EMBED] = [self.global_names["embed"]]
            out[C.ROLE_LM_HEAD] = [self.global_names["lm_head"]]
        return out


# Architecture features a recipe can switch on ([features] table), with their defaults.
FEATURES = {
    "qk_norm": False,         # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma3)
    "qkv_bias": False,        # biases on q/k/v (Qwen2)
    "norm_offset": False,     # RMSNorm scales by (1 + w), computed in fp32 (Gemma)
    "sandwich_norms": False,  # extra norms after attention and after the MLP (Gemma3)
    "embed_scale": False,     # embeddings multiplied by sqrt(hidden) (Gemma)
    "act": "silu",            # MLP gate activation: silu | gelu_tanh
}


def _features(d: dict, path: str) -> tuple:
    if not isinstance(d, dict) or any(k not in FEATURES for k in d):
        raise SpecError(f"recipe {path}: unknown [features] {sorted(set(d) - set(FEATURES))}; known: {', '.join(FEATURES)}")
    if d.get("act", "silu") not in ("silu", "gelu_tanh"):
        raise SpecError(f"recipe {path}: act must be silu or gelu_tanh")
    return tuple(sorted(d.items()))


def _group_size(v, path: str, key: str) -> int | None:
    if v is not None and (type(v) is not int or v not in C.GROUP_SIZES):
        raise SpecError(f"recipe {path}: [quant] {key} must be one of {C.GROUP_SIZES}; got {v!r}")
    return v


def _roles(v, key: str, path: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or any(r not in C.ROLES for r in v):
        raise SpecError(f"recipe {path}: {key} must list roles among {', '.join(C.ROLES)}; got {v!r}")
    return tuple(v)


def _recipe_from_dict(d: dict, path: str) -> Recipe:
    try:
        q = d.get("quant", {})
        return Recipe(
            family=d["family"],
            architectures=tuple(d["architectures"]),
            global_names=dict(d["global"]),
            layer_prefix=d["layer"]["prefix"],
            layer_names={k: v for k, v in d["layer"].items() if k != "prefix"},
            group_size=_group_size(q.get("group_size", 128), path, "group_size"),
            group_size_fallbacks=tuple(int(x) for x in q.get("group_size_fallbacks", (64, 32))),
            keep_bf16=_roles(q.get("keep_bf16", []), "keep_bf16", path),
            keep_int8=_roles(q.get("keep_int8", []), "keep_int8", path),
            head_group_size=_group_size(q.get("head_group_size"), path, "head_group_size"),
            features=_features(d.get("features", {}), path),
            path=path,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SpecError(f"recipe {path}: missing or bad field {e}; see recipes/llama.toml for the schema") from None


def builtin_recipes() -> dict[str, Recipe]:
    out = {}
    for f in sorted(resources.files("sparkq.recipes").iterdir(), key=lambda p: p.name):
        if f.name.endswith(".toml"):
            r = _recipe_from_dict(tomllib.loads(f.read_text()), f.name)
            out[r.family] = r
    return out


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"recipe file {p} not found; pass an existing .toml to --recipe")
    try:
        d = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"recipe file {p} is not valid TOML ({e}); fix the file") from None
    return _recipe_from_dict(d, str(p))


def recipe_for_config(config: dict, override: str | Path | None = None) -> Recipe:
    if override:
        return load_recipe(override)
    archs = config.get("architectures") or []
    recipes = builtin_recipes()
    for r in recipes.values():
        if any(a in r.architectures for a in archs):
            return r
    supported = sorted(a for r in recipes.values() for a in r.architectures)
    raise SpecError(
        f"unknown architecture {archs or config.get('model_type')!r}; supported: "
        f"{', '.join(supported)}; write a recipe (see recipes/llama.toml) and pass --recipe FILE"
    )


@dataclass(frozen=True)
class ModelSpec:
    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    rms_eps: float
    rope_theta: float
    max_position: int
    rope_scaling: dict | None = field(default=None, compare=False)
    qk_norm: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    act: str = "silu"
    # per layer: attention type; per type: (rope theta, rotary dim)
    layer_types: tuple[str, ...] = ()
    rope_by_type: tuple = ()  # sorted ((type, theta, rotary_dim), ...)
    # per type: its RoPE scaling (None: none); empty: rope_scaling applies to every layer
    rope_scaling_by_type: dict = field(default_factory=dict, compare=False)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_softcap: float | None = None

    @property
    def layer_norms(self) -> tuple[str, ...]:
        return (C.LAYER_NORMS + (("q_norm", "k_norm") if self.qk_norm else ())
                + (("post_attn_norm", "post_mlp_norm") if self.sandwich_norms else ()))

    def layer_rope_scaling(self, i: int) -> dict | None:
        """The RoPE scaling of layer i (Gemma3 >= 4B scales its full-attention layers only)."""
        if not self.rope_scaling_by_type:
            return self.rope_scaling
        t = self.layer_types[i] if self.layer_types else "full_attention"
        return self.rope_scaling_by_type.get(t, self.rope_scaling_by_type.get("full_attention"))

    def layer_rope_key(self, i: int) -> tuple:
        """What layer i's RoPE tables depend on: layers with equal keys share one table."""
        theta, rot, _ = self.layer_attention(i)
        rs = self.layer_rope_scaling(i)
        return theta, rot, json.dumps(rs, sort_keys=True) if rs else None

    def layer_attention(self, i: int) -> tuple[float, int, int | None]:
        """(rope theta, rotary dim, sliding window or None) of layer i."""
        t = self.layer_types[i] if self.layer_types else "full_attention"
        rope = {k: (th, rd) for k, th, rd in self.rope_by_type}
        theta, rot = rope.get(t, rope.get("full_attention", (self.rope_theta, self.head_dim)))
        if self.layer_types:
            window = self.sliding_window if t == "sliding_attention" else None
        else:
            window = self.sliding_window
        return theta, rot, window

    @classmethod
    def from_recipe(cls, cfg: dict, recipe: "Recipe") -> "ModelSpec":
        return cls.from_config(cfg, recipe.family, **{k: recipe.feature(k) for k in FEATURES})

    @classmethod
    def from_config(cls, cfg: dict, family: str = "llama", *, qk_norm: bool = False, qkv_bias: bool = False,
                    norm_offset: bool = False, sandwich_norms: bool = False, embed_scale: bool = False,
                    act: str = "silu") -> "ModelSpec":
        for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
            if key in cfg and type(cfg[key]) is not int:
                raise SpecError(f"config.json: {key} must be an integer, got {cfg[key]!r}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            spec = cls(
                family=family,
                hidden=hidden,
                layers=int(cfg["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                tied=bool(cfg.get("tie_word_embeddings", False)),
                rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", _flat_rope(cfg).get("rope_theta", 10000.0))),
                max_position=int(cfg.get("max_position_embeddings", 2048)),
                rope_scaling=cfg.get("rope_scaling") or (
                    _flat_rope(cfg) if _flat_rope(cfg).get("rope_type") not in (None, "default") else None),
                qk_norm=qk_norm,
                qkv_bias=qkv_bias,
                sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) else None,
                norm_offset=norm_offset,
                sandwich_norms=sandwich_norms,
                embed_scale=embed_scale,
                act=act,
                layer_types=tuple(str(t) for t in cfg.get("layer_types") or ()),
                rope_by_type=_rope_by_type(cfg, hidden // heads if not cfg.get("head_dim") else int(cfg["head_dim"])),
                rope_scaling_by_type=_rope_scaling_by_type(cfg),
                attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if cfg.get("query_pre_attn_scalar") else None,
                final_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
            )
        except KeyError as e:
            raise SpecError(f"config.json lacks {e.args[0]!r}; it is needed to lay out the model") from None
        except (TypeError, ValueError, AttributeError, OverflowError) as e:
            raise SpecError(f"config.json has a bad value ({e})") from None
        if spec.rope_scaling is not None and not isinstance(spec.rope_scaling, dict):
            raise SpecError("config.json: rope_scaling must be an object or null")
        limits = {"hidden": 1 << 17, "layers": 1 << 12, "heads": 1 << 12, "kv_heads": 1 << 12, "head_dim": 1 << 12,
                  "intermediate": 1 << 19, "vocab": 1 << 22, "max_position": 1 << 31}
        for name, hi in limits.items():
            v = getattr(spec, name)
            if not 0 < v <= hi:
                raise SpecError(f"config.json: {name}={v} is out of range (1..{hi})")
        if not (spec.rms_eps > 0 and spec.rope_theta > 0):
            raise SpecError("config.json: rms_norm_eps and rope_theta must be positive")
        if spec.layer_types and (len(spec.layer_types) != spec.layers or
                                 set(spec.layer_types) - {"full_attention", "sliding_attention"}):
            raise SpecError("config.json: layer_types must list full_attention/sliding_attention for every layer")
        if "sliding_attention" in spec.layer_types and not spec.sliding_window:
            raise SpecError("config.json: sliding_attention layers need a positive sliding_window")
        for t, theta, rot in spec.rope_by_type:
            if not (theta > 0 and 0 < rot <= spec.head_dim and rot % 2 == 0):
                raise SpecError(f"config.json: RoPE for {t}: theta {theta} / rotary dim {rot} out of range")
        if spec.heads % spec.kv_heads:
            raise SpecError(f"config.json: {spec.heads} heads is not a multiple of {spec.kv_heads} kv heads")
        for rs in (spec.rope_scaling, *spec.rope_scaling_by_type.values()):
            if rs and rs.get("rope_type", rs.get("type")) not in (None, "default", "llama3", "linear", "yarn"):
                raise SpecError(f"config.json: rope_scaling {rs.get('rope_type', rs.get('type'))!r} is not supported yet")
        return spec

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Artifact linear name -> (N, K)."""
        out = {}
        for i in range(self.layers):
            out[f"layers.{i}.qkv"] = (self.q_dim + 2 * self.kv_dim, self.hidden)
            out[f"layers.{i}.o"] = (self.hidden, self.q_dim)
            out[f"layers.{i}.gate_up"] = (2 * self.intermediate, self.hidden)
            out[f"layers.{i}.down"] = (self.hidden, self.intermediate)
        if not self.tied:
            out[C.ROLE_EMBED] = (self.vocab, self.hidden)
        out[C.ROLE_LM_HEAD] = (self.vocab, self.hidden)
        return out

    def part_rows(self, name: str) -> list[int]:
        """Rows of each fused part (q, k, v) or (gate, up); one entry for unfused."""
        role = name.rsplit(".", 1)[-1]
        if role == C.ROLE_QKV:
            return [self.q_dim, self.kv_dim, self.kv_dim]
        if role == C.ROLE_GATE_UP:
            return [self.intermediate, self.intermediate]
        return [self.linear_shapes()[name][0]]

    def vector_shapes(self) -> dict[str, tuple[int, ...]]:
        """Artifact norm / bias tensor name -> shape (all bf16)."""
        out = {}
        for i in range(self.layers):
            for n in self.layer_norms:
                out[f"layers.{i}.{n}.weight"] = (self.head_dim,) if n in ("q_norm", "k_norm") else (self.hidden,)
            if self.qkv_bias:
                out[f"layers.{i}.qkv.bias"] = (self.q_dim + 2 * self.kv_dim,)
        out["norm.weight"] = (self.hidden,)
        return out


def _flat_rope(cfg: dict) -> dict:
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and not any(isinstance(v, dict) for v in rp.values()):
        return rp
    if isinstance(rp, dict):
        return rp.get("full_attention") or {}
    return {}


def _rope_scaling_by_type(cfg: dict) -> dict:
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


def _rope_by_type(cfg: dict, head_dim: int) -> tuple:
    """((layer type, theta, rotary dim), ...) from the config's RoPE fields.

    Reads transformers-5 style ``rope_parameters`` (flat, or keyed by layer type, each with
    optional ``partial_rotary_factor``), the older ``rope_theta`` / ``rope_local_base_freq``
    (Gemma3) and a top-level ``partial_rotary_factor``."""
    rp = cfg.get("rope_parameters")
    top_factor = float(cfg.get("partial_rotary_factor", 1.0))
    base = float(cfg.get("rope_theta", 10000.0))
    out = {}
    if isinstance(rp, dict) and any(isinstance(v, dict) for v in rp.values()):
        for t, v in rp.items():
            if isinstance(v, dict):
                f = float(v.get("partial_rotary_factor", top_factor))
                out[t] = (float(v.get("rope_theta", base)), int(head_dim * f) // 2 * 2)
    else:
        if isinstance(rp, dict):
            base = float(rp.get("rope_theta", base))
            top_factor = float(rp.get("partial_rotary_factor", top_factor))
        out["full_attention"] = (base, int(head_dim * top_factor) // 2 * 2)
        if cfg.get("rope_local_base_freq"):
            out["sliding_attention"] = (float(cfg["rope_local_base_freq"]), out["full_attention"][1])
    return tuple(sorted((t, th, rd) for t, (th, rd) in out.items()))


def role_of(linear_name: str) -> str:
    return linear_name.rsplit(".", 1)[-1]


def linear_tensors(name: str, kind: str, n: int, k: int, group_size: int | None,
                   residual: bool = False, residual_rows: int | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype, shape) of one linear in the artifact (``residual``: a
    split int4 linear's second plane, for ``residual_rows`` of its rows when fewer than N: a
    partial split with its row map, constants.py)."""
    if (residual or residual_rows is not None) and kind != C.KIND_INT4:
        raise SpecError(f"{name}: only an int4 linear can have a residual plane, not {kind}")
    if kind == C.KIND_INT4:
        if group_size not in C.GROUP_SIZES or k % group_size:
            raise SpecError(f"{name}: group size {group_size} does not divide K={k}")
        if residual and k % 32:
            raise SpecError(f"{name}: a residual plane needs K % 32 == 0, got K={k}")
        out = {
            f"{name}.qweight": (C.DTYPE_U8, (n, k // 2)),
            f"{name}.scales_zeros": (C.DTYPE_BF16, (k // group_size, n, 2)),
        }
        if residual:
            m = n if residual_rows is None else residual_rows
            if not 1 <= m <= n:
                raise SpecError(f"{name}: a residual plane covers 1 to {n} rows, not {m}")
            out[f"{name}.residual"] = (C.DTYPE_U8, (m, k // 2))
            out[f"{name}.residual_scales"] = (C.DTYPE_BF16, (m, k // group_size))
            if m < n:
                out[f"{name}.residual_map"] = (C.DTYPE_I32, (n,))
        elif residual_rows is not None:
            raise SpecError(f"{name}: residual_rows without a residual plane")
        return out
    if kind == C.KIND_LUT4:
        if group_size not in C.GROUP_SIZES or k % group_size or k % 32:
            raise SpecError(f"{name}: group size {group_size} does not divide K={k} (lut4 also needs K % 32 == 0)")
        return {f"{name}.qweight": (C.DTYPE_U8, (n, k // 2)),
                f"{name}.scales_zeros": (C.DTYPE_BF16, (k // group_size, n, 2)),
                f"{name}.levels": (C.DTYPE_I8, (n, 16))}
    if kind == C.KIND_INT8:
        return {f"{name}.qweight": (C.DTYPE_I8, (n, k)), f"{name}.scales": (C.DTYPE_BF16, (n,))}
    if kind == C.KIND_BF16:
        return {f"{name}.weight": (C.DTYPE_BF16, (n, k))}
    raise SpecError(f"{name}: unknown linear kind {kind!r}")


def choose_group_size(n: int, k: int, recipe: Recipe, role: str, requested: int | None = None) -> int | None:
    """The group size a linear gets, or None for bf16 (recipe rules; see recipes/llama.toml)."""
    if role in recipe.keep_bf16 or n % 16:
        return None
    first = requested or recipe.group_size
    if role in C.HEAD_ROLES and recipe.head_group_size:
        first = recipe.head_group_size
    for g in (first, *recipe.group_size_fallbacks):
        if g in C.GROUP_SIZES and g <= first and k % g == 0:
            return g
    return None


def rope_inv_freq(spec: ModelSpec, rotary_dim: int, theta: float, layer: int | None = None) -> np.ndarray:
    """RoPE inverse frequencies (float32 [rotary_dim/2], numpy) with the RoPE scaling of ``layer``
    (None: the config's rope_scaling): part of the model's definition, shared by the runtime and the
    converter's calibration."""
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    rs = (spec.rope_scaling if layer is None else spec.layer_rope_scaling(layer)) or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
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
    """The factor YaRN applies to cos and sin (1.0 for the other RoPE types)."""
    rs = (spec.rope_scaling if layer is None else spec.layer_rope_scaling(layer)) or {}
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


def rope_tables_bf16(spec: ModelSpec, max_len: int, rotary_dim: int, theta: float,
                     layer: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_len, rotary_dim] as bf16 bit patterns (uint16), rotate-half order: angles
    pos * inv_freq in fp32, cos/sin in float64 rounded to fp32, then to bf16 (nearest even). One
    implementation for the torch runtime and the torch-free one, so both use the same tables.
    Computed in blocks of positions: the float64 temporaries stay small even for 1M positions."""
    inv = rope_inv_freq(spec, rotary_dim, theta, layer)
    att = np.float32(rope_attention_factor(spec, layer))
    half = inv.size
    cos = np.empty((max_len, 2 * half), np.uint16)
    sin = np.empty((max_len, 2 * half), np.uint16)

    def bf16_bits(x: np.ndarray) -> np.ndarray:
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    for p0 in range(0, max_len, 1 << 14):
        p1 = min(max_len, p0 + (1 << 14))
        ang = (np.arange(p0, p1, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)
        c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        if att != 1:  # YaRN: cos and sin scaled in fp32, as transformers does before the cast
            c, s = c * att, s * att
        c, s = bf16_bits(c), bf16_bits(s)
        cos[p0:p1, :half], cos[p0:p1, half:] = c, c
        sin[p0:p1, :half], sin[p0:p1, half:] = s, s
    return cos, sin
