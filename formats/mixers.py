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
class ConvShape:
    """A gated short convolution's geometry (LFM2 / LFM3 conv layers): in_proj [3 E, E] gives B | C |
    x, a depthwise causal conv of ``kernel`` taps over B * x, C times it, out_proj [E, E]."""
    channels: int  # hidden_size
    kernel: int    # conv_L_cache


def conv_shape(cfg: dict) -> ConvShape | None:
    """The short-conv geometry where the config has conv layers (None otherwise)."""
    if "conv" not in (cfg.get("layer_types") or ()):
        return None
    k = cfg.get("conv_L_cache", 3)
    if type(k) is not int or not 2 <= k <= 16:
        raise SpecError(f"config.json: conv_L_cache {k!r} is out of range (2..16)")
    if cfg.get("conv_bias"):
        raise SpecError("config.json: conv_bias=true (biases on the short conv and its projections) is not implemented")
    return ConvShape(channels=int(cfg["hidden_size"]), kernel=k)


@dataclass(frozen=True)
class SSMShape:
    """A Mamba-2 layer's geometry: in_proj gives z [inner] | x [inner] | B [G N] | C [G N] | dt [H]; a
    depthwise causal conv (with bias) and SiLU over x | B | C; per head h (group h // (H / G)) the state
    S [P, N] decays by exp(-exp(A_log) dt) and takes dt x B^T, y = S C + D x; y * silu(z) RMS-normed per
    group of inner / norm_groups; out_proj [E, inner]."""
    heads: int       # mamba_n_heads H
    head_dim: int    # mamba_d_head P
    state: int       # mamba_d_state N
    groups: int      # mamba_n_groups G (B and C per group)
    conv_kernel: int
    conv_bias: bool
    norm_eps: float
    norm_groups: int  # the gated norm's groups (Granite: n_groups); 0: no norm, y * silu(z) (Falcon-H1's mamba_rms_norm false)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """channels of the conv: x | B | C"""
        return self.inner + 2 * self.groups * self.state


def ssm_shape(cfg: dict, eps: float) -> SSMShape | None:
    """The Mamba-2 geometry where the config has mamba layers (None otherwise; the config's mamba_*
    fields, transformers' GraniteMoeHybridConfig defaults)."""
    if not {"mamba", "parallel"} & set(cfg.get("layer_types") or ()):
        return None
    hidden = int(cfg["hidden_size"])
    heads, groups = cfg.get("mamba_n_heads", 128), cfg.get("mamba_n_groups", 1)
    expand, d_head = cfg.get("mamba_expand", 2), cfg.get("mamba_d_head", "auto")
    for k, v in (("mamba_n_heads", heads), ("mamba_n_groups", groups), ("mamba_expand", expand),
                 ("mamba_d_state", cfg.get("mamba_d_state", 256)), ("mamba_d_conv", cfg.get("mamba_d_conv", 4))):
        if type(v) is not int or v <= 0:
            raise SpecError(f"config.json: {k} must be a positive integer, got {v!r}")
    inner = cfg.get("mamba_d_ssm") or expand * hidden  # (Falcon-H1, Nemotron-H: heads x head dim, not expand x hidden)
    if d_head == "auto":
        d_head = inner // heads
    if type(d_head) is not int or d_head * heads != inner:
        raise SpecError(f"config.json: mamba_d_head {d_head!r} x mamba_n_heads {heads} must be the SSM width ({inner})")
    if heads % groups:
        raise SpecError(f"config.json: mamba_n_heads {heads} is not a multiple of mamba_n_groups {groups}")
    lim = cfg.get("time_step_limit", (0.0, float("inf")))
    # (transformers writes infinity as {"__float__": "Infinity"})
    lim = lim if lim is None or not isinstance(lim, (list, tuple)) else [
        float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v for v in lim]
    if lim is not None and (not isinstance(lim, (list, tuple)) or len(lim) != 2 or float(lim[0]) != 0.0
                            or float(lim[1]) != float("inf")):
        raise SpecError(f"config.json: time_step_limit {lim!r} (clamped time steps) is not implemented; sparkq runs (0, inf)")
    if cfg.get("mamba_proj_bias"):
        raise SpecError("config.json: mamba_proj_bias=true (biases on the Mamba projections) is not implemented")
    if cfg.get("mamba_rms_norm", True) and cfg.get("mamba_norm_before_gate") is True:
        raise SpecError("config.json: mamba_norm_before_gate=true with mamba_rms_norm (the norm before the gate) "
                        "is not implemented; sparkq runs the gate, then the norm")
    g = SSMShape(heads=heads, head_dim=d_head, state=int(cfg.get("mamba_d_state", 256)), groups=groups,
                 conv_kernel=int(cfg.get("mamba_d_conv", 4)), conv_bias=bool(cfg.get("mamba_conv_bias", True)),
                 norm_eps=float(eps or cfg.get("rms_norm_eps", 1e-6)),
                 norm_groups=groups if cfg.get("mamba_rms_norm", True) else 0)
    if not 2 <= g.conv_kernel <= 16:
        raise SpecError(f"config.json: mamba_d_conv {g.conv_kernel} is out of range (2..16)")
    if g.state % 8 or g.head_dim % 8:
        raise SpecError(f"config.json: mamba_d_state {g.state} and mamba_d_head {g.head_dim} must be multiples of 8")
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
    math: str = ""  # its runtime/torchrt/layers.py Layers method (a recurrent mixer's: products and state in, out)


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


