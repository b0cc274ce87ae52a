"""``ModelSpec``: the architecture-neutral geometry of a model, read from a Hugging Face config
through its family's recipe (recipe.py); both sides agree on it. RoPE math: rope.py; the
artifact's tensors per weight kind: kinds.py."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from . import constants as C
from .mixers import BY_LAYER_TYPE, MIXERS, ConvShape, GDNShape, SSMShape, conv_shape, gdn_shape, ssm_shape
from .recipe import FEATURES, Recipe, SpecError  # noqa: F401  (SpecError: re-exported)
from .fields import ACTS, CONFIG_VIEWS, MOE_FIELDS, _check_implemented, _gate_width, _layer_types, _multiplier, _nope_layers  # noqa: F401
from .geometry import head_dims, kv_sources, mlp_widths, per_layer_input
from .rope import flat_rope, rope_by_type, rope_scaling_by_type


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
    pre_norms: bool = True
    qk_norm_full: bool = False
    embedding_multiplier: float | None = None  # the config's (Granite); Gemma's sqrt(hidden): embed_scale
    residual_multiplier: float = 1.0  # the branch outputs' factor before the residual add (Granite)
    logits_divisor: float = 1.0  # logits / this (Granite's logits_scaling)
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3)
    original_max_position: int | None = None  # the config's original_max_position_embeddings (LongRoPE)
    # the attention output gate's width per query head (the `gate` linear has heads * attn_gate
    # rows): 0 none, 1 one scalar per head (Spark2_5), head_dim one per channel (Qwen3-Next style)
    attn_gate: int = 0
    gdn: GDNShape | None = None  # the Gated DeltaNet layers' geometry (layer type linear_attention)
    sconv: ConvShape | None = None  # the gated short convolutions' (layer type conv: LFM2)
    ssm: SSMShape | None = None  # the Mamba-2 layers' (layer type mamba: Granite 4.0-H)
    mtp_layers: int = 0  # the multi-token-prediction block's attention layers in the artifact (constants.py)
    # per-layer geometry (formats/geometry.py; empty: the model's everywhere): each layer's head dim, the
    # layer whose KV cache it reads (a KV-sharing layer has no k / v rows), its MLP width
    head_dims: tuple[int, ...] = ()
    kv_from: tuple[int, ...] = ()
    inters: tuple[int, ...] = ()
    ple_dim: int = 0  # the per-layer input embedding's width per layer (Gemma 4; 0: none) and table rows
    ple_vocab: int = 0
    v_norm: bool = False  # values RMS-normed per head, no weight (Gemma 4)
    layer_scalar: bool = False  # each layer's output scaled by its stored scalar (Gemma 4)
    # checkpoints of single-block layers (Nemotron-H: a norm and one mixer or MLP per block): per layer,
    # the checkpoint blocks of its mixer and of its MLP (-1: the layer has no MLP); empty: block i is layer i
    blocks: tuple[tuple[int, int], ...] = ()

    @property
    def mixers(self) -> tuple[str, ...]:
        """Each layer's mixer (formats/mixers.py): attention, or gdn for linear_attention layers."""
        if not self.layer_types:
            return (C.MIXER_ATTENTION,) * self.layers
        return tuple(BY_LAYER_TYPE[t].name for t in self.layer_types)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache of their own (attention, not sharing another's); the runtimes'
        caches hold these, in order."""
        return tuple(i for i, m in enumerate(self.mixers) if self.has_attention(i) and self.owns_kv(i))

    def has_attention(self, i: int) -> bool:
        """whether layer i attends over a KV cache (attention, or a parallel layer's attention branch)"""
        return self.mixers[i] in (C.MIXER_ATTENTION, C.MIXER_PARALLEL)

    def hd(self, i: int | None) -> int:
        """layer i's head dim"""
        return self.head_dims[i] if self.head_dims and i is not None else self.head_dim

    @property
    def max_head_dim(self) -> int:
        """the largest head dim (the C core's model head_dim: a KV slot's offset is in its units)"""
        return max(self.head_dims or (self.head_dim,))

    def owns_kv(self, i: int | None) -> bool:
        """whether layer i writes K/V of its own (else it reads layer kv_from[i]'s)"""
        return not self.kv_from or i is None or self.kv_from[i] == i

    def inter(self, i: int | None) -> int:
        """layer i's MLP width"""
        return self.inters[i] if self.inters and i is not None else self.intermediate

    def has_mlp(self, i: int) -> bool:
        """whether layer i has an MLP after its mixer (Nemotron-H's mixer blocks may not)"""
        return not self.blocks or self.blocks[i][1] >= 0

    @property
    def gated_mlp(self) -> bool:
        """gate_up holds gate | up rows (act(gate) * up), or up alone (relu2: relu(up)^2, Nemotron-H)"""
        return self.act != "relu2"

    def block(self, i: int, role: str) -> int:
        """the checkpoint block (layer prefix index) holding layer i's tensor of ``role``"""
        return i if not self.blocks else self.blocks[i][1 if role in (C.ROLE_GATE_UP, C.ROLE_DOWN, "mlp_norm") else 0]

    def roles(self, i: int) -> tuple[str, ...]:
        """Layer i's linears, in the order the layer runs them (a gate reads the mixer's input)."""
        return tuple(MIXERS[self.mixers[i]].linears(self, i)) + ((C.ROLE_GATE_UP, C.ROLE_DOWN) if self.has_mlp(i) else ()) + (
            (C.ROLE_PLE_GATE, C.ROLE_PLE_PROJ) if self.ple_dim else ())

    @property
    def mtp_norms(self) -> tuple[str, ...]:
        """An MTP layer's norm vectors (an attention layer's: mtp.layers.J.<name>.weight)."""
        return MIXERS[C.MIXER_ATTENTION].norms(self, None)

    @property
    def layer_roles(self) -> tuple[str, ...]:
        """The linears of an attention layer (every layer's, in a model without other mixers)."""
        return tuple(MIXERS[C.MIXER_ATTENTION].linears(self, None)) + (C.ROLE_GATE_UP, C.ROLE_DOWN)

    def norms(self, i: int) -> tuple[str, ...]:
        """Layer i's norm vectors (layers.i.<name>.weight)."""
        own = MIXERS[self.mixers[i]].norms(self, i)
        own = own if self.has_mlp(i) else tuple(n for n in own if n not in ("mlp_norm", "post_mlp_norm"))
        return own + ((C.PLE_NORM,) if self.ple_dim else ()) + ((C.LAYER_SCALAR,) if self.layer_scalar else ())

    def has_norm(self, i: int, name: str) -> bool:
        return name in self.norms(i)

    def params(self, i: int) -> dict[str, tuple[int, ...]]:
        """Layer i's fp32 parameters (a Gated DeltaNet layer's conv, decay and gated norm): name -> shape."""
        return MIXERS[self.mixers[i]].params(self)

    def vector_dtype(self, name: str) -> str:
        """The artifact dtype of a vector_shapes() tensor: fp32 for a mixer's parameters, else bf16."""
        return C.DTYPE_F32 if name.split(".", 2)[-1] in C.MIXER_PARAMS and name.startswith("layers.") else C.DTYPE_BF16

    @property
    def embed_mult(self) -> float | None:
        """The embedding multiplier the decoders apply (None: none): Gemma's sqrt(hidden) rounded to
        bf16 (as transformers' normalizer), or the config's embedding_multiplier."""
        if self.embed_scale:
            import numpy as np
            u = int(np.float32(self.hidden ** 0.5).view(np.uint32))
            return float(np.uint32(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).view(np.float32))
        return self.embedding_multiplier

    def layer_norms(self, i: int | None = None) -> tuple[str, ...]:
        """an attention layer's norms (a KV-sharing layer has no k_norm)"""
        return ((C.LAYER_NORMS if self.pre_norms else ()) + (("q_norm",) if self.qk_norm else ())
                + (("k_norm",) if self.qk_norm and self.owns_kv(i) else ())
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
        if i in self.nope_layers:
            rot = 0
        if self.layer_types:
            window = self.sliding_window if t == "sliding_attention" else None
        else:
            window = self.sliding_window
        return theta, rot, window

    @classmethod
    def from_recipe(cls, cfg: dict, recipe: "Recipe") -> "ModelSpec":
        return cls.from_config(recipe.with_defaults(cfg), recipe.family, **{k: recipe.feature(k) for k in FEATURES})

    @classmethod
    def from_config(cls, cfg: dict, family: str = "llama", *, qk_norm: bool = False, qkv_bias: bool = False,
                    norm_offset: bool = False, sandwich_norms: bool = False, embed_scale: bool = False,
                    act: str = "silu", pre_norms: bool = True, qk_norm_full: bool = False,
                    attn_gate: str = "none", linear_attention: bool = False, gdn_norm_eps: float = 0.0,
                    rope_optional: bool = False, mtp_layers: int = 0, v_norm: bool = False,
                    layer_scalar: bool = False, attn_scale: float = 0.0, short_conv: bool = False,
                    mamba: bool = False) -> "ModelSpec":
        blocks = ()
        for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
            if key in cfg and type(cfg[key]) is not int:
                raise SpecError(f"config.json: {key} must be an integer, got {cfg[key]!r}")
        cfg = CONFIG_VIEWS[family](cfg) if family in CONFIG_VIEWS else cfg  # (LFM2's legacy names, Nemotron-H's blocks)
        blocks = tuple(tuple(b) for b in cfg.get("sparkq_blocks") or ())
        if mamba and isinstance(cfg.get("layer_types") or cfg.get("layers_block_type"), list):
            # GraniteMoeHybrid: its mamba layers ("linear_attention" as transformers 5 saves them)
            cfg = {**cfg, "layer_types": ["mamba" if t in ("mamba", "linear_attention") else t
                                          for t in cfg.get("layer_types") or cfg["layers_block_type"]]}
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
                intermediate=int(cfg["shared_intermediate_size"] if "shared_intermediate_size" in cfg
                                 else cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                tied=bool(cfg.get("tie_word_embeddings", False)),
                rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta") or flat_rope(cfg).get("rope_theta") or 10000.0),
                max_position=int(cfg.get("max_position_embeddings", 2048)),
                rope_scaling=cfg.get("rope_scaling") or (
                    flat_rope(cfg) if flat_rope(cfg).get("rope_type") not in (None, "default") else None),
                qk_norm=qk_norm,
                qkv_bias=qkv_bias,
                sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) else None,
                norm_offset=norm_offset,
                sandwich_norms=sandwich_norms,
                embed_scale=embed_scale,
                act=act,
                layer_types=_layer_types(cfg),
                rope_by_type=rope_by_type(cfg, hidden // heads if not cfg.get("head_dim") else int(cfg["head_dim"])),
                rope_scaling_by_type=rope_scaling_by_type(cfg),
                attn_scale=float(attn_scale) if attn_scale else
                float(cfg["query_pre_attn_scalar"]) ** -0.5 if cfg.get("query_pre_attn_scalar") else
                float(cfg["attention_multiplier"]) if cfg.get("attention_multiplier") is not None else None,
                final_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
                pre_norms=pre_norms,
                qk_norm_full=qk_norm_full,
                embedding_multiplier=_multiplier(cfg, "embedding_multiplier"),
                residual_multiplier=_multiplier(cfg, "residual_multiplier") or 1.0,
                logits_divisor=_multiplier(cfg, "logits_scaling") or 1.0,
                nope_layers=_nope_layers(cfg, rope_optional),
                original_max_position=int(cfg["original_max_position_embeddings"])
                if cfg.get("original_max_position_embeddings") else None,
                attn_gate=_gate_width(cfg, attn_gate),
                gdn=gdn_shape(cfg, gdn_norm_eps) if linear_attention else None,
                sconv=conv_shape(cfg) if short_conv else None,
                ssm=ssm_shape(cfg, 0.0) if mamba else None,
                mtp_layers=int(mtp_layers),
                v_norm=v_norm,
                layer_scalar=layer_scalar,
                blocks=blocks,
            )
            types = spec.layer_types or ("full_attention",) * spec.layers
            hds = head_dims(cfg, types, spec.head_dim)
            kvf = kv_sources(cfg, types)
            ple, ple_vocab = per_layer_input(cfg)
            if hds or kvf or ple:
                spec = replace(spec, head_dims=hds, kv_from=kvf, inters=mlp_widths(cfg, kvf, spec.intermediate),
                               ple_dim=ple, ple_vocab=ple_vocab,
                               rope_by_type=rope_by_type(cfg, spec.head_dim, {t: hds[types.index(t)] for t in set(types)}
                                                         if hds else None))
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
        _check_implemented(cfg, spec)
        known = {"full_attention", "sliding_attention"} | ({"linear_attention"} if spec.gdn else set()) | (
            {"conv"} if spec.sconv else set()) | ({"mamba", "parallel"} if spec.ssm else set())
        if spec.layer_types and (len(spec.layer_types) != spec.layers or set(spec.layer_types) - known):
            raise SpecError(f"config.json: layer_types must list {'/'.join(sorted(known))} for every layer")
        if "sliding_attention" in spec.layer_types and not spec.sliding_window:
            raise SpecError("config.json: sliding_attention layers need a positive sliding_window")
        for t, theta, rot in spec.rope_by_type:
            if not (theta > 0 and 0 < rot <= max(spec.head_dims or (spec.head_dim,)) and rot % 2 == 0):
                raise SpecError(f"config.json: RoPE for {t}: theta {theta} / rotary dim {rot} out of range")
        if isinstance(cfg.get("no_rope_layers"), list) and len(cfg["no_rope_layers"]) != spec.layers:
            raise SpecError(f"config.json: no_rope_layers lists {len(cfg['no_rope_layers'])} layers, the model has {spec.layers}")
        if spec.heads % spec.kv_heads:
            raise SpecError(f"config.json: {spec.heads} heads is not a multiple of {spec.kv_heads} kv heads")
        for rs in (spec.rope_scaling, *spec.rope_scaling_by_type.values()):
            kind = rs.get("rope_type", rs.get("type")) if rs else None
            if kind not in (None, "default", "llama3", "linear", "yarn", "longrope", "proportional"):
                raise SpecError(f"config.json: RoPE type {kind!r} (rope_parameters / rope_scaling) is not implemented "
                                "(sparkq runs default, linear, llama3, yarn and longrope)")
            if kind == "longrope":
                for key in ("short_factor", "long_factor"):
                    f = rs.get(key)
                    if not isinstance(f, list) or len(f) * 2 != max(rot for _, _, rot in spec.rope_by_type):
                        raise SpecError(f"config.json: rope_scaling {key} must list rotary_dim / 2 factors")
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
            for role, shape in MIXERS[self.mixers[i]].linears(self, i).items():
                out[f"layers.{i}.{role}"] = shape
            if self.has_mlp(i):
                out[f"layers.{i}.gate_up"] = ((2 if self.gated_mlp else 1) * self.inter(i), self.hidden)
                out[f"layers.{i}.down"] = (self.hidden, self.inter(i))
            if self.ple_dim:
                out[f"layers.{i}.{C.ROLE_PLE_GATE}"] = (self.ple_dim, self.hidden)
                out[f"layers.{i}.{C.ROLE_PLE_PROJ}"] = (self.hidden, self.ple_dim)
        if self.ple_dim:  # the per-layer input table (a row per token) and the main embedding's projection
            out[C.ROLE_PLE_EMBED] = (self.ple_vocab, self.layers * self.ple_dim)
            out[C.ROLE_PLE_MODEL] = (self.layers * self.ple_dim, self.hidden)
        if self.mtp_layers:
            out[C.MTP_FC] = (self.hidden, 2 * self.hidden)
        for j in range(self.mtp_layers):
            for role, shape in MIXERS[C.MIXER_ATTENTION].linears(self, None).items():
                out[C.MTP_LAYER.format(j=j) + role] = shape
            out[C.MTP_LAYER.format(j=j) + C.ROLE_GATE_UP] = (2 * self.intermediate, self.hidden)
            out[C.MTP_LAYER.format(j=j) + C.ROLE_DOWN] = (self.hidden, self.intermediate)
        if not self.tied:
            out[C.ROLE_EMBED] = (self.vocab, self.hidden)
        out[C.ROLE_LM_HEAD] = (self.vocab, self.hidden)
        return out

    def part_rows(self, name: str, parts: int | None = None) -> list[int]:
        """Rows of each fused part (q, k, v) or (gate, up); one entry for unfused, or where the
        checkpoint stores the parts as one tensor (``parts`` = 1: Phi-3's qkv_proj, gate_up_proj)."""
        if parts == 1:
            return [self.linear_shapes()[name][0]]
        role = name.rsplit(".", 1)[-1]
        mixer = self.mixers[int(name.split(".")[1])] if name.startswith("layers.") else None
        if mixer == C.MIXER_GDN:
            g = self.gdn
            if role == C.ROLE_QKV:
                return [g.key_dim, g.key_dim, g.value_dim]
            if role == C.ROLE_GATE:
                return [g.value_dim, g.v_heads, g.v_heads]
        if (mixer == C.MIXER_MAMBA and role in (C.ROLE_QKV, C.ROLE_GATE)) or role in (C.ROLE_SSM_IN, C.ROLE_SSM_GATE):
            g = self.ssm
            return [g.conv_dim] if role in (C.ROLE_QKV, C.ROLE_SSM_IN) else [g.inner, g.heads]
        if mixer == C.MIXER_SCONV and role == C.ROLE_QKV:
            return [3 * self.sconv.channels]
        i = int(name.split(".")[1]) if name.startswith("layers.") else None
        if role == C.ROLE_QKV:
            d = self.hd(i)
            return [self.heads * d] + ([self.kv_heads * d] * 2 if self.owns_kv(i) else [])
        if role == C.ROLE_GATE_UP:
            return [self.inter(i), self.inter(i)] if self.gated_mlp else [self.inter(i)]
        return [self.linear_shapes()[name][0]]

    def _norm_shape(self, n: str, i: int | None = None) -> tuple[int]:
        if n in ("q_norm", "k_norm"):
            return ((self.q_dim if n == "q_norm" else self.kv_dim),) if self.qk_norm_full else (self.hd(i),)
        return (1,) if n == C.LAYER_SCALAR else (self.hidden,)

    def vector_shapes(self) -> dict[str, tuple[int, ...]]:
        """Artifact norm / bias / mixer parameter tensor name -> shape (bf16, or fp32: vector_dtype)."""
        out = {}
        for i in range(self.layers):
            for n in self.norms(i):
                out[f"layers.{i}.{n}.weight"] = self._norm_shape(n, i)
            if self.qkv_bias and self.mixers[i] == C.MIXER_ATTENTION:
                out[f"layers.{i}.qkv.bias"] = (self.q_dim + 2 * self.kv_dim,)
            for n, shape in self.params(i).items():
                out[f"layers.{i}.{n}"] = shape
        out["norm.weight"] = (self.hidden,)
        if self.ple_dim:
            out[C.PLE_IN_NORM] = (self.ple_dim,)
        for j in range(self.mtp_layers):
            for n in self.mtp_norms:
                out[C.MTP_LAYER.format(j=j) + n + ".weight"] = self._norm_shape(n)
        if self.mtp_layers:
            out.update({n: (self.hidden,) for n in (C.MTP_NORM, C.MTP_ENORM, C.MTP_HNORM)})
        return out
