"""Convolution and state-space hybrids (formats/mixers.py): LFM2 and LFM3 (gated short convolutions
between attention layers), Granite 4.0-H and Nemotron-H (Mamba-2 layers; Nemotron-H's single-block
layers, some without an MLP, and its squared-ReLU MLP) and Falcon-H1 (attention and Mamba-2 side by
side in every layer, its muP multipliers folded into the linears' rows). Tiny random models made with
transformers (the oracle): bf16 logits against transformers fp32 over 200 positions; the int4
artifact against its own dequantized weights on every build; the C mixers (sq_mix) against the torch
math, a prompt's tokens in one call equal to one call each; the prompt path then decode equal to
token by token; the batched step's rows equal to the single step's bits; a rejected draft's rewind;
the server's prefix cache equal to a cold prefill; refusals by field; the commands a user runs."""
import ctypes
import json

import numpy as np
import pytest
import torch

from helpers import against_dequantized, assert_near_transformers, assert_batched_step_is_single, kernel_builds, run_cli
from ssm_models import ARCHS, make_ssm
from sparkq.convert.pipeline import Options, convert
from sparkq.formats import Artifact
from sparkq.formats import constants as C
from sparkq.formats.recipe import SpecError, recipe_for_config
from sparkq.formats.spec import ModelSpec
from sparkq.runtime import load
from sparkq.runtime.core import compiler

FAMILY = {"lfm2": "lfm2", "lfm3": "lfm3", "granite_h": "granitemoehybrid", "nemotron_h": "nemotron_h",
          "falcon_h1": "falcon_h1"}
MIXER = {"lfm2": C.MIXER_SCONV, "lfm3": C.MIXER_SCONV, "granite_h": C.MIXER_MAMBA, "nemotron_h": C.MIXER_MAMBA,
         "falcon_h1": C.MIXER_PARALLEL}
C_PATH = "c (" if compiler() else "torch ("
POSITIONS = 200


def _hf_logits(path, ids, dtype):
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def ssm(tmp_path_factory):
    """arch -> (checkpoint, its int4 artifact, token ids, transformers fp32 and bf16 logits), once per arch."""
    made = {}

    def get(arch):
        if arch not in made:
            d = tmp_path_factory.mktemp(arch)
            src = make_ssm(d / arch, arch)
            seq = torch.randint(0, 256, (POSITIONS,), generator=torch.Generator().manual_seed(1)).tolist()
            out = d / f"{arch}-int4"
            convert(str(src), str(out), Options(progress=False))
            made[arch] = (src, out, seq, _hf_logits(src, seq, torch.float32), _hf_logits(src, seq, torch.bfloat16))
        return made[arch]
    return get


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("arch", ARCHS)
def test_ssm_bf16_vs_transformers(arch, kernel_build, ssm):
    src, _, seq, ref32, ref16 = ssm(arch)
    assert_near_transformers(src, seq, ref32, ref16, arch)


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("arch", ARCHS)
def test_ssm_int4_against_its_dequantized_weights(arch, kernel_build, ssm):
    _, out, seq, _, _ = ssm(arch)
    art = Artifact.open(out)
    assert art.spec.family == FAMILY[arch] and MIXER[arch] in art.spec.mixers
    i = art.spec.mixers.index(MIXER[arch])
    # the mixer's own parameters are stored fp32, never quantized
    assert {art.infos[f"layers.{i}.{n}"].dtype for n in art.spec.params(i)} == {"F32"}
    q = load(str(out), max_model_len=256, kv_dtype="bf16")
    assert q.info.extra["decode_path"].startswith(C_PATH), q.info.extra
    pairs, budget = against_dequantized(q, seq)
    for got, b32, _ in pairs:
        assert (got - b32).abs().max() <= budget, arch


