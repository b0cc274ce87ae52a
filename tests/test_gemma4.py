"""Gemma 4 E-style text models (formats/geometry.py: per-layer head dims, KV shared across the last
layers, per-layer inputs; v norm, layer scalars, proportional RoPE, scale-1 attention, softcap):
tiny random models made with transformers (the oracle). bf16 logits against transformers fp32 over
200 positions (the prompt path, then C decode steps); the int4 artifact through the C core against
its dequantized weights on the torch reference, on every build; both runtimes the same bits and the
batched step the single step's; the server's prefix cache across the sharing layers; the multimodal
wrapper's text model; the KV budget counts only the layers that keep a cache; the refusals (k = v
attention, experts, GPTQ calibration); chat turns that reuse their history."""
import json

import numpy as np
import pytest
import torch

from helpers import against_dequantized, assert_batched_step_is_single, kernel_builds, make_gemma4, prompt_then_steps, run_cli
from sparkq.convert.pipeline import Options, convert
from sparkq.formats import Artifact
from sparkq.runtime import load
from sparkq.runtime.common import kv_bytes_per_token
from sparkq.runtime.core import compiler

POSITIONS = 200
C_PATH = "c (" if compiler() else "torch ("


@pytest.fixture(scope="module")
def g4(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma4")
    src = make_gemma4(d / "src")
    seq = torch.randint(0, 256, (POSITIONS,), generator=torch.Generator().manual_seed(1)).tolist()
    convert(str(src), str(d / "q"), Options(progress=False))
    return src, d / "q", seq


def _hf(path, ids, dtype, wrapper=False):
    import transformers
    cls = transformers.Gemma4ForConditionalGeneration if wrapper else transformers.AutoModelForCausalLM
    m = cls.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


def test_bf16_against_transformers(g4):
    src, _, seq = g4
    ref32, ref16 = _hf(src, seq, torch.float32), _hf(src, seq, torch.bfloat16)
    m = load(str(src), max_model_len=256, kv_dtype="bf16")
    assert m.info.extra["decode_path"].startswith(C_PATH), m.info.extra  # (the steps through the C core)
    ours = prompt_then_steps(m, seq, 150)
    ours_err, hf_err = (ours - ref32).abs().max(), (ref16 - ref32).abs().max()
    # within bf16's own error of transformers fp32 (measured: dropping the per-layer inputs, reading
    # another layer's shared KV, or the layer scalars each fails this)
    assert ours_err <= 1.5 * hf_err + 0.01 * ref32.abs().max(), (ours_err, hf_err)
    agree = lambda a: (a.argmax(-1) == ref32.argmax(-1)).float().mean()  # noqa: E731
    assert agree(ours) >= agree(ref16) - 0.03, (agree(ours), agree(ref16))


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_int4_artifact_against_its_dequantized_weights(g4, kernel_build):
    _, out, seq = g4
    art = Artifact.open(out)
    s = art.spec
    assert s.family == "gemma4" and s.head_dims == (32, 32, 64, 32, 32, 64) and s.kv_from == (0, 1, 2, 3, 3, 2)
    assert s.inters == (192, 192, 192, 192, 384, 384) and s.attn_scale == 1.0 and s.final_softcap == 30.0
    # a KV-sharing layer stores its q rows only; the per-layer input table is int8 rows
    assert art.linears["layers.4.qkv"].n == 4 * 32 and art.linears["ple_embed"].kind == "int8"
    assert "layers.4.k_norm.weight" not in art.infos and art.infos["layers.0.layer_scalar.weight"].shape == (1,)
    q = load(str(out), max_model_len=256, kv_dtype="bf16")
    assert q.info.extra["decode_path"].startswith(C_PATH), q.info.extra
    pairs, budget = against_dequantized(q, seq)
    for got, ref, r16 in pairs:
        assert (got - ref).abs().max() <= budget
        # the mean error within bf16's own (measured: 0.63 of it; without the per-layer inputs 13.7x,
        # the layer scalars 3.3x, the v norm 5.4x, or with a sharing layer reading another cache 5.4x)
        assert (got - ref).abs().mean() <= 1.5 * (r16 - ref).abs().mean()


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_both_runtimes_and_the_batched_step_are_the_same_bits(g4, kv):
    from sparkq.runtime.lite import load as load_lite
    _, out, seq = g4
    lite, tr = load_lite(str(out), max_model_len=128, kv_dtype=kv), load(str(out), max_model_len=128, kv_dtype=kv)
    assert tr.info.extra["prefill_path"] == "c", tr.info.extra  # (both runtimes' prompts through sq_prefill)
    a = np.stack([lite.prefill(seq[:30]).copy()] + [lite.step(t, 30 + j).copy() for j, t in enumerate(seq[30:40])])
    b = np.stack([tr.first_logits(seq[:30])] + [tr.next_logits(t, 30 + j) for j, t in enumerate(seq[30:40])])
    assert np.array_equal(a, b)
    assert_batched_step_is_single(out, [seq[:20], seq[40:75], seq[100:103]])


def test_serve_prefix_cache_across_the_sharing_layers(g4):
    """prompts that extend one another through an engine with the prefix cache and one without: the
    same tokens, positions reused (the sharing layers read the copied positions of their sources)"""
    from sparkq.runtime.lite import load as load_lite
    from sparkq.runtime.serve.engine import Engine
    _, out, seq = g4
    on, off = (Engine(load_lite(str(out), max_model_len=128, kv_budget_mib=4, slots=2), prefill_slice=16,
                      prefix_cache=pc) for pc in (True, False))
    try:
        prompts = [seq[:40], seq[:40] + seq[100:110], seq[:40], seq[50:60]]
        a = [on.generate(p, 10, ignore_eos=True) for p in prompts]
        b = [off.generate(p, 10, ignore_eos=True) for p in prompts]
        assert [x["ids"] for x in a] == [x["ids"] for x in b]
        assert on.stats["cached"] > 0 and off.stats["cached"] == 0
    finally:
        on.close()
        off.close()


def test_kv_budget_counts_only_the_layers_that_keep_a_cache(g4):
    s = Artifact.open(g4[1]).spec
    assert s.kv_layers == (0, 1, 2, 3)
    assert kv_bytes_per_token(s, "bf16") == 2 * 2 * 2 * (32 + 32 + 64 + 32)  # K and V, 2 heads, bf16, 4 layers
    m = load(str(g4[1]), max_model_len=64, kv_dtype="int8", kv_budget_mib=1)
    assert m.model.cache.nbytes == m.model.cache.capacity * kv_bytes_per_token(s, "int8")


def test_the_multimodal_wrappers_text_model(tmp_path):
    src = make_gemma4(tmp_path / "vl", wrapper=True)
    convert(str(src), str(tmp_path / "vl-q"), Options(progress=False, method="minmax"))
    art = Artifact.open(tmp_path / "vl-q")
    assert art.spec.ple_dim == 64 and not [n for n in art.infos if "vision" in n or "audio" in n]
    ids = list(range(40, 100))
    ref32, ref16 = _hf(src, ids, torch.float32, wrapper=True), _hf(src, ids, torch.bfloat16, wrapper=True)
    m = load(str(src), max_model_len=128, kv_dtype="bf16")
    got = m.model.forward(torch.tensor(ids), 0, last_only=False)
    assert (got - ref32).abs().max() <= 1.5 * (ref16 - ref32).abs().max() + 0.01 * ref32.abs().max()


def test_refusals_and_the_cli(g4, tmp_path):
    src, out, _ = g4
    cfg = json.loads((src / "config.json").read_text())
    for field, value, says in (("attention_k_eq_v", True, "attention_k_eq_v"), ("enable_moe_block", True, "experts")):
        d = tmp_path / field
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps({**cfg, field: value}))
        r = run_cli("spark-convert", str(d), str(tmp_path / f"{field}-q"), "--quiet")
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / f"{field}-q").exists()
    r = run_cli("spark-convert", str(src), str(tmp_path / "gptq"), "--method", "gptq", "--quiet")
    assert r.returncode == 2 and "--method clip" in r.stderr
    got = [json.loads(run_cli("sparkq", "generate", str(out), "hello", rt, "--max-new-tokens", "8", "--json").stdout)
           for rt in ("--lite", "--torch")]
    assert got[0]["token_ids"] == got[1]["token_ids"] and len(got[0]["token_ids"]) == 8


