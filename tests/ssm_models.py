"""Tiny random LFM2 / LFM3 / Granite 4.0-H / Nemotron-H checkpoints made with transformers (the oracle), for
tests/test_ssm.py: parameters drawn so that every part matters (slow decays, conv taps of both
signs, norms near 1)."""
from __future__ import annotations

from pathlib import Path

import torch

from helpers import _save

ARCHS = ("lfm2", "lfm3", "granite_h", "nemotron_h", "falcon_h1")


def make_ssm(out: Path, arch: str = "lfm2", *, hidden=128, layers=4, vocab=320, seed=0, dtype=torch.bfloat16,
             tied=None, **extra) -> Path:
    import transformers

    if arch == "nemotron_h":
        return make_nemotron_h(out, hidden=hidden, vocab=vocab, seed=seed, dtype=dtype, **extra)
    if arch == "falcon_h1":
        return make_falcon_h1(out, hidden=hidden, vocab=vocab, seed=seed, dtype=dtype, **extra)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=256, bos_token_id=None,
                  pad_token_id=0)
    if arch == "lfm2":  # conv, conv, attention, conv, ...
        types = ["full_attention" if i % 4 == 2 else "conv" for i in range(layers)]
        cfg = transformers.Lfm2Config(**common, intermediate_size=384, layer_types=types, conv_L_cache=3,
                                      tie_word_embeddings=True if tied is None else tied,
                                      rope_parameters=dict(rope_type="default", rope_theta=1e6), **extra)
        model = transformers.Lfm2ForCausalLM(cfg)
    elif arch == "lfm3":  # conv, sliding, full, conv (the sliding window short enough to matter)
        types = ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 1 else "conv" for i in range(layers)]
        cfg = transformers.Lfm3Config(**common, intermediate_size=256, layer_types=types, head_dim=32,
                                      sliding_window=24, tie_word_embeddings=True if tied is None else tied, **extra)
        model = transformers.Lfm3ForCausalLM(cfg)
    elif arch == "granite_h":  # mamba, mamba, mamba, attention (NoPE), Granite's multipliers
        types = ["attention" if i % 4 == 3 else "mamba" for i in range(layers)]
        cfg = transformers.GraniteMoeHybridConfig(
            **common, intermediate_size=256, shared_intermediate_size=256, layer_types=types, num_local_experts=0,
            mamba_n_heads=8, mamba_d_head=32, mamba_d_state=32, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
            position_embedding_type="nope", embedding_multiplier=4.0, residual_multiplier=0.5,
            attention_multiplier=0.1, logits_scaling=2.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False if tied is None else tied, **extra)
        model = transformers.GraniteMoeHybridForCausalLM(cfg)
    else:
        raise ValueError(arch)
    _draw(model)
    return _save(model, out, vocab, dtype)


def _draw(model) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif n.endswith("dt_bias"):
                p.uniform_(-3.0, -1.0)
            elif n.endswith(".D"):
                p.uniform_(0.5, 1.5)
            elif "conv" in n and p.dim() == 3:
                p.normal_(0, 0.4)
            elif n.endswith("conv1d.bias"):
                p.normal_(0, 0.1)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.uniform_(0.8, 1.2)


def make_nemotron_h(out: Path, *, pattern: str = "M-M*-MM-", hidden=128, vocab=320, seed=0, dtype=torch.bfloat16,
                    **extra) -> Path:
    """A tiny random Nemotron-H (blocks: M Mamba-2, * attention, - relu2 MLP)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=len(pattern), hybrid_override_pattern=pattern,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256, mamba_num_heads=8,
        mamba_head_dim=24, ssm_state_size=32, n_groups=2, conv_kernel=4, max_position_embeddings=512,
        eos_token_id=256, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False, **extra)
    model = transformers.NemotronHForCausalLM(cfg)
    _draw(model)
    return _save(model, out, vocab, dtype)


def make_falcon_h1(out: Path, *, hidden=128, layers=3, vocab=320, seed=0, dtype=torch.bfloat16, **extra) -> Path:
    """A tiny random Falcon-H1 with muP multipliers of every kind (none 1)."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, intermediate_size=256, mamba_n_heads=8, mamba_d_head=32,
              mamba_d_ssm=256, mamba_d_state=32, mamba_n_groups=2, mamba_d_conv=4, max_position_embeddings=512,
              eos_token_id=256, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
              mamba_rms_norm=False, mamba_norm_before_gate=False, embedding_multiplier=3.0, lm_head_multiplier=0.5,
              attention_in_multiplier=1.5, attention_out_multiplier=0.8, key_multiplier=0.4, ssm_in_multiplier=1.25,
              ssm_out_multiplier=0.6, ssm_multipliers=[0.35, 0.25, 0.35, 0.5, 0.35], mlp_multipliers=[0.9, 0.6],
              rope_parameters=dict(rope_type="default", rope_theta=1e5))
    model = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**{**kw, **extra}))
    _draw(model)
    return _save(model, out, vocab, dtype)