def _mix_case(out, build, monkeypatch):
    """(lite model of the artifact on `build`, its first recurrent layer, the torch math over its vectors)"""
    from sparkq.runtime.lite import load as load_lite
    from sparkq.runtime.torchrt.layers import Layers
    monkeypatch.setenv("SPARKQ_KERNEL", build)
    m = load_lite(str(out), max_model_len=64)
    spec, tensors = m.spec, Artifact.open(out).map()
    i = next(j for j, x in enumerate(spec.mixers) if x != C.MIXER_ATTENTION)
    return m, i, Layers(spec, lambda n: tensors[n])


@pytest.mark.parametrize("build", kernel_builds())
@pytest.mark.parametrize("arch", ("lfm2", "granite_h", "falcon_h1"))
def test_c_mixer_matches_the_torch_math_and_any_split(arch, build, ssm, monkeypatch):
    """sq_mix over 9 tokens from empty states (one call), against Layers' fp32 math; the same tokens
    as 4 + 1 + 4 calls leave the same bits (outputs and both states): the prompt path's chunks, the
    decode step and the batched step run one arithmetic."""
    from sparkq.formats.mixers import MIXERS, recurrent_widths
    _, out, _, _, _ = ssm(arch)
    m, i, lay = _mix_case(out, build, monkeypatch)
    s, spec = m.session, m.spec
    wq, wz, no = recurrent_widths(spec)
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((9, wq)).astype(np.float32)
    g = rng.standard_normal((9, max(wz, 1))).astype(np.float32)
    names = list(MIXERS[spec.mixers[i]].state(spec))
    states = dict(zip(names, (x for x in m.state[i].values())))

    def run(parts):
        for x in states.values():
            x[0] = 0.0
        outs = []
        for a, b in parts:
            o = np.full((b - a, no), np.nan, np.float32)
            q, z = qkv[a:b].copy(), g[a:b].copy()
            assert s.lib.sq_mix(ctypes.byref(s.m), ctypes.byref(s.layers[i]), 0, q.ctypes.data, z.ctypes.data, b - a,
                                o.ctypes.data) == 0
            outs.append(o)
        return np.concatenate(outs), {n: x[0].copy() for n, x in states.items()}
    one, st1 = run([(0, 9)])
    split, st2 = run([(0, 4), (4, 5), (5, 9)])
    assert np.array_equal(one, split) and all(np.array_equal(st1[n], st2[n]) for n in names)
    want, after = lay.recurrent(i, torch.from_numpy(qkv)[None], torch.from_numpy(g[:, :wz])[None] if wz else None, None)
    want = want[0].numpy()
    scale = np.abs(want).max()
    assert np.abs(one - want).max() <= 2e-5 * scale, (np.abs(one - want).max(), scale)
    for n in names:
        np.testing.assert_allclose(st1[n], after[n][0].numpy(), rtol=0, atol=2e-5 * after[n].abs().max().item())


@pytest.mark.parametrize("arch", ("lfm2", "granite_h", "falcon_h1"))
def test_prompt_then_decode_equals_token_by_token(arch, ssm):
    from sparkq.runtime.lite import load as load_lite
    _, out, seq, _, _ = ssm(arch)
    m = load_lite(str(out), max_model_len=64)
    s = m.session
    s.prefill(seq[:1], 0)
    steps = [s.step(seq[i], i).copy() for i in range(1, 40)]
    m2 = load_lite(str(out), max_model_len=64)
    assert m2.session.prefill(seq[:30], 0, last_only=False).shape[0] == 30
    after = [m2.session.step(seq[i], i).copy() for i in range(30, 40)]
    for a, b in zip(steps[29:], after):  # (the prompt GEMM and the decode product round differently)
        np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * np.abs(b).max())


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("arch", ("lfm3", "nemotron_h", "falcon_h1"))
def test_batched_rows_are_the_single_step(arch, kernel_build, ssm):
    _, out, seq, _, _ = ssm(arch)
    assert_batched_step_is_single(out, [seq[:9], seq[20:45], seq[50:53]])


