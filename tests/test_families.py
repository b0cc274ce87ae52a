"""Families beyond Llama: one model file, recipes as data. For each: bf16 runtime vs
transformers (prefill + cached decode), then the int4 artifact against its own dequantized weights."""
import numpy as np
import pytest
import torch

from helpers import assert_batched_step_is_single, dequant_reference, kernel_builds, make_llama
from sparkq.convert.pipeline import Options, convert
from sparkq.formats import Artifact
from sparkq.runtime import load
from sparkq.runtime.core import compiler

C_PATH = "c (" if compiler() else "torch ("  # no compiler: the runtime's torch fallback

FAMILIES = {
    "qwen2": dict(arch="qwen2"),
    # YaRN (Qwen2.5/Qwen3 long-context configs): interpolated low frequencies, cos/sin scaled
    "qwen2-yarn": dict(arch="qwen2", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 128}),
    "qwen3": dict(arch="qwen3", head_dim=48),           # head_dim != hidden/heads, q/k norm
    "mistral": dict(arch="mistral", sliding_window=8),  # prompt longer than the window
    # 5 sliding layers (theta 1e4, window 8) + 1 full (theta 1e6); q/k norms, (1+w) norms,
    # sandwich norms, sqrt(hidden) embedding scale, GELU-tanh, query_pre_attn_scalar
    "gemma3": dict(arch="gemma3", layers=6, sliding_window=8, head_dim=48, query_pre_attn_scalar=40),
    # Gemma3 >= 4B: linear RoPE scaling on the full-attention layers only
    # Granite 3: the four multipliers (embedding, attention scale, residual, logits divisor)
    "granite": dict(arch="granite", embedding_multiplier=6.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                    logits_scaling=4.0),
    # OLMo 2: no pre-norms (post-attention / post-MLP norms only), q/k norms over the whole width
    "olmo2": dict(arch="olmo2", tied=False),
    # SmolLM3: every 4th layer without RoPE (no_rope_layers: 0), as SmolLM3-3B
    "smollm3": dict(arch="smollm3", layers=4, no_rope_layers=[1, 1, 1, 0], pad_token_id=None),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary 0.75, LongRoPE with short
    # factors (28 positions within original_max_position_embeddings) and with long ones (past it)
    "phi3": dict(arch="phi3", pad_token_id=None, partial_rotary_factor=0.75, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(12)],
        "long_factor": [1.5 + 0.5 * i for i in range(12)], "partial_rotary_factor": 0.75}),
    "phi3-long": dict(arch="phi3", pad_token_id=None, original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
        "long_factor": [1.0 + 0.4 * i for i in range(16)]}),
    # Gemma 3 >= 4B: the text model inside Gemma3ForConditionalGeneration (vision tower dropped)
    "gemma3-mm": dict(arch="gemma3mm", layers=6, sliding_window=8, head_dim=48, query_pre_attn_scalar=40),
    # Granite 4.0 dense: GraniteMoeHybrid with attention layers only and the shared (dense) MLP
    "granitemoehybrid": dict(arch="granitemoehybrid", layer_types=["attention", "attention"], num_local_experts=0,
                             shared_intermediate_size=192, position_embedding_type="rope", embedding_multiplier=6.0,
                             residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0, pad_token_id=None),
    "granitemoehybrid-nope": dict(arch="granitemoehybrid", layer_types=["attention", "attention"], num_local_experts=0,
                                  shared_intermediate_size=192, position_embedding_type="nope", pad_token_id=None),
    "gemma3-scaled": dict(arch="gemma3", layers=6, sliding_window=8, head_dim=48, query_pre_attn_scalar=40,
                          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


def _hf_logits(path, ids, dtype):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """fam -> (checkpoint, its int4 artifact, 28 token ids, transformers fp32 and bf16 logits), made once per family."""
    made = {}

    def get(fam):
        if fam not in made:
            d = tmp_path_factory.mktemp(fam)
            src = make_llama(d / fam, **FAMILIES[fam])
            seq = torch.randint(0, 256, (28,), generator=torch.Generator().manual_seed(1)).tolist()
            out = d / f"{fam}-int4"
            convert(str(src), str(out), Options(progress=False))
            made[fam] = (src, out, seq, _hf_logits(src, seq, torch.float32), _hf_logits(src, seq, torch.bfloat16))
        return made[fam]
    return get


def _prefill_then_steps(m, seq, n=20):
    """Logits of seq: the first n through the prompt path, the rest one decode step each over that cache."""
    steps = [m.model.forward(torch.tensor(seq[:n]), 0, last_only=False)]
    steps += [m.model.forward(torch.tensor(seq[i:i + 1]), i) for i in range(n, len(seq))]
    return torch.cat(steps)


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_family_bf16_vs_transformers(fam, kernel_build, family):
    src, _, seq, ref32, ref16 = family(fam)
    m = load(str(src), max_model_len=64, kv_dtype="bf16")  # bf16 throughout (the int8 cache: test_kvcache.py)
    assert m.info.extra["decode_path"].startswith(C_PATH), m.info.extra  # bf16 linears decode in C too
    ours = _prefill_then_steps(m, seq)
    # "within bf16 tolerance": no further from transformers-fp32 than transformers' own bf16 run is
    # (random Gemma-style sandwich norms make bf16 itself drift by several % of the logit scale)
    ours_err, hf_err = (ours - ref32).abs().max(), (ref16 - ref32).abs().max()
    assert ours_err <= 1.5 * hf_err + 0.01 * ref32.abs().max(), (fam, ours_err, hf_err)
    agree = lambda a: (a.argmax(-1) == ref32.argmax(-1)).float().mean()  # noqa: E731
    assert agree(ours) >= agree(ref16) - 0.1, (fam, agree(ours), agree(ref16))


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_family_int4_against_its_dequantized_weights(fam, kernel_build, family):
    _, out, seq, _, _ = family(fam)
    art = Artifact.open(out)
    assert art.spec.family == fam.split("-")[0]
    q = load(str(out), max_model_len=64, kv_dtype="bf16")
    assert q.info.extra["decode_path"].startswith(C_PATH), q.info.extra
    t = torch.tensor(seq)
    a = q.model.forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    # the C core's W4A8 products (activations int8 per 8 columns) vs fp32 on the same
    # dequantized weights: within 2.5x of what plain bf16 compute loses (measured 1.6-2.3x here)
    budget = 2.5 * (b16 - b32).abs().max() + 0.01 * b32.abs().max()
    assert (a - b32).abs().max() <= budget, fam
    # decode steps through the C step, attention over the cache the prefill wrote
    dec = _prefill_then_steps(q, seq)[20:]
    assert (dec - b32[20:]).abs().max() <= budget, fam


def test_unknown_architecture_lists_supported(tmp_path):
    import json

    from helpers import run_cli
    src = make_llama(tmp_path / "x")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    p = run_cli("spark-convert", src, tmp_path / "o")
    assert p.returncode == 2
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM",
                 "Spark2_5ForCausalLM", "--recipe"):
        assert arch in p.stderr, p.stderr


