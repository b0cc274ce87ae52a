"""llama.cpp comparison arms: a GGUF of any llama/qwen3/qwen3.5/LFM2/Granite 4.0-H HF checkpoint
(speed only), requantized by llama.cpp's own quantizer (Qwen3.5: llama.cpp's ``qwen35`` layout, its
norms stored as 1 + w and ssm_a as -exp(A_log) as its converter writes them; value heads are not
reordered, so a checkpoint with fewer key than value heads runs with other values, at the same speed.
LFM2: ``lfm2``, conv layers marked by 0 KV heads, the HF ``embedding_norm`` (the final norm) as
``token_embd_norm``. Granite 4.0-H (dense FFN only): ``granitehybrid``, the fused shared MLP split
into gate/up, ssm_a/ssm_d as [H, 1], ssm_norm as [G, d_inner/G], the multipliers as scale keys).

``python tools/llamacpp.py SRC_DIR OUT.gguf [FTYPE ...]`` writes ``OUT.gguf`` (F16, via
gguf-py: standard tensor names, the model's real shapes and hyper-parameters, a stand-in
vocabulary of the right size) and, for each FTYPE (e.g. MOSTLY_Q4_0), ``OUT-FTYPE.gguf``
through ``llama_model_quantize``. Made for benchmarking checkpoints that have no GGUF (the
synthetic 1.7B shape): the q/k rows are not permuted and the vocabulary is not real, so
its text is meaningless, while every byte llama.cpp reads per token is the real model's.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

NAMES = {  # HF suffix -> GGUF name (blk.{i}. prefix for layer tensors)
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


QWEN35_NAMES = {  # Qwen3.5: the post-attention (pre-MLP) norm and the Gated DeltaNet layers' tensors
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}


LFM2_NAMES = {  # LFM2: operator/ffn norms, the short-conv layers' tensors, out_proj, q/k layernorms, w1/w3/w2
    "operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "conv.in_proj.weight": "shortconv.in_proj.weight", "conv.conv.weight": "shortconv.conv.weight",
    "conv.out_proj.weight": "shortconv.out_proj.weight", "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight", "self_attn.k_layernorm.weight": "attn_k_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
}


GRANITE_H_NAMES = {  # Granite 4.0-H: the Mamba-2 layers' tensors and the shared MLP ([gate; up] fused)
    "mamba.in_proj.weight": "ssm_in.weight", "mamba.conv1d.weight": "ssm_conv1d.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias", "mamba.dt_bias": "ssm_dt.bias", "mamba.A_log": "ssm_a",
    "mamba.D": "ssm_d", "mamba.norm.weight": "ssm_norm.weight", "mamba.out_proj.weight": "ssm_out.weight",
    "shared_mlp.input_linear.weight": ("ffn_gate.weight", "ffn_up.weight"),
    "shared_mlp.output_linear.weight": "ffn_down.weight",
}


def lfm2_ff(cfg: dict) -> int:
    """LFM2's MLP width: block_ff_dim, auto-adjusted (2/3, multiplier, rounded up) as the converter does."""
    ff = cfg.get("block_ff_dim") or cfg["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim"):
        ff = int(float(cfg.get("block_ffn_dim_multiplier") or 1.0) * int(2 * ff / 3))
        m = cfg.get("block_multiple_of", 256)
        ff = m * ((ff + m - 1) // m)
    return ff


def hybrid_keys(w, arch: str, cfg: dict) -> None:
    """lfm2 / granitehybrid metadata, the keys convert_hf_to_gguf.py writes (per-layer KV heads, 0 = recurrent)."""
    n, nkv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    w.add_head_count(cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "lfm2":
        attn = cfg.get("layer_types") or ["full_attention" if i in cfg["full_attn_idxs"] else "conv" for i in range(n)]
        w.add_feed_forward_length(lfm2_ff(cfg))
        w.add_head_count_kv([0 if t == "conv" else nkv for t in attn])
        w.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {})["rope_theta"]))
        w.add_layer_norm_rms_eps(float(cfg.get("norm_eps", 1e-5)))
        w.add_shortconv_l_cache(cfg.get("conv_L_cache", 3))
        return
    if cfg.get("num_local_experts"):
        sys.exit("llamacpp: Granite 4.0-H with MoE experts is not supported (dense shared MLP only)")
    attn = [t in ("attention", "full_attention") for t in cfg["layer_types"]]
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count_kv([nkv if a else 0 for a in attn])
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_expert_count(cfg.get("num_local_experts", 0))
    w.add_expert_used_count(cfg.get("num_experts_per_tok", 0))
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    if cfg.get("rope_theta"):
        w.add_rope_freq_base(float(cfg["rope_theta"]))
    for key, add in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier", w.add_embedding_scale),
                     ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
        if cfg.get(key):
            add(float(cfg[key]))
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_ssm_conv_kernel(cfg.get("mamba_d_conv", 4))
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(cfg.get("mamba_n_groups", 1))
    w.add_ssm_inner_size(cfg.get("mamba_expand", 2) * cfg["hidden_size"])
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_rope_scaling_finetuned(all(attn))  # granitehybrid's RoPE switch: off with Mamba layers


