"""Config fields read into a ModelSpec (spec.py): the activation names, the refusals of fields whose
math sparkq does not implement, the output gate's width, layer types, multipliers and NoPE layers."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .recipe import SpecError
from .rope import flat_rope

if TYPE_CHECKING:
    from .spec import ModelSpec


ACTS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh"), "gelu": ("gelu",), "relu2": ("relu2",)}
# the expert count of mixture-of-experts MLPs (each family's name for it): a positive one is refused,
# sparkq runs dense MLPs (a dense config may still carry num_experts_per_tok and the like: Granite 4.0)
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _check_implemented(cfg: dict, spec: ModelSpec) -> None:
    """Config fields that would change the math in a way sparkq does not implement: refused by name,
    never converted into a silently different model."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act is not None and act not in ACTS[spec.act]:
        field_ = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
        raise SpecError(f"config.json: {field_}={act!r} is not implemented for {spec.family} "
                        f"(sparkq runs {' / '.join(ACTS[spec.act])} here)")
    if cfg.get("mlp_bias"):
        raise SpecError("config.json: mlp_bias=true (biases on the MLP projections) is not implemented")
    if cfg.get("attention_bias") and not spec.qkv_bias:
        raise SpecError("config.json: attention_bias=true (biases on q/k/v/o) is not implemented for "
                        f"{spec.family}")
    if cfg.get("attn_logit_softcapping"):
        raise SpecError("config.json: attn_logit_softcapping (soft-capped attention scores) is not implemented")
    types = set(cfg.get("layer_types") or cfg.get("layers_block_type") or ())
    if "mamba" in types and spec.ssm is None:
        raise SpecError(f"config.json: layer_types has mamba layers, which the {spec.family} recipe does not implement "
                        "(sparkq runs them as Granite 4.0-H Mamba-2 layers)")
    if "conv" in types and spec.sconv is None:
        raise SpecError(f"config.json: layer_types has conv layers, which the {spec.family} recipe does not implement "
                        "(sparkq runs them as LFM2 gated short convolutions)")
    if "linear_attention" in types and spec.gdn is None:
        raise SpecError(f"config.json: layer_types has linear_attention layers, which the {spec.family} recipe does "
                        "not implement (sparkq runs them as Qwen3.5 / OLMo Hybrid Gated DeltaNet layers)")
    moe = next((f for f in MOE_FIELDS if cfg.get(f)), None)
    if moe:
        raise SpecError(f"config.json: {moe}={cfg[moe]} (mixture-of-experts MLPs) is not implemented; sparkq runs "
                        "dense MLPs")
    if cfg.get("attention_k_eq_v"):
        raise SpecError("config.json: attention_k_eq_v=true (full-attention layers whose values are their keys, "
                        "Gemma 4 26B / 31B) is not implemented; sparkq runs the E2B / E4B layout")
    if cfg.get("enable_moe_block"):
        raise SpecError(f"config.json: enable_moe_block=true ({cfg.get('num_experts')} experts, mixture-of-experts MLPs: "
                        "Gemma 4 26B-A4B) is not implemented; sparkq runs dense MLPs")
    if cfg.get("use_bidirectional_attention"):
        raise SpecError("config.json: use_bidirectional_attention=true (an encoder) is not implemented")


