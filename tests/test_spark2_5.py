"""Spark2_5 (Spark2_5ForCausalLM, PyPI vllm-spark2-5-plugin 0.1.0): fused q_k_v_proj, a head-wise
attention output gate (g_proj), out_proj, exact-GELU MLP, sliding/full layers with their own RoPE
theta and partial rotary. No transformers class exists, so the oracle is a float64 forward written
here from the plugin's spark2_5.py (vLLM's layers: RMSNorm x * rsqrt(mean(x^2) + eps) * w,
GeluAndMul, neox RoPE on the first rotary_dim features, a window of `sliding_window` keys)."""
import json

import numpy as np
import pytest
import torch

from helpers import assert_batched_step_is_single, byte_tokenizer, dequant_reference, kernel_builds, run_cli
from sparkq.convert.pipeline import Options, convert
from sparkq.formats import Artifact
from sparkq.runtime import load

CFG = {
    "architectures": ["Spark2_5ForCausalLM"], "model_type": "spark2_5", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320,
    "headwise_attn_output_gate": True, "sliding_window": 24, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "rope_parameters": {"full_attention": {"rope_theta": 5000000.0, "partial_rotary_factor": 0.25},
                        "sliding_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
}
POSITIONS = 200  # > 8x the window


def make_spark(out, cfg=CFG, seed=0, gate_width=1):
    """A random Spark2_5 checkpoint with the plugin's tensor names (q_k_v_proj fused, gate/up apart);
    ``gate_width`` head_dim: a g_proj gating every channel (the element-wise gate's width)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    c = cfg
    E, I, D, nh, nkv, V = (c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_attention_heads"],
                           c["num_key_value_heads"], c["vocab_size"])
    t = {"model.embedding.weight": torch.randn(V, E, generator=g), "model.norm.weight": 1 + 0.1 * torch.randn(E, generator=g),
         "lm_head.weight": torch.randn(V, E, generator=g) * E ** -0.5}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n, shape, scale in (("self_attn.q_k_v_proj", ((nh + 2 * nkv) * D, E), 1.0),
                                ("self_attn.g_proj", (nh * gate_width, E), 3.0),  # gates spread over (0, 1)
                                ("self_attn.out_proj", (E, nh * D), 1.0), ("mlp.gate_proj", (I, E), 1.0),
                                ("mlp.up_proj", (I, E), 1.0), ("mlp.down_proj", (E, I), 1.0)):
            t[p + n + ".weight"] = torch.randn(*shape, generator=g) * scale * shape[1] ** -0.5
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + n + ".weight"] = 1 + 0.1 * torch.randn(E, generator=g)
    out.mkdir()
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "tokenizer.json").write_text(byte_tokenizer(V))
    return out


def reference_forward(path, ids, *, window=None, gate=True, cfg=CFG):
    """Float64 logits [T, V] of the plugin's Spark2_5ForCausalLM (``window``/``gate``: the negative
    controls: another window, no gate; a g_proj of heads x head_dim rows gates each channel)."""
    from safetensors.torch import load_file
    w = {k: v.double() for k, v in load_file(path / "model.safetensors").items()}
    c = cfg
    nh, nkv, D, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    T = len(ids)
    pos = torch.arange(T, dtype=torch.float64)

    def norm(x, wt):  # vLLM RMSNorm
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * wt

    def rope(x, theta, rot):  # get_rope(is_neox_style=True): rotate-half on the first rot features
        inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        ang = pos[:, None] * inv[None, :]
        cos, sin = torch.cos(ang), torch.sin(ang)
        x1, x2, rest = x[..., : rot // 2], x[..., rot // 2: rot], x[..., rot:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)

    x = w["model.embedding.weight"][ids]
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        rp = c["rope_parameters"][kind]
        rot = int(D * rp["partial_rotary_factor"])
        h = norm(x, w[p + "input_layernorm.weight"])
        q, k, v = (h @ w[p + "self_attn.q_k_v_proj.weight"].T).split([nh * D, nkv * D, nkv * D], -1)
        q, k, v = (t.view(T, -1, D).transpose(0, 1) for t in (q, k, v))
        q, k = rope(q, rp["rope_theta"], rot), rope(k, rp["rope_theta"], rot)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        s = q @ k.transpose(1, 2) * D ** -0.5
        qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
        allowed = ki <= qi
        if kind == "sliding_attention":
            allowed &= ki > qi - (window or c["sliding_window"])
        o = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v  # [nh, T, D]
        if gate:  # g = sigmoid(g_proj(hidden_states)), one scalar per head (or per channel)
            o = o * torch.sigmoid(h @ w[p + "self_attn.g_proj.weight"].T).view(T, nh, -1).transpose(0, 1)
        x = x + o.transpose(0, 1).reshape(T, nh * D) @ w[p + "self_attn.out_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gte, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.gelu(gte) * up) @ w[p + "mlp.down_proj.weight"].T  # GeluAndMul (erf)
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    """(checkpoint, its default int4 artifact, token ids, the float64 reference logits)"""
    d = tmp_path_factory.mktemp("spark2_5")
    src = make_spark(d / "src")
    ids = torch.randint(0, 320, (POSITIONS,), generator=torch.Generator().manual_seed(5)).tolist()
    out = d / "int4"
    convert(str(src), str(out), Options(progress=False))
    return src, out, ids, reference_forward(src, ids)


def _prefill_then_steps(m, ids, n):
    steps = [m.model.forward(torch.tensor(ids[:n]), 0, last_only=False)]
    steps += [m.model.forward(torch.tensor(ids[j:j + 1]), j) for j in range(n, len(ids))]
    return torch.cat(steps).double()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_spark_bf16_matches_the_plugins_model_over_200_positions(spark, kernel_build):
    src, _, ids, ref = spark
    m = load(str(src), max_model_len=256, kv_dtype="bf16")
    assert m.info.extra["decode_path"].startswith("c ("), m.info.extra
    ours = _prefill_then_steps(m, ids, 150)  # 150 through the prompt path, 50 decode steps over its cache
    rel = _rel(ours, ref)
    print(f"spark2_5: sparkq bf16 {100 * rel:.2f}% of the float64 reference over {POSITIONS} positions")
    assert rel < 0.02, rel
    # the negative controls: a model without the gate, or with another window, is far outside that
    for wrong in (reference_forward(src, ids, gate=False), reference_forward(src, ids, window=CFG["sliding_window"] + 1)):
        assert _rel(ours, wrong) > 3 * max(rel, 0.01), (_rel(ours, wrong), rel)


def test_spark_spec_layout_and_gate_kept_bf16(spark):
    _, out, _, _ = spark
    art = Artifact.open(out)
    s = art.spec
    assert (s.family, s.act, s.attn_gate, s.tied) == ("spark2_5", "gelu", 1, False)
    assert [s.layer_attention(i) for i in range(4)] == [(10000.0, 32, 24)] * 3 + [(5000000.0, 8, None)]
    gate = art.manifest.linears["layers.0.gate"]
    assert (gate.kind, gate.n, gate.k) == ("bf16", 4, 64)  # g_proj is never quantized (vLLM keeps it bf16)
    assert art.manifest.linears["layers.0.qkv"].kind != "bf16"
    assert art.manifest.linears["lm_head"].kind != "bf16" and "embed" in art.manifest.linears  # untied


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_spark_int4_against_its_dequantized_weights(spark, kernel_build):
    _, out, ids, _ = spark
    q = load(str(out), max_model_len=256, kv_dtype="bf16")
    t = torch.tensor(ids[:96])
    a = q.model.forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    budget = 2.5 * (b16 - b32).abs().max() + 0.01 * b32.abs().max()
    assert (a - b32).abs().max() <= budget
    dec = torch.cat([q.model.forward(t[:64], 0, last_only=False)]
                    + [q.model.forward(t[j:j + 1], j) for j in range(64, 96)])[64:]  # the C decode step
    assert (dec - b32[64:]).abs().max() <= budget


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_spark_batched_step_is_the_single_step(spark, kernel_build):
    _, out, ids, _ = spark
    assert_batched_step_is_single(out, [ids[:40], ids[3:70], ids[:4]], max_model_len=128)  # past the window, within it


def test_spark_generate_cli(spark):
    _, out, _, _ = spark
    p = run_cli("sparkq", "generate", out, "Hello", "--max-new-tokens", "6", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["stats"]["new_tokens"] == 6


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.update(num_experts=8), "num_experts"),                        # an MoE field
    (lambda c: c.update(attn_logit_softcap=30.0), "attn_logit_softcap"),      # a field Spark2_5 does not have
    (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="dynamic"), "'dynamic'"),  # another RoPE
], ids=["moe", "unknown-field", "rope-type"])
def test_spark_config_fields_it_does_not_implement_are_refused(edit, field, tmp_path):
    cfg = json.loads(json.dumps(CFG))
    edit(cfg)
    src = make_spark(tmp_path / "src", cfg)
    p = run_cli("spark-convert", src, tmp_path / "o")
    assert p.returncode == 2, p.stderr
    assert field in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "o").exists()


def test_spark_config_defaults_are_the_plugins(tmp_path):
    """A config with only the architecture gets Spark2_5Config's defaults, written into the artifact."""
    from sparkq.formats.recipe import builtin_recipes
    from sparkq.formats.spec import ModelSpec
    s = ModelSpec.from_recipe({"architectures": ["Spark2_5ForCausalLM"], "model_type": "spark2_5"},
                              builtin_recipes()["spark2_5"])
    assert (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab, s.tied) == \
        (2048, 6656, 28, 8, 2, 256, 131072, False)
    assert s.layer_types == ("sliding_attention",) * 3 + ("full_attention",) + s.layer_types[4:]
    assert [s.layer_attention(i) for i in (0, 3)] == [(10000.0, 256, 512), (5000000.0, 64, None)]
    off = ModelSpec.from_recipe({"architectures": ["Spark2_5ForCausalLM"], "headwise_attn_output_gate": False},
                                builtin_recipes()["spark2_5"])
    assert off.attn_gate == 0 and "gate" not in off.layer_roles


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_a_gate_per_channel_is_the_same_feature_with_another_width(tmp_path, kernel_build):
    """The element-wise output gate (Qwen3-Next / Qwen3.5: one gate per channel): the same `gate`
    linear with heads x head_dim rows (a recipe's attn_gate = "channel"), through the C core's prompt
    path and decode steps (every linear kept bf16 by the recipe, so the check is the gate's math)
    against the float64 forward."""
    from pathlib import Path

    from sparkq.runtime.lite import load as load_lite
    src = make_spark(tmp_path / "src", gate_width=CFG["head_dim"])
    recipe = (Path(__file__).parents[1] / "recipes" / "spark2_5.toml").read_text()
    recipe = recipe.replace('attn_gate = "head"', 'attn_gate = "channel"').replace(
        'keep_bf16 = ["gate"]', 'keep_bf16 = ["gate", "qkv", "o", "gate_up", "down", "lm_head", "embed"]').replace(
        'keep_int8 = ["lm_head", "embed"]', 'keep_int8 = []')
    (tmp_path / "channel.toml").write_text(recipe)
    out = tmp_path / "q"
    convert(str(src), str(out), Options(progress=False, method="minmax", recipe=str(tmp_path / "channel.toml")))
    art = Artifact.open(out)
    assert art.spec.attn_gate == CFG["head_dim"] and art.manifest.linears["layers.0.gate"].n == 4 * CFG["head_dim"]
    ids = torch.randint(0, 320, (96,), generator=torch.Generator().manual_seed(6)).tolist()
    m = load_lite(str(out), max_model_len=128, kv_dtype="bf16")
    m.prefill(ids[:64])  # the C prompt path
    ours = torch.tensor(np.stack([m.step(t, 64 + j).copy() for j, t in enumerate(ids[64:])])).double()
    ref = reference_forward(src, ids)[64:]
    assert _rel(ours, ref) < 0.02, _rel(ours, ref)
    assert _rel(ours, reference_forward(src, ids, gate=False)[64:]) > 0.1
    assert_batched_step_is_single(out, [ids[:40], ids[3:70]], max_model_len=128)
