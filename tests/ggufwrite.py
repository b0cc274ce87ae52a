"""Tiny GGUF files as llama.cpp's converter (convert_hf_to_gguf.py) writes them, from the tiny HF
checkpoints of helpers.make_llama, helpers.make_hybrid (Qwen3.5) and ssm_models.make_ssm (LFM2,
Granite 4.0-H, Nemotron-H, Falcon-H1): the same architecture names, tensor names, q/k permutation
(llama, granite, nemotron_h), ``1 + w`` norms (gemma3, qwen35), Qwen3.5's DeltaNet transforms
(``-exp(A_log)``, the squeezed conv, value heads tiled), the hybrids' (per-layer KV head counts and
MLP widths, squeezed convs, the shared MLP split, ``-exp(A_log)``, A and D as [H, 1], the grouped
norm, Falcon-H1's multipliers folded into its weights), metadata keys and tokenizer fields. Written
with gguf-py's own writer; the tests read them with sparkq and with transformers' GGUF loader."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# HF architecture -> GGUF architecture (llama.cpp writes Mistral as llama)
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
             "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite",
             "GraniteMoeHybridForCausalLM": "granite", "Olmo2ForCausalLM": "olmo2",
             "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5ForConditionalGeneration": "qwen35", "Lfm2ForCausalLM": "lfm2",
             "NemotronHForCausalLM": "nemotron_h", "FalconH1ForCausalLM": "falcon-h1"}
MAMBA_H = ("nemotron_h", "falcon-h1")  # (their metadata: mamba_hybrid_keys; their tensors: mamba_hybrid_tensors)
PERMUTED = ("llama", "smollm3", "granite", "granitehybrid")  # llama.cpp's q/k row permutation (LlamaModel.permute)
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm"}
LAYER_LLAMA = {**LAYER, "post_attention_layernorm": "ffn_norm"}
LAYER_GEMMA = {**LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
LAYER_PHI3 = {**LAYER_LLAMA, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
LAYER_OLMO2 = {**LAYER, "post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
LAYER_GRANITE4 = {**LAYER_LLAMA, "shared_mlp.output_linear": "ffn_down"}  # input_linear: split into ffn_gate, ffn_up
# Granite 4.0-H's Mamba-2 layers (GraniteHybridModel / Mamba2Model); A_log, D, dt_bias: GRANITE_H_WHOLE
LAYER_GRANITE_H = {**LAYER_GRANITE4, "mamba.in_proj": "ssm_in", "mamba.conv1d": "ssm_conv1d", "mamba.norm": "ssm_norm",
                   "mamba.out_proj": "ssm_out"}
GRANITE_H_WHOLE = {"mamba.A_log": "ssm_a", "mamba.D": "ssm_d", "mamba.dt_bias": "ssm_dt.bias"}
LAYER_LFM2 = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
              "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
              "conv.in_proj": "shortconv.in_proj", "conv.conv": "shortconv.conv", "conv.out_proj": "shortconv.out_proj",
              "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down"}
# Qwen3.5 (conversion/qwen.py Qwen3_5TextModel): HF module under model.layers.N -> GGUF block tensor
LAYER_QWEN35 = {**LAYER, "post_attention_layernorm": "post_attention_norm",
                "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
                "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
                "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out"}
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}" \
                "{% if add_generation_prompt %}<|assistant|>{% endif %}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reorder_v_heads(t: np.ndarray, axis: int, k_heads: int, v_heads: int, dim: int) -> np.ndarray:
    """llama.cpp's _LinearAttentionVReorderBase._reorder_v_heads: the value heads along axis from
    grouped by key head ([k_heads, ratio, dim]) to tiled ([ratio, k_heads, dim])."""
    shape = list(t.shape)
    t = t.reshape(*shape[:axis], k_heads, v_heads // k_heads, dim, *shape[axis + 1:])
    return np.swapaxes(t, axis, axis + 1).reshape(shape)


def qwen35_tensors(tensors: dict, cfg: dict, mtp: int = 0, seed: int = 0) -> dict:
    """GGUF name -> array of a Qwen3.5 text model's HF tensors, as Qwen3_5TextModel.modify_tensors
    writes them: norms 1 + w except the DeltaNet's, A_log as -exp(A_log), the conv squeezed to
    [C, K], dt_bias as ssm_dt.bias, and (where value heads outnumber key heads) every value-indexed
    row, channel or column reordered from grouped to tiled. mtp: that many multi-token-prediction
    blocks after the decoder's (random tensors under llama.cpp's names, a full-attention layer and
    the nextn.* tensors), which a reader must drop."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, hidden = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    qk = 2 * hk * dk
    reorder = hk != hv

    def v(t, axis, dim):
        return reorder_v_heads(t, axis, hk, hv, dim) if reorder else t
    out = {"token_embd.weight": tensors["model.embed_tokens.weight"], "output_norm.weight": tensors["model.norm.weight"] + 1}
    if "lm_head.weight" in tensors and not cfg.get("tie_word_embeddings", False):
        out["output.weight"] = tensors["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for name, t in tensors.items():
            if not name.startswith(pre):
                continue
            hf = name[len(pre):]
            if hf == "linear_attn.A_log":
                out[f"blk.{i}.ssm_a"] = v(-np.exp(t), 0, 1)
                continue
            if hf == "linear_attn.dt_bias":
                out[f"blk.{i}.ssm_dt.bias"] = v(t, 0, 1)
                continue
            module, _, suffix = hf.rpartition(".")
            if hf.endswith("norm.weight") and module != "linear_attn.norm":
                t = t + 1
            if module == "linear_attn.in_proj_qkv" or module == "linear_attn.conv1d":
                t = t.reshape(t.shape[0], -1)  # (the conv squeezed: [C, 1, K] -> [C, K])
                t = np.concatenate([t[:qk], v(t[qk:], 0, dv)])
            elif module == "linear_attn.in_proj_z":
                t = v(t, 0, dv)
            elif module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
                t = v(t, 0, 1)
            elif module == "linear_attn.out_proj":
                t = v(t, 1, dv)
            out[f"blk.{i}.{LAYER_QWEN35[module]}.{suffix}"] = t
    rng = np.random.default_rng(seed)
    last = cfg["num_hidden_layers"] - 1  # (a full-attention layer: the MTP block's shapes)
    for j in range(mtp):
        b = cfg["num_hidden_layers"] + j
        for name in [n for n in out if n.startswith(f"blk.{last}.")]:
            out[f"blk.{b}." + name.split(".", 2)[2]] = rng.normal(0, 0.05, out[name].shape).astype(np.float32)
        out[f"blk.{b}.nextn.eh_proj.weight"] = rng.normal(0, 0.05, (hidden, 2 * hidden)).astype(np.float32)
        for n in ("enorm", "hnorm", "shared_head_norm"):
            out[f"blk.{b}.nextn.{n}.weight"] = rng.uniform(0.8, 1.2, hidden).astype(np.float32)
    return out


def _exp(t: np.ndarray) -> np.ndarray:
    """exp as llama.cpp's converter computes it (torch's float32 exp, to the last bit)."""
    import torch
    return torch.exp(torch.from_numpy(np.ascontiguousarray(t, np.float32))).numpy()


def lfm2_ff(cfg: dict) -> int:
    """LFM2Model._add_feed_forward_length: the MLP width, auto-adjusted as Lfm2MLP does."""
    ff = cfg.get("block_ff_dim") or cfg["intermediate_size"]
    if cfg["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        if cfg["block_ffn_dim_multiplier"] is not None:
            ff = int(cfg["block_ffn_dim_multiplier"] * ff)
        ff = cfg["block_multiple_of"] * ((ff + cfg["block_multiple_of"] - 1) // cfg["block_multiple_of"])
    return ff


def hybrid_keys(w, arch: str, cfg: dict) -> None:
    """The keys LFM2Model and GraniteHybridModel.set_gguf_parameters add to the common ones."""
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "lfm2":
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
        return
    w.add_expert_count(cfg.get("num_local_experts", 0))
    w.add_expert_used_count(cfg.get("num_experts_per_tok", 0))
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_ssm_inner_size(cfg["mamba_expand"] * cfg["hidden_size"])
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_rope_scaling_finetuned(False)  # (RoPE off: the model has Mamba layers and is not Bamba)


# Nemotron-H (NemotronHModel, under backbone.layers.N) and Falcon-H1 (FalconH1Model, under
# model.layers.N): HF module -> GGUF block tensor; A_log, D, dt_bias: MAMBA_WHOLE (Falcon-H1's
# pre_ff_layernorm.weight is blk.N.ffn_norm, no suffix: its exact name is in llama.cpp's tensor map)
LAYER_NEMOTRON_H = {"norm": "attn_norm", "mixer.in_proj": "ssm_in", "mixer.conv1d": "ssm_conv1d",
                    "mixer.norm": "ssm_norm", "mixer.out_proj": "ssm_out", "mixer.q_proj": "attn_q",
                    "mixer.k_proj": "attn_k", "mixer.v_proj": "attn_v", "mixer.o_proj": "attn_output",
                    "mixer.up_proj": "ffn_up", "mixer.down_proj": "ffn_down"}
LAYER_FALCON_H1 = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mamba.in_proj": "ssm_in",
                   "mamba.conv1d": "ssm_conv1d", "mamba.norm": "ssm_norm", "mamba.out_proj": "ssm_out",
                   "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up",
                   "feed_forward.down_proj": "ffn_down"}
MAMBA_WHOLE = {"A_log": "ssm_a", "D": "ssm_d", "dt_bias": "ssm_dt.bias"}


def nemotron_pattern(cfg: dict) -> str:
    """The config's blocks as hybrid_override_pattern (M / * / - / E), what NemotronHModel reads
    (transformers 5 saves them as layers_block_type)."""
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        return cfg["hybrid_override_pattern"]
    kinds = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
    return "".join(kinds[t] for t in cfg["layers_block_type"])


def mamba_hybrid_keys(w, arch: str, cfg: dict) -> None:
    """The metadata NemotronHModel (through GraniteHybridModel, GraniteModel, LlamaModel) and
    FalconH1Model (through Mamba2Model) write, each key at its last value. Nemotron-H: a dense
    published config (hybrid_override_pattern, no expert fields; transformers 5's NemotronHConfig saves
    MoE defaults, num_experts_per_tok, that would make llama.cpp write nemotron_h_moe), no RoPE
    (context 2^20), the rope dimension hidden / heads (head_dim popped by GraniteModel), the head
    width as key_length, the KV heads and MLP widths per block. Falcon-H1: no multiplier keys (folded
    into the weights), SSM heads d_ssm / mamba_d_head, the KV heads one count."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"] if arch != "nemotron_h" else len(nemotron_pattern(cfg)))
    w.add_head_count(heads)
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "nemotron_h":
        pat = nemotron_pattern(cfg)
        w.add_context_length(2**20)
        w.add_feed_forward_length([cfg["intermediate_size"] if c == "-" else 0 for c in pat])
        w.add_head_count_kv([cfg["num_key_value_heads"] if c == "*" else 0 for c in pat])
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        w.add_rope_dimension_count(hidden // heads)
        w.add_ssm_conv_kernel(cfg["conv_kernel"])
        w.add_ssm_state_size(cfg["ssm_state_size"])
        w.add_ssm_group_count(cfg["n_groups"])
        w.add_ssm_inner_size(cfg["mamba_num_heads"] * cfg["mamba_head_dim"])
        w.add_ssm_time_step_rank(cfg["mamba_num_heads"])
        w.add_rope_scaling_finetuned(False)
    else:
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_inner_size(cfg["mamba_d_ssm"])
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_time_step_rank(cfg["mamba_d_ssm"] // cfg["mamba_d_head"])
        w.add_ssm_group_count(cfg["mamba_n_groups"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg["rope_theta"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])


def falcon_fold(name: str, t: np.ndarray, cfg: dict) -> np.ndarray:
    """FalconH1Model.modify_tensors' multiplier folding of the HF tensor name (fp32, as the converter
    holds every tensor): the same substring tests in its order and the same torch float32 products,
    bit for bit."""
    import torch
    x = torch.from_numpy(np.array(t, np.float32))
    mlp, f = cfg["mlp_multipliers"], cfg.get
    if "down_proj" in name:
        x = x * mlp[1]
    elif "gate_proj" in name:
        x = x * mlp[0]
    elif "k_proj" in name:
        x = x * f("key_multiplier") * f("attention_in_multiplier")
    elif "q_proj" in name or "v_proj" in name:
        x = x * f("attention_in_multiplier")
    elif "o_proj" in name:
        x = x * f("attention_out_multiplier")
    elif "out_proj" in name:
        x = x * f("ssm_out_multiplier")
    elif "in_proj" in name:
        x = x * f("ssm_in_multiplier")
        m, d, gn = cfg["ssm_multipliers"], cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        for j, (a, b) in enumerate([(0, d), (d, 2 * d), (2 * d, 2 * d + gn), (2 * d + gn, 2 * d + 2 * gn),
                                    (2 * d + 2 * gn, x.shape[0])]):
            x[a:b, :] *= m[j]
    elif "lm_head" in name:
        x = x * f("lm_head_multiplier")
    elif "embed_tokens" in name:
        x = x * f("embedding_multiplier")
    return x.numpy()


def mamba_hybrid_tensors(tensors: dict, cfg: dict, arch: str) -> dict:
    """GGUF name -> array of a Nemotron-H or Falcon-H1 checkpoint, as the converter writes them:
    Mamba2Model's transforms (the conv squeezed to [C, K], A = -exp(A_log) and D as [H, 1], the norm
    as [G, d / G], dt_bias as ssm_dt.bias), Nemotron-H's q/k permuted (LlamaModel's, through
    GraniteHybridModel), Falcon-H1's multipliers folded (falcon_fold)."""
    nem = arch == "nemotron_h"
    pre, lmap = ("backbone.layers.", LAYER_NEMOTRON_H) if nem else ("model.layers.", LAYER_FALCON_H1)
    groups = cfg["n_groups"] if nem else cfg["mamba_n_groups"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    glob = {"token_embd.weight": "backbone.embeddings.weight" if nem else "model.embed_tokens.weight",
            "output_norm.weight": "backbone.norm_f.weight" if nem else "model.final_layernorm.weight"}
    if not cfg.get("tie_word_embeddings", False):
        glob["output.weight"] = "lm_head.weight"
    out = {g: tensors[h] if nem else falcon_fold(h, tensors[h], cfg) for g, h in glob.items()}
    for name, t in tensors.items():
        if not name.startswith(pre):
            continue
        i, hf = name[len(pre):].split(".", 1)
        module, _, suffix = hf.rpartition(".")
        if not nem:
            t = falcon_fold(name, t, cfg)
        if suffix in MAMBA_WHOLE:  # (A = -exp(A_log), torch's float32 exp; A and D as [H, 1])
            out[f"blk.{i}.{MAMBA_WHOLE[suffix]}"] = -_exp(t)[:, None] if suffix == "A_log" \
                else t[:, None] if suffix == "D" else t
            continue
        if hf == "pre_ff_layernorm.weight":
            out[f"blk.{i}.ffn_norm"] = t
            continue
        if t.ndim == 3:  # the depthwise conv squeezed
            t = t.reshape(t.shape[0], t.shape[2])
        elif module.endswith(".norm") and module != "norm":  # the Mamba norm, grouped
            t = t.reshape(groups, -1)
        elif nem and module == "mixer.q_proj":
            t = permute(t, heads, heads)
        elif nem and module == "mixer.k_proj":
            t = permute(t, heads, kv)
        out[f"blk.{i}.{lmap[module]}.{suffix}"] = t
    return out


def spm_vocab(size: int, gemma: bool) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: control tokens, 256 byte tokens, then pieces whose merges
    build a few English words (scores fall with the index, as sentencepiece writes them)."""
    special = ["<pad>", "<eos>", "<bos>", "<unk>"] if gemma else ["<unk>", "<s>", "</s>"]
    pieces = ["\u2581", "e", "t", "a", "o", "h", "n", "i", "s", "r", "d", "l", "u", "c", "w", "f", "q", "k", "b", "g",
              "x", "y", "p", "m", "j", "v", "z", "he", "\u2581t", "\u2581the", "in", "er", "\u2581a", "on", "\u2581o",
              "qu", "ick", "\u2581qu", "\u2581quick", "ow", "\u2581b", "\u2581br", "\u2581brown", "\u2581f", "ox",
              "\u2581fox", "\u2581d", "og", "\u2581dog", "\u2581l", "az", "\u2581laz", "\u2581lazy", "\u2581j", "um",
              "\u2581jum", "ps", "\u2581jumps", "ver", "\u2581over", "  ", "\u2581i", "\u2581in"]
    byte_toks = [f"<0x{b:02X}>" for b in range(256)]
    n_pieces = size - len(special) - 256
    assert n_pieces <= len(pieces), (size, len(pieces))
    tokens = special + byte_toks + pieces[:n_pieces]
    types = [3] * len(special) + [6] * 256 + [1] * n_pieces  # control, byte, normal
    if gemma:
        types[special.index("<unk>")] = 2  # unknown
    else:
        types[0] = 2
    scores = [0.0] * (len(special) + 256) + [-float(i) for i in range(n_pieces)]
    return tokens, scores, types


def byte_level_merges(n: int) -> list[tuple[str, str]]:
    """n GPT-2 style merges (byte-level spelling, Ġ = space) that build a few English words."""
    out, have = [], set()
    for word in ["Ġthe", "Ġquick", "Ġbrown", "Ġfox", "Ġjumps", "Ġover", "Ġlazy",
                 "Ġdog", "Ġin", "ing", "Ġto", "Ġand", "er", "Ġof", "Ġa", "ou"]:
        cur = word[0]
        for ch in word[1:]:
            if (cur, ch) not in have and len(out) < n:
                out.append((cur, ch))
                have.add((cur, ch))
            cur += ch
    return out


def write_gguf(src: Path, out: Path, qtype: str = "F32", spm: bool | None = None, mtp: int = 0) -> Path:
    """The GGUF llama.cpp would write for the HF checkpoint src (tensor type F32, F16, BF16 or Q8_0
    for the linears; spm: a SentencePiece vocabulary instead of src's byte-level one, default for
    Mistral and Gemma 3; mtp: Qwen3.5's multi-token-prediction blocks, random, at the end)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    hf_arch = cfg["architectures"][0]
    arch = GGUF_ARCH[hf_arch]
    attn_types = ("attention", "full_attention")
    if hf_arch == "GraniteMoeHybridForCausalLM" and any(t not in attn_types for t in cfg["layer_types"]):
        arch = "granitehybrid"  # (GraniteHybridModel writes granite when no layer is Mamba)
    hybrid = arch in ("lfm2", "granitehybrid")
    gemma = arch == "gemma3"
    spm = hf_arch in ("MistralForCausalLM", "Gemma3ForCausalLM") if spm is None else spm
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):  # (bf16 or fp32 checkpoints, as float32 arrays)
        tensors.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})
    qwen35 = arch == "qwen35"
    if qwen35:  # the VL wrapper's text model: language_model. stripped, the vision tower left out
        if "text_config" in cfg:  # (the wrapper's tie_word_embeddings is the top-level one)
            cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        tensors = {k.replace("model.language_model.", "model."): v for k, v in tensors.items()
                   if not k.startswith(("model.visual.", "mtp."))}
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")  # transformers would read a "mistral" in the name as an architecture gguf-py lacks
    rp = cfg.get("rope_parameters") or {}
    if arch in MAMBA_H:
        mamba_hybrid_keys(w, arch, cfg)
    else:
        w.add_context_length(2**20 if arch == "granitehybrid" else cfg.get("max_position_embeddings", 2048))
        w.add_embedding_length(cfg["hidden_size"])
        w.add_block_count(cfg["num_hidden_layers"] + (mtp if qwen35 else 0))
        w.add_feed_forward_length(lfm2_ff(cfg) if arch == "lfm2" else cfg["intermediate_size"] if hybrid
                                  else cfg.get("shared_intermediate_size") or cfg["intermediate_size"])
        w.add_head_count(heads)
        # (LFM2 and Granite 4.0-H: per layer, 0 for a conv / Mamba layer)
        w.add_head_count_kv([kv if t in attn_types else 0 for t in cfg["layer_types"]] if hybrid else kv)
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps") or cfg["norm_eps"]))
        w.add_rope_freq_base(float(rp["rope_theta"] if qwen35 or hybrid else cfg.get("rope_theta", 10000.0)))
    if hybrid:
        hybrid_keys(w, arch, cfg)
    if arch in PERMUTED:
        w.add_rope_dimension_count(head_dim)
    if qwen35:  # Qwen3NextModel / _Qwen35MRopeMixin / _Qwen35MtpMixin.set_gguf_parameters
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(head_dim * rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))))
        w.add_rope_dimension_sections((list(rp.get("mrope_section") or [11, 11, 10]) + [0] * 4)[:4])
        if mtp:
            w.add_nextn_predict_layers(mtp)
    if arch == "phi3":  # Phi3Model.set_gguf_parameters / generate_extra_tensors
        rot = int(head_dim * float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))))
        w.add_rope_dimension_count(rot)
        if rp.get("rope_type") == "longrope":
            orig = int(rp.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
            w.add_rope_scaling_orig_ctx_len(orig)
            scale = cfg["max_position_embeddings"] / orig
            w.add_rope_scaling_attn_factors(1.0 if scale <= 1 else (1 + np.log(scale) / np.log(orig)) ** 0.5)
    if arch in ("granite", "granitehybrid"):  # GraniteModel.set_gguf_parameters
        for key, add in (("embedding_multiplier", w.add_embedding_scale), ("residual_multiplier", w.add_residual_scale),
                         ("attention_multiplier", w.add_attention_scale), ("logits_scaling", w.add_logit_scale)):
            if cfg.get(key) is not None:
                add(float(cfg[key]))
    if arch in ("qwen3", "gemma3", "qwen35") or head_dim != cfg["hidden_size"] // heads and arch not in MAMBA_H:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if gemma and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    n_vocab = cfg["vocab_size"]
    if spm:
        tokens, scores, types = spm_vocab(n_vocab, gemma)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        if gemma:
            w.add_pad_token_id(0), w.add_eos_token_id(1), w.add_bos_token_id(2), w.add_unk_token_id(3)
        else:
            w.add_unk_token_id(0), w.add_bos_token_id(1), w.add_eos_token_id(2)
        w.add_add_bos_token(True)
    else:
        vocab = json.loads((src / "tokenizer.json").read_text())
        by_id = {i: t for t, i in vocab["model"]["vocab"].items()}
        by_id.update({a["id"]: a["content"] for a in vocab.get("added_tokens", [])})
        merges = byte_level_merges(n_vocab - len(by_id))  # the unused ids become merged tokens
        for j, (a, b) in enumerate(merges):
            by_id[257 + j] = a + b
        tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
        types = [3 if any(a["id"] == i for a in vocab.get("added_tokens", [])) else 1 if i in by_id else 5
                 for i in range(n_vocab)]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen35" if qwen35 else "qwen2" if arch.startswith("qwen") else "llama-bpe")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges([f"{a} {b}" for a, b in merges])
        w.add_eos_token_id(cfg.get("eos_token_id") or 256)
        w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    layer_map = {"gemma3": LAYER_GEMMA, "phi3": LAYER_PHI3, "olmo2": LAYER_OLMO2}.get(arch, LAYER_LLAMA)
    if hf_arch == "GraniteMoeHybridForCausalLM":
        layer_map = LAYER_GRANITE_H if arch == "granitehybrid" else LAYER_GRANITE4
    if arch == "lfm2":
        layer_map = LAYER_LFM2

    def put(name, arr):
        arr = np.ascontiguousarray(arr.astype(np.float32))
        if name.endswith("norm.weight") and gemma:
            arr = arr + 1.0  # Gemma3Model.modify_tensors: norms stored as 1 + w
        # (llama.cpp keeps 1-D tensors, norms, the convs and the SSM's A and D F32: ModelBase.prepare_tensors)
        f32 = arr.ndim < 2 or name.endswith(("_norm.weight", "ssm_conv1d.weight", "shortconv.conv.weight")) \
            or not name.endswith(".weight")
        if not f32 and qtype != "F32":
            if qtype == "F16":
                w.add_tensor(name, arr.astype(np.float16))
                return
            if qtype == "BF16":
                w.add_tensor(name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.BF16),
                             raw_dtype=gguf.GGMLQuantizationType.BF16)
                return
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            return
        w.add_tensor(name, arr)

    if qwen35 or arch in MAMBA_H:
        made = qwen35_tensors(tensors, cfg, mtp) if qwen35 else mamba_hybrid_tensors(tensors, cfg, arch)
        for name, arr in made.items():
            put(name, arr)
        return _finish(w, out)
    if arch == "phi3" and rp.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.asarray(rp["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rp["short_factor"], np.float32))
    put("token_embd.weight", tensors["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in layer_map.items():
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.{hf}.{suffix}"
                if name not in tensors:
                    continue
                t = tensors[name]
                if arch in PERMUTED and hf == "self_attn.q_proj":
                    t = permute(t, heads, heads)
                elif arch in PERMUTED and hf == "self_attn.k_proj":
                    t = permute(t, heads, kv)
                elif t.ndim == 3:  # the depthwise convs squeezed, [C, 1, K] -> [C, K]
                    t = t.reshape(t.shape[0], t.shape[2])
                elif hf == "mamba.norm":  # Mamba2Model: [n_group, d_inner / n_group]
                    t = t.reshape(cfg["mamba_n_groups"], -1)
                put(f"blk.{i}.{gg}.{suffix}", t)
        for hf, gg in GRANITE_H_WHOLE.items() if arch == "granitehybrid" else ():
            if (t := tensors.get(f"model.layers.{i}.{hf}")) is not None:  # A = -exp(A_log); A and D as [H, 1]
                put(f"blk.{i}.{gg}", -_exp(t)[:, None] if hf == "mamba.A_log" else t[:, None] if hf == "mamba.D" else t)
        gu = tensors.get(f"model.layers.{i}.shared_mlp.input_linear.weight")
        if gu is not None:  # GraniteMoeHybridModel.modify_tensors: [gate; up] split
            put(f"blk.{i}.ffn_gate.weight", gu[: gu.shape[0] // 2])
            put(f"blk.{i}.ffn_up.weight", gu[gu.shape[0] // 2:])
    if arch == "lfm2":  # (LFM2's final norm, embedding_norm, is llama.cpp's token_embd_norm)
        put("token_embd_norm.weight", tensors["model.embedding_norm.weight"])
    else:
        put("output_norm.weight", tensors["model.norm.weight"])
    if "lm_head.weight" in tensors and not cfg.get("tie_word_embeddings", False):
        put("output.weight", tensors["lm_head.weight"])
    return _finish(w, out)


def _finish(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


def write_moe_stub(path, arch: str, experts: int | None = None):
    """a one-block GGUF of ``arch`` holding an experts tensor (what the MoE refusals read)"""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if experts:
        w.add_expert_count(experts)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((experts or 2, 4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return path