def _mixer_norms(s: "ModelSpec", i: int | None) -> tuple[str, ...]:
    """a recurrent mixer's layer norms: before the mixer and the MLP, the sandwich's after (LFM3)"""
    return C.LAYER_NORMS + (("post_attn_norm", "post_mlp_norm") if s.sandwich_norms else ())


def _sconv_linears(s: "ModelSpec", i: int | None = None) -> dict:
    e = s.sconv.channels
    return {C.ROLE_QKV: (3 * e, s.hidden), C.ROLE_O: (s.hidden, e)}  # qkv: in_proj's B | C | x


def _mamba_linears(s: "ModelSpec", i: int | None = None) -> dict:
    g = s.ssm
    # gate: z (the norm's gate, inner rows) | dt (heads); qkv: x | B | C (the conv's input)
    return {C.ROLE_GATE: (g.inner + g.heads, s.hidden), C.ROLE_QKV: (g.conv_dim, s.hidden), C.ROLE_O: (s.hidden, g.inner)}


def _mamba_params(s: "ModelSpec") -> dict:
    g = s.ssm
    out = {C.GDN_CONV: (g.conv_dim, g.conv_kernel)}
    if g.conv_bias:
        out[C.CONV_BIAS] = (g.conv_dim,)
    out.update({C.GDN_A_LOG: (g.heads,), C.GDN_DT_BIAS: (g.heads,), C.SSM_D: (g.heads,)})
    return {**out, C.GDN_NORM: (g.inner,)} if g.norm_groups else out


def _parallel_linears(s: "ModelSpec", i: int | None = None) -> dict:
    """attention's linears, then the Mamba-2 branch's under its own roles"""
    m = _mamba_linears(s, i)
    return {**_attn_linears(s, i), C.ROLE_SSM_GATE: m[C.ROLE_GATE], C.ROLE_SSM_IN: m[C.ROLE_QKV], C.ROLE_SSM_OUT: m[C.ROLE_O]}


def _mamba_state(s: "ModelSpec") -> dict:
    return {"conv": (s.ssm.conv_dim, s.ssm.conv_kernel - 1), "recurrent": (s.ssm.heads, s.ssm.head_dim, s.ssm.state)}


MIXERS: dict[str, Mixer] = {
    C.MIXER_ATTENTION: Mixer(C.MIXER_ATTENTION, ("full_attention", "sliding_attention"), 0, _attn_linears,
                             lambda s, i: s.layer_norms(i), lambda s: {}, lambda s: {}),
    C.MIXER_GDN: Mixer(C.MIXER_GDN, ("linear_attention",), 1, _gdn_linears,
                       lambda s, i: C.LAYER_NORMS, _gdn_params, _gdn_state, "gdn"),
    C.MIXER_SCONV: Mixer(C.MIXER_SCONV, ("conv",), 2, _sconv_linears, _mixer_norms,
                         lambda s: {C.GDN_CONV: (s.sconv.channels, s.sconv.kernel)},
                         lambda s: {"conv": (s.sconv.channels, s.sconv.kernel - 1)}, "sconv"),
    C.MIXER_MAMBA: Mixer(C.MIXER_MAMBA, ("mamba",), 3, _mamba_linears, _mixer_norms, _mamba_params, _mamba_state,
                         "mamba"),
    # (a KV cache as attention's and a state as Mamba's: ModelSpec.kv_layers holds it)
    C.MIXER_PARALLEL: Mixer(C.MIXER_PARALLEL, ("parallel",), 4, _parallel_linears, lambda s, i: s.layer_norms(i),
                            _mamba_params, _mamba_state, "mamba"),
}
BY_LAYER_TYPE = {t: m for m in MIXERS.values() for t in m.layer_types}


def mixer_state(spec: "ModelSpec", slots: int, alloc: Callable) -> list[dict | None]:
    """Per layer: {state name: alloc((slots, *shape))} for a mixer with state, else None."""
    out = []
    for i in range(spec.layers):
        st = MIXERS[spec.mixers[i]].state(spec)
        out.append({n: alloc((slots, *shp)) for n, shp in st.items()} if st else None)
    return out


def recurrent_widths(spec: "ModelSpec") -> tuple[int, int, int]:
    """(qkv rows, gate rows, output width) of the model's recurrent layers (one kind per model): what a
    rewind keeps per row of each and what the mixer writes (runtime/core/rewind.py, csrc mix_widths);
    (0, 0, 0) without such layers."""
    for i, name in enumerate(spec.mixers):
        if MIXERS[name].state(spec):
            lin = MIXERS[name].linears(spec, i)
            q, g, o = (C.ROLE_SSM_IN, C.ROLE_SSM_GATE, C.ROLE_SSM_OUT) if C.ROLE_SSM_IN in lin else (
                C.ROLE_QKV, C.ROLE_GATE, C.ROLE_O)  # (a parallel layer: its Mamba-2 branch's)
            return lin[q][0], lin[g][0] if g in lin else 0, lin[o][1]
    return 0, 0, 0


def state_bytes(spec: "ModelSpec") -> int:
    """One sequence's recurrent state over every layer (fp32), besides its KV cache."""
    import math
    return sum(4 * math.prod(shp) for i in range(spec.layers) for shp in MIXERS[spec.mixers[i]].state(spec).values())