def _lfm(cfg: dict) -> dict:
    """LFM2 / LFM3 configs as spec.py reads them (Lfm2Config's legacy names: norm_eps, block_ff_dim,
    tie_embedding, full_attn_idxs; the MLP width LFM2 derives from block_auto_adjust_ff_dim); a
    legacy switch that changes the math is refused by name."""
    out = dict(cfg)
    for key, bad in (("block_use_swiglu", False), ("use_pos_enc", False), ("use_sandwich_norm", False)):
        if key in cfg and cfg[key] is bad:
            raise SpecError(f"config.json: {key}={str(bad).lower()} is not implemented")
    for key in ("conv_dim", "conv_dim_out", "block_dim"):
        if key in cfg and cfg[key] != cfg.get("hidden_size"):
            raise SpecError(f"config.json: {key}={cfg[key]} differs from hidden_size; not implemented")
    out.setdefault("rms_norm_eps", cfg.get("norm_eps", cfg.get("block_norm_eps", 1e-5)))
    if "tie_embedding" in cfg:
        out["tie_word_embeddings"] = bool(cfg["tie_embedding"])
    out.setdefault("tie_word_embeddings", True)
    inter = cfg.get("block_ff_dim", cfg.get("intermediate_size"))
    if cfg.get("model_type", "lfm2") == "lfm2" and cfg.get("block_auto_adjust_ff_dim", True) and type(inter) is int:
        inter = int(2 * inter / 3)  # Lfm2MLP's width
        if cfg.get("block_ffn_dim_multiplier") is not None:
            mult = int(cfg.get("block_multiple_of", 256))
            inter = mult * ((int(float(cfg["block_ffn_dim_multiplier"]) * inter) + mult - 1) // mult)
    out["intermediate_size"] = inter
    if not cfg.get("layer_types") and isinstance(cfg.get("num_hidden_layers"), int):
        idx = cfg.get("full_attn_idxs")
        idx = range(cfg["num_hidden_layers"]) if idx is None else idx
        out["layer_types"] = ["full_attention" if i in idx else "conv" for i in range(cfg["num_hidden_layers"])]
    if cfg.get("use_attention_gate") is False:  # LFM3's per-head output gate off
        out["headwise_attn_output_gate"] = False
    return out


def _nemotron_h(cfg: dict) -> dict:
    """Nemotron-H's blocks (one norm and one mixer, MLP or experts each: hybrid_override_pattern M / * / -
    / E, or layers_block_type) as sparkq layers: a mixer block and the MLP block after it (if any) are one
    layer (``sparkq_blocks``: each layer's blocks, formats/spec.py); its mamba_* fields under the names
    formats/mixers.py reads. Experts, and an MLP block after no mixer, are refused by name."""
    kinds = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types and isinstance(cfg.get("hybrid_override_pattern"), str):
        types = [kinds.get(c, c) for c in cfg["hybrid_override_pattern"]]
    if not isinstance(types, list) or not types:
        raise SpecError("config.json: a Nemotron-H config needs its blocks (hybrid_override_pattern or layers_block_type)")
    types = [{"linear_attention": "mamba", "attention": "full_attention"}.get(t, t) for t in types]
    if "moe" in types:
        raise SpecError("config.json: Nemotron-H blocks with experts (moe / E) are not implemented; sparkq runs dense MLPs")
    if set(types) - {"mamba", "full_attention", "mlp"}:
        raise SpecError(f"config.json: Nemotron-H block types {sorted(set(types) - {'mamba', 'full_attention', 'mlp'})} "
                        "are not implemented")
    layers, blocks = [], []
    for j, t in enumerate(types):
        if t != "mlp":
            layers.append(t)
            blocks.append([j, -1])
        elif not blocks or blocks[-1][1] >= 0:
            raise SpecError(f"config.json: Nemotron-H block {j} is an MLP after no mixer; not implemented")
        else:
            blocks[-1][1] = j
    out = {k: v for k, v in cfg.items() if k not in MOE_FIELDS and k not in ("layers_block_type", "hybrid_override_pattern")}
    act = cfg.get("mamba_hidden_act", "silu")
    if act not in ACTS["silu"]:
        raise SpecError(f"config.json: mamba_hidden_act={act!r} is not implemented (sparkq runs silu)")
    if cfg.get("use_bias") or cfg.get("mlp_bias"):
        raise SpecError("config.json: use_bias / mlp_bias=true (biases on the projections) is not implemented")
    heads, head_dim = cfg.get("mamba_num_heads", 128), cfg.get("mamba_head_dim", 64)
    out.update(num_hidden_layers=len(layers), layer_types=layers, sparkq_blocks=blocks, hidden_act=cfg.get("mlp_hidden_act", "relu2"),
               rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5), position_embedding_type="nope",
               mamba_n_heads=heads, mamba_d_head=head_dim, mamba_d_ssm=heads * head_dim if isinstance(heads, int)
               and isinstance(head_dim, int) else None, mamba_d_state=cfg.get("ssm_state_size", 128),
               mamba_n_groups=cfg.get("n_groups", 8), mamba_d_conv=cfg.get("conv_kernel", 4),
               mamba_conv_bias=cfg.get("use_conv_bias", True))
    return out


