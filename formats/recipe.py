"""Recipes: one TOML per model family (``recipes/``) naming its HF tensors, its feature switches
and its quantization defaults; the recipe a config selects."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import tomllib

from . import constants as C

if TYPE_CHECKING:
    from .spec import ModelSpec


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
    # [config] table: the family's config defaults (what its config class fills in when a field is
    # absent; ``layer_types_cycle`` repeats over the layers) and, when ``known`` lists the family's
    # fields, every other field of a config is refused by name (COMMON_CONFIG_KEYS aside)
    config_defaults: tuple = ()
    config_known: tuple[str, ...] = ()
    # [layer.<mixer>] tables: a mixer's own names for its layers' tensors (formats/mixers.py), over [layer]'s
    mixer_names: tuple = ()
    # [mtp] table: the checkpoint's multi-token-prediction block (fc, norm, enorm, hnorm, prefix of its
    # layers, named as [layer] names its tensors); empty: the family has none
    mtp_names: tuple = ()

    def feature(self, name: str):
        return dict(self.features).get(name, FEATURES[name])

    def with_defaults(self, cfg: dict) -> dict:
        """cfg with the family's defaults for the fields it lacks; an unknown field refused."""
        if self.config_known:
            extra = sorted(set(cfg) - set(self.config_known) - COMMON_CONFIG_KEYS)
            if extra:
                raise SpecError(f"config.json: {', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not a "
                                f"{self.family} field sparkq implements; a config that needs "
                                f"{'it' if len(extra) == 1 else 'them'} is another model (write a recipe, --recipe FILE)")
        out = dict(cfg)
        defaults = dict(self.config_defaults)
        cycle = defaults.pop("layer_types_cycle", None)
        for k, v in defaults.items():
            out.setdefault(k, v)
        if "layer_types" not in out and type(out.get("num_hidden_layers")) is int:
            every = out.get("full_attention_interval")
            if type(every) is int and every > 0:  # Qwen3.5 / Qwen3-Next: every n-th layer attention, the rest DeltaNet
                out["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                      for i in range(out["num_hidden_layers"])]
            elif cycle:
                out["layer_types"] = [cycle[i % len(cycle)] for i in range(out["num_hidden_layers"])]
        return out

    def layer_sources(self, role: str, i: int, mixer: str | None = None) -> list[str]:
        own = dict(self.mixer_names).get(mixer, {})
        v = own[role] if role in own else self.layer_names[role]
        names = v if isinstance(v, list) else [v]
        pre = self.layer_prefix.format(i=i)
        return [pre + n for n in names]

    def mtp_sources(self, spec: "ModelSpec") -> dict[str, list[str]]:
        """The artifact's MTP tensors (spec.mtp_layers attention layers, fc, norms) -> source names."""
        if not spec.mtp_layers:
            return {}
        t = dict(self.mtp_names)
        out = {C.MTP_FC: [t["fc"]], C.MTP_NORM: [t["norm"]], C.MTP_ENORM: [t["enorm"]], C.MTP_HNORM: [t["hnorm"]]}
        for j in range(spec.mtp_layers):
            pre, art = t["prefix"].format(j=j), C.MTP_LAYER.format(j=j)
            for role in spec.layer_roles + tuple(f"{n}.weight" for n in spec.mtp_norms):  # (an attention layer's)
                v = self.layer_names[role.removesuffix(".weight")]
                out[art + role] = [pre + x for x in (v if isinstance(v, list) else [v])]
        return out

    def mtp_present(self, spec: "ModelSpec", names) -> int:
        """How many MTP layers a checkpoint with tensors ``names`` holds whole (0: none, or no [mtp] table)."""
        from dataclasses import replace
        n = 0
        while self.mtp_names and all(s in names for srcs in self.mtp_sources(replace(spec, mtp_layers=n + 1)).values()
                                     for s in srcs):
            n += 1
        return n

    def source_names(self, spec: "ModelSpec") -> dict[str, list[str]]:
        """Artifact linear name or vector tensor name -> HF source tensor names (parts in
        fusion order; fused vectors such as the qkv bias are concatenated)."""
        out: dict[str, list[str]] = {}
        for i in range(spec.layers):
            mixer = spec.mixers[i]
            for role in spec.roles(i):
                srcs = self.layer_sources(role, spec.block(i, role), mixer)
                # a KV-sharing layer's qkv: its q rows alone (a checkpoint's k / v there are unused)
                out[f"layers.{i}.{role}"] = srcs if role != C.ROLE_QKV or spec.owns_kv(i) else srcs[:1]
            for role in spec.norms(i):
                out[f"layers.{i}.{role}.weight"] = self.layer_sources(role, spec.block(i, role), mixer)
            for name in spec.params(i):
                out[f"layers.{i}.{name}"] = self.layer_sources(name, spec.block(i, name), mixer)
            if spec.qkv_bias and mixer == C.MIXER_ATTENTION:
                out[f"layers.{i}.qkv.bias"] = self.layer_sources("qkv_bias", i)
        out["norm.weight"] = [self.global_names["norm"]]
        if spec.ple_dim:  # the per-layer input embedding's global tensors ([global] ple_*)
            for name in (C.ROLE_PLE_EMBED, C.ROLE_PLE_MODEL, C.PLE_IN_NORM):
                out[name] = [self.global_names[name.removesuffix(".weight")]]
        out.update(self.mtp_sources(spec))
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
    "act": "silu",            # MLP gate activation: silu | gelu_tanh | gelu (exact, erf) | relu2 (relu(up)^2, no gate)
    "pre_norms": True,        # norms before attention and the MLP (OLMo2 has only the sandwich's after)
    "qk_norm_full": False,    # q_norm / k_norm over all heads' q and k, before the split into heads (OLMo2)
    # an output gate on attention: sigmoid of the `gate` linear (from the attention's normed input)
    # times each head's output before o; "head": one scalar per query head (Spark2_5's g_proj, on
    # where the config's headwise_attn_output_gate is), "channel": one per output channel
    "attn_gate": "none",
    "linear_attention": False,  # Gated DeltaNet layers (layer type linear_attention; formats/mixers.py)
    "gdn_norm_eps": 0.0,      # the Gated DeltaNet output norm's eps (0: rms_norm_eps; OLMo Hybrid fixes 1e-5)
    "short_conv": False,      # gated short convolutions (layer type conv: LFM2 / LFM3; formats/mixers.py)
    "mamba": False,           # Mamba-2 layers (layer type mamba, or linear_attention in GraniteMoeHybrid configs)
    "rope_optional": False,   # rope_theta: null means no RoPE (OLMo Hybrid 7B), not the default theta
    "mtp_layers": 0,          # multi-token-prediction layers the artifact holds (the converter sets it: [mtp])
    "v_norm": False,          # values RMS-normed per head without a weight (Gemma 4)
    "layer_scalar": False,    # each layer's output times its stored scalar (Gemma 4: [layer] layer_scalar)
    "attn_scale": 0.0,        # the attention scores' scale (0: query_pre_attn_scalar's or head_dim^-0.5; Gemma 4: 1)
}
ACTS = ("silu", "gelu_tanh", "gelu", "relu2")
GATES = ("none", "head", "channel")

