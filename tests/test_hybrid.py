"""The Spark-like hybrid: sliding/full layer types with per-type RoPE theta and partial rotary.
No transformers class exists, so the oracle is an independent float64 forward written here."""
import json

import pytest
import torch

from helpers import byte_tokenizer, dequant_reference, kernel_builds
from sparkq.convert.pipeline import Options, convert
from sparkq.runtime import load

CFG = {
    "architectures": ["SparkForCausalLM"], "model_type": "spark", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 6,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25}},
}


def make_hybrid(out):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    c = CFG
    H, I, D, nh, nkv, V = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_attention_heads"], \
        c["num_key_value_heads"], c["vocab_size"]
    t = {"model.embed_tokens.weight": torch.randn(V, H, generator=g) * 0.5, "model.norm.weight": 1 + 0.1 * torch.randn(H, generator=g)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n, shape in (("self_attn.q_proj", (nh * D, H)), ("self_attn.k_proj", (nkv * D, H)), ("self_attn.v_proj", (nkv * D, H)),
                         ("self_attn.o_proj", (H, nh * D)), ("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)), ("mlp.down_proj", (H, I))):
            t[p + n + ".weight"] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + n + ".weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    out.mkdir()
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(CFG))
    (out / "tokenizer.json").write_text(byte_tokenizer(V))
    return out


def reference_forward(path, ids):
    """Float64, straight from the HF-named tensors: partial rotary, sliding windows, GQA."""
    from safetensors.torch import load_file
    w = {k: v.double() for k, v in load_file(path / "model.safetensors").items()}
    c = CFG
    nh, nkv, D, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    T = len(ids)
    pos = torch.arange(T, dtype=torch.float64)

    def norm(x, wt):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * wt

    def rope(x, theta, rot):  # x [heads, T, D]; rotate-half on the first `rot` features
        inv = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        ang = pos[:, None] * inv[None, :]
        cos, sin = torch.cos(ang), torch.sin(ang)
        x1, x2, rest = x[..., : rot // 2], x[..., rot // 2: rot], x[..., rot:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)

    x = w["model.embed_tokens.weight"][ids]
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        rp = c["rope_parameters"][kind]
        rot = int(D * rp["partial_rotary_factor"])
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, D).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, D).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, D).transpose(0, 1)
        q, k = rope(q, rp["rope_theta"], rot), rope(k, rp["rope_theta"], rot)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        s = q @ k.transpose(1, 2) / D ** 0.5
        qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
        allowed = ki <= qi
        if kind == "sliding_attention":
            allowed &= ki > qi - c["sliding_window"]
        s = s.masked_fill(~allowed, float("-inf"))
        o = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(T, nh * D)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gte = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(gte) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    return x @ w["model.embed_tokens.weight"].T


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_hybrid_runtime_matches_float64_reference(tmp_path, kernel_build):
    src = make_hybrid(tmp_path / "hybrid")
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(5)).tolist()  # > 4x the window
    ref = reference_forward(src, ids)
    m = load(str(src), max_model_len=64)
    steps = [m.model.forward(torch.tensor(ids[:16]), 0, last_only=False)]
    for j in range(16, 24):  # the rest through the KV cache
        steps.append(m.model.forward(torch.tensor(ids[j:j + 1]), j))
    ours = torch.cat(steps).double()
    assert ((ours - ref).abs().max() / ref.abs().max()) < 0.03
    assert (ours.argmax(-1) == ref.argmax(-1)).double().mean() >= 0.9
    # exactly one RoPE table per distinct (theta, rotary dim), sized max_model_len x rotary_dim
    tables = {r.key: tuple(r.cos.shape) for r in m.model.ropes}
    assert tables == {(10000.0, 16, None): (64, 16), (1000000.0, 4, None): (64, 4)}  # (theta, rot, scaling)
    assert [c.window for c in m.model.layer_cfg] == [6, 6, None, 6]
    assert m.model.layer_cfg[0].rope is m.model.layer_cfg[1].rope is m.model.layer_cfg[3].rope
    # the int4 artifact against its own dequantized weights (fp32), no worse than bf16 compute
    convert(str(src), str(tmp_path / "q"), Options(progress=False))
    q = load(str(tmp_path / "q"), max_model_len=64)
    t = torch.tensor(ids)
    a = q.model.forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    assert (a - b32).abs().max() <= 1.5 * (b16 - b32).abs().max() + 0.01 * b32.abs().max()


def test_rope_sized_from_max_model_len_not_config(tmp_path):
    src = make_hybrid(tmp_path / "hybrid")
    m = load(str(src))  # default max_model_len: min(2048, 1M)
    assert sum(r.nbytes for r in m.model.ropes) == 2 * 2 * 2048 * (16 + 4)
    from sparkq.runtime.options import LabOptions
    bad = load(str(src), lab=LabOptions(rope_len_from_config=True))
    assert sum(r.nbytes for r in bad.model.ropes) == 2 * 2 * 1048576 * (16 + 4)