def dense_keys(w, arch: str, cfg: dict) -> None:
    """llama / qwen3 / qwen35 metadata."""
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(hd)
    w.add_value_length(hd)
    rp = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rp.get("rope_theta", 10000.0)))
    if arch == "qwen35":
        w.add_rope_dimension_count(int(hd * rp.get("partial_rotary_factor", 0.25)))
        w.add_array(f"{arch}.rope.dimension_sections", list(rp.get("mrope_section", [11, 11, 10])) + [0])
        nk, nv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                           "linear_key_head_dim", "linear_value_head_dim"))
        w.add_uint32(f"{arch}.ssm.conv_kernel", cfg.get("linear_conv_kernel_dim", 4))
        w.add_uint32(f"{arch}.ssm.state_size", dk)
        w.add_uint32(f"{arch}.ssm.group_count", nk)
        w.add_uint32(f"{arch}.ssm.time_step_rank", nv)
        w.add_uint32(f"{arch}.ssm.inner_size", nv * dv)
        w.add_uint32(f"{arch}.full_attention_interval", cfg.get("full_attention_interval", 4))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))


def write_gguf(src: Path, out: Path) -> Path:
    import gguf
    import numpy as np
    from safetensors import safe_open

    cfg = json.loads((src / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3_5ForCausalLM": "qwen35",
            "Lfm2ForCausalLM": "lfm2", "GraniteMoeHybridForCausalLM": "granitehybrid"}.get(cfg["architectures"][0])
    if arch is None:
        sys.exit(f"llamacpp: only llama/qwen3/qwen3.5/lfm2/granite-4.0-h checkpoints are supported, "
                 f"got {cfg['architectures'][0]}")
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(src.name)
    w.add_context_length(2**20 if arch == "granitehybrid" else cfg.get("max_position_embeddings", 4096))  # no RoPE
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    if arch in ("lfm2", "granitehybrid"):
        hybrid_keys(w, arch, cfg)
    else:
        dense_keys(w, arch, cfg)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = cfg["vocab_size"]
    w.add_tokenizer_model("llama")  # a stand-in SentencePiece-style vocabulary of the right size
    w.add_token_list([f"<t{i}>".encode() for i in range(n_vocab)])
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * n_vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    files = sorted(src.glob("*.safetensors"))
    tensors = {}
    for f in files:
        h = safe_open(str(f), "pt")
        for k in h.keys():
            tensors[k] = (h, k)

    def arr(name, as_f32=False):
        h, k = tensors[name]
        t = h.get_tensor(k).float()
        return t.numpy().astype(np.float32 if as_f32 else np.float16)

    w.add_tensor("token_embd.weight", arr("model.embed_tokens.weight"))
    names = {**NAMES, **{"qwen35": QWEN35_NAMES, "lfm2": LFM2_NAMES, "granitehybrid": GRANITE_H_NAMES}.get(arch, {})}
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            name = f"model.layers.{i}.{hf}"
            if name not in tensors:
                continue
            small = hf.endswith(("norm.weight", "A_log", "dt_bias", "conv1d.weight", "conv1d.bias", "mamba.D",
                                 "conv.conv.weight"))
            t = arr(name, as_f32=small)
            if arch == "qwen35" and hf.endswith("norm.weight") and "linear_attn" not in hf:
                t = t + 1.0  # llama.cpp's converter stores (1 + w) norms as 1 + w
            if hf.endswith("A_log"):
                t = -np.exp(t)
            if t.ndim == 3:  # depthwise conv [C, 1, K] -> [C, K]
                t = t.reshape(t.shape[0], t.shape[-1])
            if arch == "granitehybrid" and hf.endswith(("A_log", "mamba.D")):
                t = t.reshape(-1, 1)
            if hf == "mamba.norm.weight":
                t = t.reshape(cfg.get("mamba_n_groups", 1), -1)
            for g, part in zip(gg, np.split(t, 2)) if isinstance(gg, tuple) else [(gg, t)]:
                w.add_tensor(f"blk.{i}.{g}", part)
    if arch == "lfm2":  # LFM2's final norm is its embedding_norm, llama.cpp's token_embd_norm
        w.add_tensor("token_embd_norm.weight", arr("model.embedding_norm.weight", as_f32=True))
    else:
        norm = arr("model.norm.weight", as_f32=True)
        w.add_tensor("output_norm.weight", norm + 1.0 if arch == "qwen35" else norm)
    if "lm_head.weight" in tensors and not cfg.get("tie_word_embeddings", cfg.get("tie_embedding", False)):
        w.add_tensor("output.weight", arr("lm_head.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    tmp.replace(out)
    return out


def main(argv: list[str]) -> None:
    from quality import llama_quantize  # tools/quality.py

    src, out = Path(argv[0]), Path(argv[1])
    write_gguf(src, out)
    for ftype in argv[2:]:
        llama_quantize(out, out.with_name(f"{out.stem}-{ftype}.gguf"), ftype)
        print(out.with_name(f"{out.stem}-{ftype}.gguf"))


if __name__ == "__main__":
    main(sys.argv[1:])
