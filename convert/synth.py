"""``sparkq synth``: random-weight checkpoints of real model shapes (speed and memory at scale
without downloading a model). Written streaming, one tensor at a time, as standard HF
safetensors + config + a byte-level tokenizer; deterministic for a given seed."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from sparkq.formats import constants as C
from sparkq.formats.recipe import builtin_recipes
from sparkq.formats.spec import ModelSpec
from sparkq.formats.tensorfile import TensorFileWriter

from .errors import ConvertError
from .output import atomic_dir

SHAPES = {
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    },
    # The seed's model as published (PyPI vllm-spark2-5-plugin 0.1.0, Spark2_5Config's defaults): 8 query
    # heads / 2 KV heads of 256, a head-wise output gate (g_proj), exact-GELU MLP of 6656, three
    # sliding-window layers (512, theta 1e4, full rotary) per full layer (theta 5e6, rotary 0.25),
    # an untied 131072-row head, the seed's 1M-position configuration; the plugin's tensor names
    "spark-x2.5-1.7b": {
        "architectures": ["Spark2_5ForCausalLM"], "model_type": "spark2_5", "hidden_size": 2048,
        "intermediate_size": 6656, "num_hidden_layers": 28, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "headwise_attn_output_gate": True, "sliding_window": 512, "vocab_size": 131072,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 7,
        "rope_parameters": {"full_attention": {"rope_theta": 5000000.0, "partial_rotary_factor": 0.25},
                            "sliding_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
        "torch_dtype": "bfloat16",
    },
    # Qwen3.5 (Gated DeltaNet hybrids), their text models as published in the
    # Qwen3_5ForConditionalGeneration checkpoints: three DeltaNet layers (16 key / 16 value heads of
    # 128, conv kernel 4) before each gated full-attention layer (head_dim 256, rotary 0.25), a tied
    # 248320-row embedding, one multi-token-prediction layer (mtp.*). 0.8B: Qwen/Qwen3.5-0.8B's
    # config.json; 2B: hidden 2048 and the family's layout as published, its MLP width and layer count
    # as the 0.8B's ratios give them
    "qwen3.5-0.8b": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 1024,
        "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "vocab_size": 248320, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "hidden_act": "silu", "attn_output_gate": True, "torch_dtype": "bfloat16", "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "hidden_act": "silu", "torch_dtype": "bfloat16",
    },
}


# Qwen3-Embedding-0.6B / Qwen3-Reranker-0.6B (Qwen3-0.6B's geometry: 28 layers, 16 query / 8 KV heads of
# 128, an MLP of 3072, a tied 151669-row embedding)
SHAPES["qwen3-0.6b"] = {**SHAPES["qwen3-1.7b"], "hidden_size": 1024, "intermediate_size": 3072,
                        "num_key_value_heads": 8, "vocab_size": 151669, "max_position_embeddings": 32768}
SHAPES["qwen3.5-2b"] = {**SHAPES["qwen3.5-0.8b"], "hidden_size": 2048, "intermediate_size": 6144}
# Gemma 4 E2B (google/gemma-4-E2B's text_config): 35 layers (4 sliding of head dim 256, then a full
# one of 512), one KV head, the last 20 layers reading layers 13 / 14's KV caches with MLPs twice as
# wide, per-layer inputs of 256 from a 262144-row table; E4B: 42 layers (5 sliding, 1 full), 2 KV
# heads, the last 18 sharing, no double-wide MLP
SHAPES["gemma4-e2b"] = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 1536,
    "intermediate_size": 6144, "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 256, "global_head_dim": 512, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "vocab_size": 262144,
    "sliding_window": 512, "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16",
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}},
}
SHAPES["gemma4-e4b"] = {**SHAPES["gemma4-e2b"], "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42,
                        "num_key_value_heads": 2, "num_kv_shared_layers": 18, "use_double_wide_mlp": False,
                        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7}

# LFM2-1.2B (LiquidAI/LFM2-1.2B's config.json, its legacy field names): 16 layers, gated short
# convolutions (kernel 3) but attention at 2, 5, 8, 10, 12, 14 (32 heads of 64, 8 KV heads), an MLP of
# 8192 (block_ff_dim 12288 through the auto-adjust rule), a tied 65536-row embedding
SHAPES["lfm2-1.2b"] = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048, "block_ff_dim": 12288,
    "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5,
    "rope_theta": 1000000.0, "max_position_embeddings": 128000, "tie_embedding": True, "torch_dtype": "bfloat16",
}
# Granite-4.0-H-1B (ibm-granite/granite-4.0-h-1b's geometry): 40 layers, attention (NoPE, 12 heads of
# 128, 4 KV heads) at 5, 15, 25, 35, Mamba-2 elsewhere (48 heads of 64, state 128, one group, conv 4),
# a shared MLP of 4096, a tied 100352-row embedding; the multipliers are granite-4.0-h-350m's
SHAPES["granite-4.0-h-1b"] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 1536,
    "intermediate_size": 4096, "shared_intermediate_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 12,
    "num_key_value_heads": 4, "num_local_experts": 0, "num_experts_per_tok": 0, "vocab_size": 100352,
    "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)], "mamba_n_heads": 48,
    "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_d_conv": 4,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "position_embedding_type": "nope", "embedding_multiplier": 12.0,
    "attention_multiplier": 0.015625, "residual_multiplier": 0.246, "logits_scaling": 3.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}

# shape -> the chat template (convert/data/) its checkpoint carries
TEMPLATES = {"spark-x2.5-1.7b": "spark2_5_chat_template.jinja"}


def _byte_tokenizer() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def synth(shape: str, out: str, seed: int = 0, force: bool = False, progress: bool = True) -> dict:
    if shape not in SHAPES:
        raise ConvertError(f"unknown --shape {shape!r}; choose one of {', '.join(SHAPES)}")
    cfg = dict(SHAPES[shape])
    recipe = next(r for r in builtin_recipes().values() if cfg["architectures"][0] in r.architectures)
    spec = ModelSpec.from_recipe(cfg, recipe)
    if recipe.mtp_names:  # the multi-token-prediction block the published checkpoints carry
        spec = replace(spec, mtp_layers=int(cfg.get("mtp_num_hidden_layers", 0)))
    names = recipe.source_names(spec)
    shapes: dict[str, tuple[int, ...]] = {}
    for lin, (n, k) in spec.linear_shapes().items():
        for src, rows in zip(names[lin], spec.part_rows(lin, len(names[lin]))):
            base = src.split(":")[0]  # a view's rows (formats/views.py) live in its checkpoint tensor
            shapes[base] = (shapes[base][0] + rows, k) if base != src and base in shapes else (rows, k)
    for vec, shp in spec.vector_shapes().items():
        for src in names[vec]:
            if spec.vector_dtype(vec) == C.DTYPE_F32:  # a DeltaNet parameter, as the checkpoint holds it
                shapes[src] = (shp[0], 1, shp[1]) if len(shp) == 2 else shp
                continue
            shapes[src] = (shp[0] // len(names[vec]),)
    entries = [(n, C.DTYPE_BF16, s) for n, s in sorted(shapes.items())]
    g = torch.Generator().manual_seed(seed)
    with atomic_dir(out, force) as tmp:
        # (a plain HF checkpoint: no alignment padding tensors, which other tools refuse)
        w = TensorFileWriter(str(tmp / "model.safetensors"), entries, {"format": "pt"}, align=False)
        total = sum(torch.Size(s).numel() * 2 for _, _, s in entries)
        with tqdm(total=total, unit="B", unit_scale=True, desc="synth", disable=not progress, leave=False) as bar:
            for name, _, shp in entries:
                w.begin(name)
                rows = shp[0]
                step = max(1, (8 << 20) // max(1, torch.Size(shp[1:]).numel()))
                for r0 in range(0, rows, step):
                    r = min(rows, r0 + step) - r0
                    if name.endswith(("A_log", "dt_bias")):  # a slow decay, as trained DeltaNets / Mambas have
                        t = (0.5 if name.endswith("A_log") else -3.0) + 0.3 * torch.randn(r, generator=g)
                    elif len(shp) == 1:
                        t = 1.0 + 0.1 * torch.randn(r, generator=g)
                    else:
                        t = torch.randn(r, *shp[1:], generator=g) * (shp[1] ** -0.5)
                    w.write(t.to(torch.bfloat16).view(torch.uint8).numpy())
                    bar.update(t.numel() * 2)
                w.end()
        w.close()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        (tmp / "tokenizer.json").write_text(_byte_tokenizer())
        if shape in TEMPLATES:  # the family's chat template (tool calls in its own form)
            (tmp / "chat_template.jinja").write_text(
                (Path(__file__).with_name("data") / TEMPLATES[shape]).read_text())
        size = (tmp / "model.safetensors").stat().st_size
    return {"shape": shape, "output": str(Path(out).absolute()), "tensors": len(entries), "bytes": size,
            "parameters": size // 2}
