"""The layer mixers: per mixer, the config's layer types that select it, its linears (roles, and
their shapes), its norms, its fp32 parameters, its per-sequence state and the C core's code for
it. ``ModelSpec`` reads this table for a layer's tensors; the runtimes for its state; adding a
mixer is an entry here, its math in runtime/torchrt/layers.py and the C core, and a recipe's
``[layer.<mixer>]`` names (docs/architecture.md "Add a layer mixer")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from . import constants as C
from .recipe import SpecError

if TYPE_CHECKING:
    from .spec import ModelSpec


@dataclass(frozen=True)
class GDNShape:
    """A Gated DeltaNet layer's geometry (the config's linear_* fields)."""
    k_heads: int        # linear_num_key_heads
    v_heads: int        # linear_num_value_heads (a multiple of k_heads; value head h reads key head h // ratio)
    k_dim: int          # linear_key_head_dim
    v_dim: int          # linear_value_head_dim
    conv_kernel: int = 4
    beta_scale: float = 1.0   # 2: OLMo Hybrid's allow_neg_eigval (beta in (0, 2))
    norm_eps: float = 1e-6    # the gated RMSNorm's

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """channels of the conv: q | k | v"""
        return 2 * self.key_dim + self.value_dim


GDN_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def gdn_shape(cfg: dict, norm_eps: float) -> GDNShape | None:
    """The Gated DeltaNet geometry where the config has linear_attention layers (None otherwise);
    norm_eps: the family's gated-norm eps (0: the config's rms_norm_eps)."""
    types = cfg.get("layer_types") or ()
    if "linear_attention" not in types:
        return None
    cfg = dict(cfg)
    # OLMo Hybrid's derived defaults (OlmoHybridConfig.__post_init__) where the fields are null
    if cfg.get("linear_num_key_heads") is None:
        cfg["linear_num_key_heads"] = cfg.get("num_attention_heads")
    if cfg.get("linear_num_value_heads") is None:
        cfg["linear_num_value_heads"] = cfg["linear_num_key_heads"]
    if cfg.get("linear_key_head_dim") is None and isinstance(cfg["linear_num_key_heads"], int):
        cfg["linear_key_head_dim"] = int(0.75 * int(cfg["hidden_size"]) / cfg["linear_num_key_heads"])
    if cfg.get("linear_value_head_dim") is None and isinstance(cfg.get("linear_key_head_dim"), int):
        cfg["linear_value_head_dim"] = 2 * cfg["linear_key_head_dim"]
    missing = [f for f in GDN_FIELDS if not isinstance(cfg.get(f), int) or cfg[f] <= 0]
    if missing:
        raise SpecError(f"config.json: linear_attention layers need positive integer {', '.join(missing)}")
    g = GDNShape(k_heads=cfg["linear_num_key_heads"], v_heads=cfg["linear_num_value_heads"],
                 k_dim=cfg["linear_key_head_dim"], v_dim=cfg["linear_value_head_dim"],
                 conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                 beta_scale=2.0 if cfg.get("linear_allow_neg_eigval") else 1.0,
                 norm_eps=float(norm_eps or cfg.get("rms_norm_eps", 1e-6)))
    if g.v_heads % g.k_heads:
        raise SpecError(f"config.json: linear_num_value_heads {g.v_heads} is not a multiple of linear_num_key_heads {g.k_heads}")
    if not 2 <= g.conv_kernel <= 8:
        raise SpecError(f"config.json: linear_conv_kernel_dim {g.conv_kernel} is out of range (2..8)")
    if g.k_dim % 8 or g.v_dim % 8:
        raise SpecError(f"config.json: linear key/value head dims {g.k_dim}/{g.v_dim} must be multiples of 8")
    return g


@dataclass(frozen=True)
class Mixer:
    name: str
    layer_types: tuple[str, ...]  # config layer_types values that select it
    code: int                     # sq_layer.mixer (csrc/sq_abi.h)
    # (spec, layer or None) -> {role: (N, K)}: the mixer's linears, in the order a layer runs them
    linears: Callable[["ModelSpec", "int | None"], dict[str, tuple[int, int]]]
    norms: Callable[["ModelSpec", "int | None"], tuple[str, ...]]  # bf16 norm vectors (layers.L.<name>.weight)
    params: Callable[["ModelSpec"], dict[str, tuple[int, ...]]]  # fp32 parameters (layers.L.<name>)
    # (spec) -> {state: shape}: fp32 per sequence, updated in place by every token (attention's
    # state is its KV cache, allocated by the runtimes by position: none here)
    state: Callable[["ModelSpec"], dict[str, tuple[int, ...]]]


def _attn_linears(s: "ModelSpec", i: int | None) -> dict:
    """(layer i: its head dim; a KV-sharing layer's qkv is its q rows alone)"""
    out = {C.ROLE_GATE: (s.heads * s.attn_gate, s.hidden)} if s.attn_gate else {}
    d = s.hd(i)
    out[C.ROLE_QKV] = (s.heads * d + (2 * s.kv_heads * d if s.owns_kv(i) else 0), s.hidden)
    out[C.ROLE_O] = (s.hidden, s.heads * d)
    return out


def _gdn_linears(s: "ModelSpec", i: int | None = None) -> dict:
    g = s.gdn
    # gate: z (the output norm's gate, value_dim rows) | b (beta, v_heads) | a (the decay's input, v_heads)
    return {C.ROLE_GATE: (g.value_dim + 2 * g.v_heads, s.hidden), C.ROLE_QKV: (g.conv_dim, s.hidden),
            C.ROLE_O: (s.hidden, g.value_dim)}


def _gdn_params(s: "ModelSpec") -> dict:
    g = s.gdn
    return {C.GDN_CONV: (g.conv_dim, g.conv_kernel), C.GDN_A_LOG: (g.v_heads,), C.GDN_DT_BIAS: (g.v_heads,),
            C.GDN_NORM: (g.v_dim,)}


def _gdn_state(s: "ModelSpec") -> dict:
    g = s.gdn
    return {"conv": (g.conv_dim, g.conv_kernel - 1), "recurrent": (g.v_heads, g.k_dim, g.v_dim)}


MIXERS: dict[str, Mixer] = {
    C.MIXER_ATTENTION: Mixer(C.MIXER_ATTENTION, ("full_attention", "sliding_attention"), 0, _attn_linears,
                             lambda s, i: s.layer_norms(i), lambda s: {}, lambda s: {}),
    C.MIXER_GDN: Mixer(C.MIXER_GDN, ("linear_attention",), 1, _gdn_linears,
                       lambda s, i: C.LAYER_NORMS, _gdn_params, _gdn_state),
}
BY_LAYER_TYPE = {t: m for m in MIXERS.values() for t in m.layer_types}


def mixer_state(spec: "ModelSpec", slots: int, alloc: Callable) -> list[dict | None]:
    """Per layer: {state name: alloc((slots, *shape))} for a mixer with state, else None."""
    out = []
    for i in range(spec.layers):
        st = MIXERS[spec.mixers[i]].state(spec)
        out.append({n: alloc((slots, *shp)) for n, shp in st.items()} if st else None)
    return out


def state_bytes(spec: "ModelSpec") -> int:
    """One sequence's recurrent state over every layer (fp32), besides its KV cache."""
    import math
    return sum(4 * math.prod(shp) for i in range(spec.layers) for shp in MIXERS[spec.mixers[i]].state(spec).values())