@pytest.mark.parametrize("rope", [
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5's long-context line
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.8, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536, "attention_factor": 1.2,
     "truncate": False},
])
def test_yarn_frequencies_and_scale_match_transformers(rope):
    """YaRN's inverse frequencies and cos/sin factor against transformers' own YaRN, on long-context
    configs (theta 1e6, head_dim 128, 131072 positions)."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sparkq.formats.rope import rope_attention_factor, rope_inv_freq

    from sparkq.formats.spec import ModelSpec

    base = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=1000, max_position_embeddings=131072, rope_theta=1e6)
    cfg = {**base, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": rope}
    spec = ModelSpec.from_config(cfg, "qwen2", qkv_bias=True)
    hf = Qwen2Config(**base, rope_scaling=dict(rope))
    inv, att = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = rope_inv_freq(spec, 128, 1e6)
    assert abs(rope_attention_factor(spec) - att) < 1e-12
    assert (abs(torch.from_numpy(ours) - inv) / inv).max() < 1e-6


def test_per_layer_type_rope_scaling_in_both_config_styles():
    """Gemma3's scaling applies to its global layers only, from transformers-5 rope_parameters keyed
    by layer type and from the older rope_scaling beside rope_local_base_freq alike."""
    from sparkq.formats.rope import rope_inv_freq
    from sparkq.formats.spec import ModelSpec

    base = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=131072,
                sliding_window=8, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    old = {**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    new = {**base, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    for cfg in (old, new):
        spec = ModelSpec.from_config(cfg, "gemma3")
        assert spec.layer_rope_scaling(0) is None and spec.layer_rope_scaling(5)["factor"] == 8.0
        assert spec.layer_rope_key(0) != spec.layer_rope_key(5) and spec.layer_rope_key(0) == spec.layer_rope_key(4)
        plain = 1.0 / (1e4 ** (np.arange(0, 64, 2) / 64))
        assert np.allclose(rope_inv_freq(spec, 64, 1e4, 0), plain, rtol=1e-6)
        assert np.allclose(rope_inv_freq(spec, 64, 1e6, 5), 1.0 / (1e6 ** (np.arange(0, 64, 2) / 64)) / 8, rtol=1e-6)


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_family_logits_over_200_positions_within_2_percent(fam, tmp_path):
    """The bf16 checkpoint through sparkq's torch runtime (the C prompt path, bf16 linears) against
    transformers' fp32 logits over 200 positions: relative error (Frobenius) under 2%. Past 64
    positions, so LongRoPE (phi3) runs its long factors in both."""
    src = make_llama(tmp_path / fam, **FAMILIES[fam])
    seq = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = _hf_logits(src, seq, torch.float32)
    ours = load(str(src), max_model_len=256, kv_dtype="bf16").logits(seq)
    rel = ((ours - ref).norm() / ref.norm()).item()
    # (a random model whose own bf16 run drifts further, e.g. attention without positions: no
    # further than transformers' bf16)
    hf16 = ((_hf_logits(src, seq, torch.bfloat16) - ref).norm() / ref.norm()).item()
    print(f"{fam}: sparkq bf16 {100 * rel:.2f}%, transformers bf16 {100 * hf16:.2f}%")  # (docs/correctness.md, -s)
    assert rel < max(0.02, hf16), (fam, rel, hf16)


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_family_batched_step_is_the_single_step(fam, kernel_build, family):
    """The server's batched decode step (sq_step_many) gives each sequence the single step's bits."""
    _, out, seq, _, _ = family(fam)
    assert_batched_step_is_single(out, [seq[:9], seq[3:20], seq[:4]])


REFUSALS = {  # family -> (config edit, the field the one-line error names)
    "granite": (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    "olmo2": (lambda c: c.update(mlp_bias=True), "mlp_bias"),
    "phi3": (lambda c: c["rope_parameters"].update(rope_type="dynamic"), "'dynamic'"),
    "smollm3": (lambda c: c.update(no_rope_layers=[1, 0]), "no_rope_layers"),
    "gemma3-mm": (lambda c: c.pop("text_config"), "text_config"),
    "granitemoehybrid": (lambda c: c.update(layer_types=["attention", "mamba"]), "mamba"),
    "granitemoehybrid-experts": (lambda c: c.update(num_local_experts=4), "num_local_experts"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_family_config_fields_sparkq_does_not_implement_are_refused(case, tmp_path):
    """A config field that would make a different model than sparkq runs: one line naming it, exit
    2, nothing written."""
    import json

    from helpers import run_cli
    edit, field = REFUSALS[case]
    src = make_llama(tmp_path / "src", **FAMILIES[case.removesuffix("-experts")])
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    p = run_cli("spark-convert", src, tmp_path / "out", "--method", "minmax")
    assert p.returncode == 2 and field in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_names_the_family_and_a_text_only_source(family):
    """inspect says which family an artifact is, and that a multimodal source's is text only."""
    from helpers import run_cli

    for fam in ("phi3", "gemma3-mm"):
        p = run_cli("sparkq", "inspect", family(fam)[1])
        assert p.returncode == 0 and fam.split("-")[0] in p.stdout, p.stdout
    assert "text_only" in run_cli("sparkq", "inspect", family("gemma3-mm")[1]).stdout
    from sparkq.convert.publish import model_card
    assert "Text only." in str(model_card(Artifact.open(family("gemma3-mm")[1]), "org/g3", ["rows32"]))
    assert "Text only." not in str(model_card(Artifact.open(family("phi3")[1]), "org/p3", ["rows32"]))