GEMMA_CHAT = ("{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
              "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_chat_turns_reuse_the_history(g4, tmp_path):
    """`sparkq chat`'s conversation on a Gemma 4 artifact with a Gemma-style template: a second turn
    prefills only its new tokens (the sharing layers read the history their sources cached), and its
    first logits match a fresh prefill of the whole conversation"""
    from sparkq.runtime.chat import ChatSession, common_prefix
    from sparkq.runtime.lite import load as load_lite
    src, out, _ = g4
    art = tmp_path / "chat"
    art.mkdir()
    for f in out.iterdir():
        (art / f.name).symlink_to(f)
    (art / "tokenizer_config.json").unlink()
    (art / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "chat_template": GEMMA_CHAT}))
    g = load_lite(str(art), max_model_len=256, kv_budget_mib=8)
    s = ChatSession(g)
    "".join(s.turn("hello there", max_new_tokens=8))
    hist = list(s.cached)
    ids2 = g.tokenizer.encode_chat(s.messages + [{"role": "user", "content": "and then?"}])
    reuse = common_prefix(hist, ids2)
    assert reuse > len(hist) // 2
    first = g.prefill_from(ids2, reuse).copy()
    fresh = load_lite(str(art), max_model_len=256, kv_budget_mib=8).first_logits(ids2)
    assert np.abs(first - fresh).max() / np.abs(fresh).max() < 0.03
    "".join(s.turn("and then?", max_new_tokens=6))
    assert s.last["prefilled"] == len(ids2) - reuse