# fields every transformers config may carry (PretrainedConfig's own), never refused
COMMON_CONFIG_KEYS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "use_cache", "initializer_range", "attention_dropout", "name_or_path",
    "_name_or_path", "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "problem_type",
    "quantization_config", "auto_map", "id2label", "label2id", "task_specific_params", "finetuning_task",
    "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "cross_attention_hidden_size",
    "pruned_heads", "torchscript", "use_bfloat16", "tf_legacy_loss",
})


def _features(d: dict, path: str) -> tuple:
    if not isinstance(d, dict) or any(k not in FEATURES for k in d):
        raise SpecError(f"recipe {path}: unknown [features] {sorted(set(d) - set(FEATURES))}; known: {', '.join(FEATURES)}")
    if d.get("act", "silu") not in ACTS:
        raise SpecError(f"recipe {path}: act must be one of {', '.join(ACTS)}")
    if d.get("attn_gate", "none") not in GATES:
        raise SpecError(f"recipe {path}: attn_gate must be one of {', '.join(GATES)}")
    return tuple(sorted(d.items()))


def _config_table(d, path: str) -> tuple[tuple, tuple[str, ...]]:
    if not isinstance(d, dict) or not isinstance(d.get("defaults", {}), dict) \
            or not isinstance(d.get("known", []), list):
        raise SpecError(f"recipe {path}: [config] holds `known` (a list of field names) and [config.defaults]")
    return tuple(sorted((k, v) for k, v in d.get("defaults", {}).items())), tuple(d.get("known", []))


