"""llama.cpp's ``lfm2``, ``granitehybrid``, ``nemotron_h`` and ``falcon-h1`` GGUF layouts undone
(convert/gguf_source.py reads them): LFM2's short-conv / attention hybrid (Lfm2ForCausalLM), Granite
4.0-H's Mamba-2 / attention hybrid (GraniteMoeHybridForCausalLM without experts), Nemotron-H's blocks
of one mixer each (NemotronHForCausalLM, dense) and Falcon-H1's parallel attention + Mamba-2 layers
(FalconH1ForCausalLM), their tensors mapped back to the Hugging Face names and their configs rebuilt
from the metadata llama.cpp's LFM2Model, GraniteHybridModel, NemotronHModel and FalconH1Model write.
Granite's shared MLP, split by llama.cpp into ffn_gate and ffn_up, is read as the fused [gate; up] of
the checkpoint (Stacked); the Mamba-2 parameters are read as fp32, ssm_a = -exp(A_log) undone.
Nemotron-H's block pattern (M / * / -) is read back from which tensors each block has. Falcon-H1's
muP multipliers are folded into its weights by llama.cpp (FalconH1Model.modify_tensors) and stored
nowhere: the rebuilt config carries every multiplier as 1, which runs the file's math."""
from __future__ import annotations

import re

import numpy as np

from .errors import ConvertError

