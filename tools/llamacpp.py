"""llama.cpp comparison arms: a GGUF of any llama/qwen3/qwen3.5 HF checkpoint (speed only),
requantized by llama.cpp's own quantizer (Qwen3.5: llama.cpp's ``qwen35`` layout, its norms stored
as 1 + w and ssm_a as -exp(A_log) as its converter writes them; value heads are not reordered,
so a checkpoint with fewer key than value heads runs with other values, at the same speed).

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


def write_gguf(src: Path, out: Path) -> Path:
    import gguf
    import numpy as np
    from safetensors import safe_open

    cfg = json.loads((src / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
            "Qwen3_5ForCausalLM": "qwen35"}.get(cfg["architectures"][0])
    if arch is None:
        sys.exit(f"llamacpp: only llama/qwen3/qwen3.5 checkpoints are supported, got {cfg['architectures'][0]}")
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(src.name)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
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
    names = {**NAMES, **QWEN35_NAMES} if arch == "qwen35" else NAMES
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            name = f"model.layers.{i}.{hf}"
            if name not in tensors:
                continue
            small = hf.endswith(("norm.weight", "A_log", "dt_bias", "conv1d.weight"))
            t = arr(name, as_f32=small)
            if arch == "qwen35" and hf.endswith("norm.weight") and "linear_attn" not in hf:
                t = t + 1.0  # llama.cpp's converter stores (1 + w) norms as 1 + w
            if hf.endswith("A_log"):
                t = -np.exp(t)
            if hf.endswith("conv1d.weight"):
                t = t.reshape(t.shape[0], t.shape[-1])
            w.add_tensor(f"blk.{i}.{gg}", t)
    norm = arr("model.norm.weight", as_f32=True)
    w.add_tensor("output_norm.weight", norm + 1.0 if arch == "qwen35" else norm)
    if "lm_head.weight" in tensors and not cfg.get("tie_word_embeddings", False):
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