def _falcon_h1(cfg: dict) -> dict:
    """Falcon-H1: every layer a parallel one (attention and Mamba-2 side by side); its lm_head_multiplier as
    the logits' divisor. The other multipliers scale rows of its linears (formats/views.py _falcon_h1)."""
    for key in ("projectors_bias", "mamba_proj_bias", "mlp_bias"):
        if cfg.get(key):
            raise SpecError(f"config.json: {key}=true (biases on the projections) is not implemented")
    if cfg.get("mamba_use_mlp") is False:
        raise SpecError("config.json: mamba_use_mlp=false (layers without an MLP) is not implemented for falcon_h1")
    out = dict(cfg)
    n = cfg.get("num_hidden_layers")
    out["layer_types"] = ["parallel"] * n if isinstance(n, int) else []
    mult = cfg.get("lm_head_multiplier", 1.0)
    if not isinstance(mult, (int, float)) or mult <= 0:
        raise SpecError(f"config.json: lm_head_multiplier={mult!r} must be a positive number")
    out["logits_scaling"] = 1.0 / float(mult)
    return out


CONFIG_VIEWS = {"lfm2": _lfm, "lfm3": _lfm, "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1}  # recipe family -> its config as spec.py reads it


def _gate_width(cfg: dict, gate: str) -> int:
    """ModelSpec.attn_gate from the recipe's attn_gate feature and the config (Spark2_5's
    headwise_attn_output_gate switches its gate off when false)."""
    if gate == "none" or cfg.get("headwise_attn_output_gate", True) is False:
        return 0
    if not isinstance(cfg.get("headwise_attn_output_gate", True), bool):
        raise SpecError("config.json: headwise_attn_output_gate must be true or false")
    return 1 if gate == "head" else int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def _layer_types(cfg: dict) -> tuple[str, ...]:
    """Per-layer attention types; GraniteMoeHybrid's "attention" is full attention (its "mamba"
    layers are refused by _check_implemented)."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ()
    return tuple({"attention": "full_attention"}.get(str(t), str(t)) for t in types)


def _multiplier(cfg: dict, key: str) -> float | None:
    """A positive scalar field of the config (Granite's multipliers), None where absent or 1."""
    v = cfg.get(key)
    if v is None:
        return None
    v = float(v)
    if not (v > 0 and v != float("inf")):
        raise SpecError(f"config.json: {key}={v} must be a positive number")
    return None if v == 1.0 else v


def _nope_layers(cfg: dict, rope_optional: bool = False) -> tuple[int, ...]:
    """The layers without RoPE: SmolLM3's no_rope_layers (one flag per layer, 0: no RoPE); every
    layer where the family's RoPE is optional and the config names no theta (OLMo Hybrid 7B's
    ``rope_theta: null``: transformers builds no rotary embedding)."""
    if rope_optional and "rope_theta" in cfg and cfg["rope_theta"] is None and not flat_rope(cfg).get("rope_theta"):
        return tuple(range(int(cfg["num_hidden_layers"])))
    if "position_embedding_type" in cfg and cfg["position_embedding_type"] != "rope":  # GraniteMoeHybrid: NoPE
        return tuple(range(int(cfg["num_hidden_layers"])))
    flags = cfg.get("no_rope_layers")
    if flags is None and cfg.get("no_rope_layer_interval"):  # transformers' default list from the interval
        n = int(cfg["no_rope_layer_interval"])
        flags = [int((i + 1) % n != 0) for i in range(int(cfg["num_hidden_layers"]))]
    if flags is None:
        return ()
    if not isinstance(flags, list) or any(f not in (0, 1) for f in flags):
        raise SpecError("config.json: no_rope_layers must list 0 or 1 per layer")
    return tuple(i for i, f in enumerate(flags) if f == 0)