@pytest.mark.parametrize("arch", ("lfm2", "nemotron_h", "falcon_h1"))
def test_a_rejected_draft_leaves_the_state_as_single_steps_do(arch, ssm):
    """verify 6 rows then keep 2: the states and the next logits are the bits two single steps leave"""
    from sparkq.runtime.lite import load as load_lite
    _, out, seq, _, _ = ssm(arch)
    a, b = (load_lite(str(out), max_model_len=64) for _ in range(2))
    for m in (a, b):
        m.prefill(seq[:20])
    rows = a.verify([5, 6, 7, 8, 9, 10], 20)
    a.keep(2)
    single = [b.step(t, 20 + j).copy() for j, t in enumerate([5, 6])]
    assert np.array_equal(rows[:2], np.stack(single))
    for x, y in zip(a.state_buffers(), b.state_buffers()):
        assert np.array_equal(x, y), arch
    assert np.array_equal(a.step(11, 22), b.step(11, 22))


def test_refusals_by_field(tmp_path):
    lfm = json.loads((make_ssm(tmp_path / "l", "lfm2") / "config.json").read_text())
    gh = json.loads((make_ssm(tmp_path / "g", "granite_h") / "config.json").read_text())
    nh = json.loads((make_ssm(tmp_path / "n", "nemotron_h") / "config.json").read_text())
    nhp = {k: v for k, v in nh.items() if k != "layers_block_type"}  # (its blocks from the pattern instead)
    for cfg, field, value, words in (
            (lfm, "conv_L_cache", 40, "conv_L_cache 40 is out of range"),
            (lfm, "conv_bias", True, "conv_bias=true"),
            (lfm, "block_use_swiglu", False, "block_use_swiglu=false"),
            (lfm, "some_new_field", 1, "some_new_field"),
            (gh, "mamba_n_groups", 3, "not a multiple of mamba_n_groups"),
            (gh, "mamba_d_head", 24, "mamba_d_head 24"),
            (gh, "time_step_limit", [0.001, 0.1], "time_step_limit"),
            (gh, "mamba_proj_bias", True, "mamba_proj_bias=true"),
            (gh, "num_local_experts", 4, "mixture-of-experts"),
            (nhp, "hybrid_override_pattern", "M-ME", "experts"),
            (nhp, "hybrid_override_pattern", "--M-", "an MLP after no mixer"),
            (nhp, "hybrid_override_pattern", None, "hybrid_override_pattern"),
            (nh, "mamba_hidden_act", "gelu", "mamba_hidden_act"),
            (nh, "mlp_hidden_act", "silu", "hidden_act='silu' is not implemented")):
        with pytest.raises(SpecError, match=words):
            ModelSpec.from_recipe({**cfg, field: value}, recipe_for_config(cfg))
    # a family whose recipe runs no such layers refuses them by name
    q3 = {**lfm, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6}
    with pytest.raises(SpecError, match="conv layers, which the qwen3 recipe does not implement"):
        ModelSpec.from_recipe(q3, recipe_for_config(q3))


def test_lfm2_legacy_config_names(tmp_path):
    """A published LFM2 config's legacy fields: block_ff_dim through the MLP width rule, full_attn_idxs
    into layer types, tie_embedding, norm_eps."""
    cfg = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048, "block_ff_dim": 12288,
           "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536,
           "full_attn_idxs": [2, 5, 8, 10, 12, 14], "tie_embedding": True, "norm_eps": 1e-5, "conv_L_cache": 3,
           "rope_theta": 1e6, "conv_dim": 2048, "use_pos_enc": True}
    s = ModelSpec.from_recipe(cfg, recipe_for_config(cfg))
    assert s.intermediate == 8192 and s.tied and s.rms_eps == 1e-5 and s.sconv.kernel == 3
    assert [i for i, t in enumerate(s.mixers) if t == C.MIXER_ATTENTION] == [2, 5, 8, 10, 12, 14]