def test_the_thinking_switch_reaches_the_chat_template(tmp_path):
    """SmolLM3's template tests variables only some callers pass (xml_tools) and reads enable_thinking:
    it renders as transformers renders it, and --no-think switches it."""
    import json

    from helpers import run_cli
    from sparkq.runtime.tokenizer import ChatTokenizer

    src = make_llama(tmp_path / "m", **FAMILIES["smollm3"])
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = ("{%- if xml_tools or python_tools or tools %}TOOLS{% endif %}"
                             "{%- if enable_thinking is defined and enable_thinking is false %}/no_think{% else %}/think{% endif %}"
                             "{% for m in messages %}|{{ m['content'] }}{% endfor %}")
    (src / "tokenizer_config.json").write_text(json.dumps(tcfg))
    tok = ChatTokenizer.from_dir(src, json.loads((src / "config.json").read_text()))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "/think|hi"
    tok.template_kwargs = {"enable_thinking": False}
    assert tok.render_chat(msgs) == "/no_think|hi"
    art = tmp_path / "art"
    convert(str(src), str(art), Options(progress=False, method="minmax"))
    for flag, want in (("--think", "/think|hi"), ("--no-think", "/no_think|hi")):
        p = run_cli("sparkq", "generate", art, "hi", "--chat", flag, "--max-new-tokens", "1", "--json")
        assert p.returncode == 0, p.stderr
        assert tok.decode(json.loads(p.stdout)["prompt_ids"]) == want