# GGUF block tensor -> HF module under model.layers.N (LFM2Model / GraniteHybridModel's tensor map)
LAYER_MAPS = {
    "lfm2": {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.out_proj",
             "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
             "shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv", "shortconv.out_proj": "conv.out_proj",
             "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"},
    # (ffn_gate / ffn_up: the halves of shared_mlp.input_linear, stacked again by stack_mlp)
    "granitehybrid": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                      "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                      "attn_output": "self_attn.o_proj", "ffn_gate": "shared_mlp.gate", "ffn_up": "shared_mlp.up",
                      "ffn_down": "shared_mlp.output_linear", "ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d",
                      "ssm_norm": "mamba.norm", "ssm_out": "mamba.out_proj"},
    # (NemotronHModel: under backbone.layers.N, LAYER_PREFIX; one norm per block, its mixer's tensors)
    "nemotron_h": {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
                   "ssm_norm": "mixer.norm", "ssm_out": "mixer.out_proj", "attn_q": "mixer.q_proj",
                   "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj",
                   "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj"},
    "falcon-h1": {"attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm", "attn_q": "self_attn.q_proj",
                  "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
                  "ssm_out": "mamba.out_proj", "ffn_gate": "feed_forward.gate_proj",
                  "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj"},
}
# GGUF block tensors named whole (no .weight suffix) -> HF parameter under model.layers.N
# (Falcon-H1's pre-MLP norm: blk.N.ffn_norm, no suffix, as llama.cpp's tensor map and loader name it)
LAYER_WHOLE = {"granitehybrid": {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"},
               "nemotron_h": {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias"},
               "falcon-h1": {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias",
                             "ffn_norm": "pre_ff_layernorm.weight"}}
GLOBAL_MAPS = {"lfm2": {"token_embd_norm": "model.embedding_norm"},  # LFM2's final norm (no output_norm)
               "nemotron_h": {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f"},
               "falcon-h1": {"output_norm": "model.final_layernorm"}}
LAYER_PREFIX = {"nemotron_h": "backbone.layers"}  # (the others: model.layers)
# GGUF architecture -> (HF architecture, model_type, layer map, q/k permuted by llama.cpp, norms stored as 1 + w)
ARCHS = {
    "lfm2": ("Lfm2ForCausalLM", "lfm2", "lfm2", False, False),
    # (GraniteHybridModel permutes q/k as LlamaModel does; an all-attention Granite 4.0 is written as granite)
    "granitehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid", "granitehybrid", True, False),
    # (NemotronHModel permutes q/k through GraniteHybridModel, though its attention has no RoPE;
    # FalconH1Model maps its attention as Mamba2Model does, unpermuted)
    "nemotron_h": ("NemotronHForCausalLM", "nemotron_h", "nemotron_h", True, False),
    "falcon-h1": ("FalconH1ForCausalLM", "falcon_h1", "falcon-h1", False, False),
}
# the q / k projections llama.cpp permutes (where ARCHS says so)
Q_PROJ, K_PROJ = ("self_attn.q_proj.weight", "mixer.q_proj.weight"), ("self_attn.k_proj.weight", "mixer.k_proj.weight")
# GGUF architecture -> the dense MLPs sparkq runs instead, where llama.cpp also writes experts
MOE_DENSE = {"granitehybrid": "Granite 4.0-H with a dense shared MLP", "nemotron_h": "Nemotron-H's dense MLP blocks (-)",
             "nemotron_h_moe": "Nemotron-H's dense MLP blocks (nemotron_h)"}
# Mamba-2 parameters read (and imported) as fp32: fp32 in the artifact (formats/spec.py vector_dtype)
FP32_PARAMS = tuple(f"{m}.{p}" for m in ("mamba", "mixer") for p in ("A_log", "dt_bias", "D", "conv1d.weight",
                                                                     "conv1d.bias", "norm.weight"))
# HF parameters llama.cpp stores as -exp(p) (log(-a) undoes it)
NEG_EXP = ("linear_attn.A_log", "mamba.A_log", "mixer.A_log")
GRANITE_SCALES = (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                  ("attention.scale", "attention_multiplier"), ("logit_scale", "logits_scaling"))


class Stacked:
    """Two GGUF tensors of the same width read as one, the rows of the first then the second's
    (Granite's shared_mlp.input_linear, [gate; up], which llama.cpp splits): the fields of the
    reader's tensor records that GGUFSource reads (shape in GGUF order, n_bytes, data's row count)."""

    def __init__(self, *parts):
        self.parts = parts
        self.rows = [int(p.data.shape[0]) for p in parts]
        self.shape = np.array([int(parts[0].shape[0]), sum(self.rows)])
        self.n_bytes = sum(int(p.n_bytes) for p in parts)
        self.data = np.empty((sum(self.rows), 0), np.float32)  # (shape only: its rows; the bytes are the parts')

    def spans(self, a: int, b: int):
        """(part, first row, end row) of each part rows [a, b) of the whole cover."""
        off = 0
        for p, n in zip(self.parts, self.rows):
            if a < off + n and b > off:
                yield p, max(a - off, 0), min(b - off, n)
            off += n


def refuse_moe(path, arch: str, field, names) -> None:
    """A granitehybrid or nemotron_h GGUF with routed experts (Granite 4.0-H Tiny / Small; Nemotron-H's
    E blocks), and every nemotron_h_moe GGUF (Nemotron 3 Nano / Super), refused by name."""
    if arch not in MOE_DENSE:
        return
    n = int(field(f"{arch}.expert_count", 0) or 0)
    if n or arch == "nemotron_h_moe" or any("_exps." in t or "_shexp." in t or ".ffn_gate_inp." in t for t in names):
        raise ConvertError(f"{path}: GGUF {arch} model has mixture-of-experts MLPs ({n} experts, ffn_*_exps tensors), "
                           f"which sparkq does not run; sparkq runs {MOE_DENSE[arch]}")


def stack_mlp(tensors: dict) -> dict:
    """Granite's shared MLP halves (shared_mlp.gate / .up, as mapped from ffn_gate / ffn_up) stacked
    into the checkpoint's shared_mlp.input_linear.weight; tensors of other architectures as they are."""
    out = {}
    for name, t in tensors.items():
        if m := re.fullmatch(r"(.+\.shared_mlp\.)(gate|up)\.weight", name):
            gate, up = tensors.get(m.group(1) + "gate.weight"), tensors.get(m.group(1) + "up.weight")
            if gate is None or up is None or int(gate.shape[0]) != int(up.shape[0]):
                raise ConvertError(f"GGUF tensor {name!r}: the shared MLP's ffn_gate and ffn_up do not pair up")
            out[m.group(1) + "input_linear.weight"] = Stacked(gate, up)
        else:
            out[name] = t
    return out


def hf_shapes(shapes: dict) -> None:
    """The checkpoint's shapes of the tensors llama.cpp reshaped, in place: the depthwise convs
    squeezed to [C, K] (LFM2's conv.conv, Mamba's conv1d) back to [C, 1, K]; Mamba's A and D, [H, 1],
    back to [H]; its grouped norm [G, d / G] back to [d]."""
    for n, s in shapes.items():
        if n.endswith(("conv.conv.weight", "mamba.conv1d.weight", "mixer.conv1d.weight")) and len(s) == 2:
            shapes[n] = (s[0], 1, s[1])
        elif n.endswith(tuple(f"{m}.{p}" for m in ("mamba", "mixer") for p in ("A_log", "D", "norm.weight"))) \
                and len(s) == 2:
            shapes[n] = (s[0] * s[1],)


def _layers_with(tensors, suffix: str) -> set[int]:
    return {int(m.group(1)) for n in tensors if n.endswith(suffix) and (m := re.match(r"model\.layers\.(\d+)\.", n))}


def hybrid_config(field, a: str, config: dict, tensors) -> None:
    """The config fields of Lfm2Config / GraniteMoeHybridConfig (those recipes/lfm2.toml and
    recipes/granitemoehybrid.toml read) from the metadata and the tensors the layers have; those of
    NemotronHConfig and FalconH1Config by nemotron_config and falcon_config."""
    if a in ("nemotron_h", "falcon-h1"):
        return (nemotron_config if a == "nemotron_h" else falcon_config)(field, a, config, tensors)
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    if config.pop("head_dim") != hidden // heads:  # (neither config has a head_dim of its own)
        raise ConvertError(f"GGUF {a} model's attention head width is not hidden_size / head_count; not implemented")
    kv = field(f"{a}.attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    if len(kv) < layers:
        raise ConvertError(f"GGUF metadata {a}.attention.head_count_kv lists {len(kv)} layers, not {layers}")
    if a == "lfm2":  # LFM2Model: 0 KV heads marks a conv layer; the MLP width written after auto-adjusting
        config.pop("hidden_act")
        config.update(
            norm_eps=config.pop("rms_norm_eps"), conv_L_cache=int(field(f"{a}.shortconv.l_cache", 3)),
            layer_types=["conv" if int(kv[i]) == 0 else "full_attention" for i in range(layers)],
            block_auto_adjust_ff_dim=False, conv_bias=any(n.endswith("conv.in_proj.bias") for n in tensors),
            rope_parameters={"rope_type": "default", "rope_theta": config.pop("rope_theta")})
        return
    mamba = _layers_with(tensors, "mamba.in_proj.weight")
    inner, ssm_heads = int(field(f"{a}.ssm.inner_size")), int(field(f"{a}.ssm.time_step_rank"))
    if inner % hidden or inner % ssm_heads:
        raise ConvertError(f"GGUF {a} model's SSM width {inner} is not a multiple of hidden_size {hidden} and "
                           f"of its {ssm_heads} heads; not implemented")
    # granite-hybrid.cpp: rope.scaling.finetuned is the RoPE switch (default on), off for Granite 4.0-H
    rope = bool(field(f"{a}.rope.scaling.finetuned", True))
    if rope and int(field(f"{a}.rope.dimension_count", hidden // heads)) != hidden // heads:
        raise ConvertError(f"GGUF {a} model has partial RoPE (Bamba's); GraniteMoeHybrid's is full, not implemented")
    for key, hf in GRANITE_SCALES:  # (float32 in the file: their shortest decimals, the checkpoint's 0.1)
        if (v := field(f"{a}.{key}", None)) is not None:
            config[hf] = float(str(np.float32(v)))
    config.update(
        layer_types=["mamba" if i in mamba else "attention" for i in range(layers)],
        position_embedding_type="rope" if rope else "nope", num_local_experts=0,
        shared_intermediate_size=int(field(f"{a}.expert_shared_feed_forward_length", config["intermediate_size"])),
        attention_bias=any(n.endswith("self_attn.q_proj.bias") for n in tensors),
        mamba_n_heads=ssm_heads, mamba_d_head=inner // ssm_heads, mamba_expand=inner // hidden,
        mamba_d_state=int(field(f"{a}.ssm.state_size")), mamba_n_groups=int(field(f"{a}.ssm.group_count")),
        mamba_d_conv=int(field(f"{a}.ssm.conv_kernel")),
        mamba_conv_bias=any(n.endswith("mamba.conv1d.bias") for n in tensors),
        mamba_proj_bias=any(n.endswith("mamba.in_proj.bias") for n in tensors),
        # (Mamba2Model pads the vocabulary list to a multiple of 8; the embedding has the model's rows)
        vocab_size=int(tensors["model.embed_tokens.weight"].shape[-1]))


def _has(tensors, suffix: str) -> bool:
    return any(n.endswith(suffix) for n in tensors)


def _f32(v) -> float:
    """A float32 of the file as its shortest decimal (the checkpoint's 1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(v)))


def _mamba(field, a: str) -> tuple[int, int]:
    """(SSM width, SSM heads) from the metadata, the width a whole number of heads."""
    inner, heads = int(field(f"{a}.ssm.inner_size")), int(field(f"{a}.ssm.time_step_rank"))
    if not heads or inner % heads:
        raise ConvertError(f"GGUF {a} model's SSM width {inner} is not a multiple of its {heads} heads; not implemented")
    return inner, heads


def nemotron_config(field, a: str, config: dict, tensors) -> None:
    """NemotronHConfig's fields (those formats/fields.py _nemotron_h reads) from NemotronHModel's
    metadata: the block pattern (hybrid_override_pattern, M Mamba-2 / * attention / - MLP) from the
    tensors each block has, checked against the per-block KV head counts and MLP widths (0 where a
    block has none), which llama.cpp's loader reads the blocks from."""
    layers = config["num_hidden_layers"]
    kinds = (("M", "mixer.in_proj.weight"), ("*", "mixer.q_proj.weight"), ("-", "mixer.up_proj.weight"))
    pattern = ""
    for i in range(layers):
        has = [c for c, t in kinds if f"{LAYER_PREFIX[a]}.{i}.{t}" in tensors]
        if len(has) != 1:
            raise ConvertError(f"GGUF {a} block {i} has {'no' if not has else 'more than one'} mixer "
                               "(Mamba-2 ssm_*, attention attn_*, MLP ffn_*); not a dense Nemotron-H")
        pattern += has[0]
    kv, ff = ([int(x) for x in v] if isinstance(v := field(f"{a}.{key}"), list) else [int(v)] * layers
              for key in ("attention.head_count_kv", "feed_forward_length"))
    if min(len(kv), len(ff)) < layers:
        raise ConvertError(f"GGUF metadata {a}: head_count_kv / feed_forward_length list fewer than {layers} blocks")
    for i, c in enumerate(pattern):
        if (kv[i] > 0) != (c == "*") or (ff[i] > 0) != (c == "-"):
            raise ConvertError(f"GGUF {a} block {i}: its metadata (KV heads, MLP width) does not match its {c!r} tensors")
    widths = {w for w in ff[:layers] if w}
    if len(widths) > 1:
        raise ConvertError(f"GGUF {a} model's MLP blocks have widths {sorted(widths)}; one width is implemented")
    inner, heads = _mamba(field, a)
    eps = field(f"{a}.attention.layer_norm_epsilon", None) or config["rms_norm_eps"]  # (the loader's fallback)
    for k in ("rms_norm_eps", "rope_theta", "hidden_act"):  # (no RoPE: nemotron-h.cpp; relu2 MLPs, silu Mamba)
        config.pop(k)
    config.update(
        hybrid_override_pattern=pattern, intermediate_size=widths.pop() if widths else config["intermediate_size"],
        layer_norm_epsilon=_f32(eps), mlp_hidden_act="relu2", mamba_hidden_act="silu",
        mamba_num_heads=heads, mamba_head_dim=inner // heads, ssm_state_size=int(field(f"{a}.ssm.state_size")),
        n_groups=int(field(f"{a}.ssm.group_count")), conv_kernel=int(field(f"{a}.ssm.conv_kernel")),
        use_conv_bias=_has(tensors, "mixer.conv1d.bias"), use_bias=_has(tensors, "mixer.in_proj.bias"),
        mlp_bias=_has(tensors, "mixer.up_proj.bias"), attention_bias=_has(tensors, "mixer.q_proj.bias"),
        # (the vocabulary list padded to a multiple of 8 by llama.cpp; the embedding has the model's rows)
        vocab_size=int(tensors["backbone.embeddings.weight"].shape[-1]))


# Falcon-H1's muP multipliers, all folded into the weights by FalconH1Model.modify_tensors (the
# embedding, lm_head, q / k / v / o, in_proj's z | x | B | C | dt rows, out_proj, the MLP's gate and
# down): 1 here, so sparkq runs the GGUF's math (the file stores none of them)
FALCON_FOLDED = {"embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "attention_in_multiplier": 1.0,
                 "attention_out_multiplier": 1.0, "key_multiplier": 1.0, "ssm_in_multiplier": 1.0,
                 "ssm_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0, 1.0]}


def falcon_config(field, a: str, config: dict, tensors) -> None:
    """FalconH1Config's fields from FalconH1Model's metadata: the SSM width is mamba_d_ssm (not
    expand x hidden); the Mamba norm present where ssm_norm is, after the gate (llama.cpp's only
    order); the multipliers FALCON_FOLDED."""
    inner, heads = _mamba(field, a)
    config.update(
        rope_parameters={"rope_type": "default", "rope_theta": config.pop("rope_theta")},
        **{k: list(v) if isinstance(v, list) else v for k, v in FALCON_FOLDED.items()},
        mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads,
        mamba_d_state=int(field(f"{a}.ssm.state_size")), mamba_n_groups=int(field(f"{a}.ssm.group_count")),
        mamba_d_conv=int(field(f"{a}.ssm.conv_kernel")), mamba_conv_bias=_has(tensors, "mamba.conv1d.bias"),
        mamba_proj_bias=_has(tensors, "mamba.in_proj.bias"), projectors_bias=_has(tensors, "mamba.out_proj.bias"),
        mamba_rms_norm=_has(tensors, "mamba.norm.weight"), mamba_norm_before_gate=False,
        attention_bias=_has(tensors, "self_attn.q_proj.bias"), mlp_bias=_has(tensors, "feed_forward.gate_proj.bias"),
        vocab_size=int(tensors["model.embed_tokens.weight"].shape[-1]))