@pytest.mark.parametrize("arch", ("lfm2", "falcon_h1"))
def test_chat_continues_the_state(arch, tmp_path):
    """chat over a recurrent state: the next turn prefills only its new tokens where the history
    re-encodes to what the state holds, else all of it (the state cannot be cut back)"""
    from helpers import CHATML
    from sparkq.runtime.chat import ChatSession
    from sparkq.runtime.lite import load as load_lite
    src = make_ssm(tmp_path / "src", arch)
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "chat_template": CHATML}))
    out = tmp_path / "art"
    convert(str(src), str(out), Options(progress=False, method="minmax"))
    chat = ChatSession(load_lite(str(out), max_model_len=256))
    "".join(chat.turn("hello there", max_new_tokens=6))
    held = len(chat.cached)
    "".join(chat.turn("and again", max_new_tokens=6))
    assert chat.last["prefilled"] in (chat.last["prompt_tokens"] - held, chat.last["prompt_tokens"])
    chat.messages[0]["content"] = "hello there!"
    "".join(chat.turn("once more", max_new_tokens=4))
    assert chat.last["prefilled"] == chat.last["prompt_tokens"]


def _engines(out, slots, **kw):
    from sparkq.runtime.lite import load as load_lite
    from sparkq.runtime.serve.engine import Engine
    mk = lambda **k: Engine(load_lite(str(out), max_model_len=256, kv_budget_mib=8, slots=slots), prefill_slice=16, **k)  # noqa: E731
    return mk(**kw), mk(prefix_cache=False)


@pytest.mark.parametrize("arch", ("lfm2", "granite_h", "nemotron_h", "falcon_h1"))
def test_serve_prefix_copies_and_batches_change_no_answer(arch, ssm):
    """The engine: a prefix reused from its state copies, n choices of one prompt batched with another
    request; every answer the bits an engine without the prefix cache gives."""
    _, out, _, _, _ = ssm(arch)
    on, off = _engines(out, 3)
    try:
        tok = on.tok
        base = tok.encode("The lighthouse keeper climbed the stairs at dusk, every day.")[:50]
        seq = [(base, {}), (base, {}), (base[:40], {}), (base, {"temperature": 0.9, "seed": 3})]
        a = [on.generate(ids, 10, ignore_eos=True, **kw) for ids, kw in seq]
        b = [off.generate(ids, 10, ignore_eos=True, **kw) for ids, kw in seq]
        assert [x["ids"] for x in a] == [x["ids"] for x in b]
        assert a[1]["cached_tokens"] > 0 and on.snaps is not None
        from helpers import generate_at_once
        got, load_ = generate_at_once(on, [base, base, base[:30]], 8, [{"ignore_eos": True}] * 3)
        assert [g["ids"] for g in got] == [b[0]["ids"][:8], b[0]["ids"][:8], off.generate(base[:30], 8, ignore_eos=True)["ids"]]
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("arch", ("lfm2", "granite_h", "nemotron_h"))
def test_cli_generate_chat_memory_and_serve(arch, ssm):
    """The commands a user runs on the artifact: generate (with n-gram drafts: the same tokens),
    chat, memory (the state as its own category) and the server through the openai client."""
    _, out, _, _, _ = ssm(arch)
    p = run_cli("sparkq", "generate", out, "Hello", "--max-new-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr
    plain = json.loads(p.stdout)
    p = run_cli("sparkq", "generate", out, "Hello", "--max-new-tokens", "8", "--json", "--draft", "ngram")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["text"] == plain["text"]
    p = run_cli("sparkq", "memory", out, "--json", "--max-model-len", "64")
    assert p.returncode == 0, p.stderr
    from sparkq.formats.mixers import state_bytes
    assert json.loads(p.stdout)["ledger"]["categories"]["recurrent state"]["bytes"] == state_bytes(Artifact.open(out).spec)
    from openai import OpenAI
    from test_serve import _server
    from sparkq.runtime.lite import load as load_lite
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.serve.server import App
    e = Engine(load_lite(str(out), max_model_len=128, kv_budget_mib=8, slots=2), prefill_slice=16)
    try:
        with _server(App(e, arch)) as url:
            c = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            r = c.completions.create(model=arch, prompt="Once upon a time, in a lighthouse", max_tokens=8, n=2)
            ref = e.generate(e.tok.encode("Once upon a time, in a lighthouse"), 8)
            assert [ch.text for ch in r.choices] == [ref["text"]] * 2
    finally:
        e.close()