def _mtp_table(d, path: str) -> tuple:
    if d and (not isinstance(d, dict) or set(d) != {"fc", "norm", "enorm", "hnorm", "prefix"}):
        raise SpecError(f"recipe {path}: [mtp] names fc, norm, enorm, hnorm and prefix (with {{j}}), nothing else")
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
            layer_names={k: v for k, v in d["layer"].items() if k != "prefix" and not isinstance(v, dict)},
            mixer_names=tuple(sorted((k, v) for k, v in d["layer"].items() if isinstance(v, dict))),
            mtp_names=_mtp_table(d.get("mtp", {}), path),
            group_size=_group_size(q.get("group_size", 128), path, "group_size"),
            group_size_fallbacks=tuple(int(x) for x in q.get("group_size_fallbacks", (64, 32))),
            keep_bf16=_roles(q.get("keep_bf16", []), "keep_bf16", path),
            keep_int8=_roles(q.get("keep_int8", []), "keep_int8", path),
            head_group_size=_group_size(q.get("head_group_size"), path, "head_group_size"),
            features=_features(d.get("features", {}), path),
            path=path,
            config_defaults=_config_table(d.get("config", {}), path)[0],
            config_known=_config_table(d.get("config", {}), path)[1],
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
    supported = sorted([a for r in recipes.values() for a in r.architectures] + list(TEXT_MODELS))
    raise SpecError(
        f"unknown architecture {archs or config.get('model_type')!r}; supported: "
        f"{', '.join(supported)}; write a recipe (see recipes/llama.toml) and pass --recipe FILE"
    )


# Multimodal wrappers whose text model sparkq runs alone: architecture -> (the text model's
# architecture and model_type, its tensor prefixes in the wrapper's checkpoints as (model, lm_head):
# the layout transformers saves and the hub checkpoints use, then transformers 5's own). The vision
# tower and projector are dropped.
TEXT_MODELS = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text",
                                       (("language_model.model.", "language_model.lm_head."),
                                        ("model.language_model.", "lm_head."))),
    # (its multi-token-prediction block, mtp.*, keeps its names: recipes/qwen3_5.toml [mtp])
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "qwen3_5_text", (("model.language_model.", "lm_head."),)),
    # (Gemma 4 E2B / E4B: its vision and audio towers and their embedders dropped)
    "Gemma4ForConditionalGeneration": ("Gemma4ForCausalLM", "gemma4_text", (("model.language_model.", "lm_head."),)),
}


def wrapper_architecture(config: dict) -> str | None:
    """The config's multimodal wrapper architecture that TEXT_MODELS knows, or None."""
    return next((a for a in (config.get("architectures") or []) if a in TEXT_MODELS), None)


def text_model_view(config: dict, names) -> tuple[dict, dict[str, str]]:
    """A multimodal wrapper's text model: (its config as a text-only checkpoint's, {text-only
    tensor name: the wrapper's name}) for the tensor ``names`` present."""
    arch = wrapper_architecture(config)
    text_arch, model_type, prefixes = TEXT_MODELS[arch]
    tc = config.get("text_config")
    if not isinstance(tc, dict):
        raise SpecError(f"config.json: {arch} without a text_config object; the checkpoint is incomplete")
    text = {**tc, "architectures": [text_arch], "model_type": model_type,
            "tie_word_embeddings": tc.get("tie_word_embeddings", config.get("tie_word_embeddings", True))}
    for model_prefix, head_prefix in prefixes:
        if any(n.startswith(model_prefix) for n in names):
            break
    else:
        raise SpecError(f"{arch} checkpoint without its language model's tensors "
                        f"({' or '.join(p for p, _ in prefixes)}...); the checkpoint is incomplete")
    out = {}
    for n in names:
        if n.startswith(model_prefix):
            out["model." + n[len(model_prefix):]] = n
        elif n.startswith(head_prefix):
            out["lm_head." + n[len(head_prefix):]] = n
        elif n.startswith("mtp."):
            out[n] = n
    if "lm_head.weight" not in out:  # no head of its own: the embedding is the head, whatever the config says
        text["tie_word_embeddings"] = True
    return text, out
