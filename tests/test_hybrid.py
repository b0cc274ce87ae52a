"""Hybrid models with recurrent state (formats/mixers.py): Qwen3.5 (and its published multimodal
wrapper) and OLMo Hybrid, Gated DeltaNet layers between attention layers. Tiny random models made
with transformers (the oracle): bf16 logits against transformers fp32 over 200 positions; the int4
artifact against its own dequantized weights on every build; the prompt path then decode equal to
token by token; the batched step's rows equal to the single step's bits; the server's prefix cache
and prompt copies equal to a cold prefill; refusals by field; the state in the memory accounting."""
import json

import numpy as np
import pytest
import torch

from helpers import against_dequantized, assert_near_transformers, kernel_builds, make_hybrid
from sparkq.convert.pipeline import Options, convert
from sparkq.formats import Artifact
from sparkq.formats.recipe import SpecError, recipe_for_config
from sparkq.formats.spec import ModelSpec
from sparkq.runtime import load
from sparkq.runtime.core import compiler

ARCHS = ("qwen3_5", "qwen3_5_vl", "olmo_hybrid")
FAMILY = {"qwen3_5": "qwen3_5", "qwen3_5_vl": "qwen3_5", "olmo_hybrid": "olmo_hybrid"}
C_PATH = "c (" if compiler() else "torch ("
POSITIONS = 200


def _hf_logits(path, arch, ids, dtype):
    import transformers
    cls = transformers.Qwen3_5ForConditionalGeneration if arch == "qwen3_5_vl" else transformers.AutoModelForCausalLM
    m = cls.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """arch -> (checkpoint, its int4 artifact, token ids, transformers fp32 and bf16 logits), once per arch."""
    made = {}

    def get(arch):
        if arch not in made:
            d = tmp_path_factory.mktemp(arch)
            src = make_hybrid(d / arch, arch)
            seq = torch.randint(0, 256, (POSITIONS,), generator=torch.Generator().manual_seed(1)).tolist()
            out = d / f"{arch}-int4"
            convert(str(src), str(out), Options(progress=False))
            made[arch] = (src, out, seq, _hf_logits(src, arch, seq, torch.float32), _hf_logits(src, arch, seq, torch.bfloat16))
        return made[arch]
    return get


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_bf16_vs_transformers(arch, kernel_build, hybrid):
    src, _, seq, ref32, ref16 = hybrid(arch)
    assert_near_transformers(src, seq, ref32, ref16, arch)


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_int4_against_its_dequantized_weights(arch, kernel_build, hybrid):
    _, out, seq, _, _ = hybrid(arch)
    art = Artifact.open(out)
    assert art.spec.family == FAMILY[arch] and "gdn" in art.spec.mixers
    # the DeltaNet's own parameters are stored fp32, never quantized
    assert {art.infos[f"layers.0.{n}"].dtype for n in ("conv.weight", "a_log", "dt_bias", "gnorm.weight")} == {"F32"}
    q = load(str(out), max_model_len=256, kv_dtype="bf16")
    assert q.info.extra["decode_path"].startswith(C_PATH), q.info.extra
    pairs, budget = against_dequantized(q, seq)
    for got, b32, _ in pairs:
        assert (got - b32).abs().max() <= budget, arch


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_prompt_then_decode_equals_token_by_token(kernel_build, hybrid):
    """The C core's prompt path leaves the recurrent state a decode step continues: a prompt of 30
    then 10 steps gives the logits that 40 steps from position 0 give (the steps' products are the
    same W4A8 products either way: the state and the KV rows are what is compared)."""
    from sparkq.runtime.lite import load as load_lite
    _, out, seq, _, _ = hybrid("qwen3_5")
    m = load_lite(str(out), max_model_len=64)
    s = m.session
    s.prefill(seq[:1], 0)
    steps = [s.step(seq[i], i).copy() for i in range(1, 40)]
    m2 = load_lite(str(out), max_model_len=64)
    x = m2.session.prefill(seq[:30], 0, last_only=False)
    assert x.shape[0] == 30
    after = [m2.session.step(seq[i], i).copy() for i in range(30, 40)]
    # (the prompt GEMM and the decode product round differently; tests/test_gdn_kernel.py shows the
    # bits equal where the products are the same)
    for a, b in zip(steps[29:], after):
        np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * np.abs(b).max())


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_batched_rows_are_the_single_step(kernel_build, hybrid):
    from helpers import assert_batched_step_is_single
    _, out, seq, _, _ = hybrid("olmo_hybrid")
    assert_batched_step_is_single(out, [seq[:9], seq[20:45], seq[50:53]])


def test_refusals_by_field(tmp_path):
    cfg = json.loads((make_hybrid(tmp_path / "m", "qwen3_5") / "config.json").read_text())
    r = recipe_for_config(cfg)
    ModelSpec.from_recipe(cfg, r)
    for field, value, words in (("num_experts", 8, "num_experts is not a qwen3_5 field"),
                                ("linear_num_value_heads", 3, "not a multiple"),
                                ("some_new_field", 1, "some_new_field"),
                                ("layer_types", ["mamba"] * 4, "mamba")):
        with pytest.raises(SpecError, match=words):
            ModelSpec.from_recipe({**cfg, field: value}, r)
    # a family whose recipe has no Gated DeltaNet layers refuses them by name
    q3 = {**cfg, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    with pytest.raises(SpecError, match="linear_attention layers, which the qwen3 recipe does not implement"):
        ModelSpec.from_recipe(q3, recipe_for_config(q3))


def test_memory_counts_the_state(hybrid):
    """A slot's recurrent state is allocated beside the KV cache (which covers the attention layers
    only) and comes out of the KV budget."""
    from sparkq.formats.mixers import state_bytes
    from sparkq.runtime.lite import load as load_lite
    _, out, _, _, _ = hybrid("qwen3_5")
    spec = Artifact.open(out).spec
    g = spec.gdn
    per_layer = 4 * (g.conv_dim * (g.conv_kernel - 1) + g.v_heads * g.k_dim * g.v_dim)
    assert state_bytes(spec) == 3 * per_layer
    m = load_lite(str(out), max_model_len=64, slots=2)
    assert m.state_nbytes == 2 * state_bytes(spec) and m.info.extra["state_bytes"] == m.state_nbytes
    assert m.k.shape[0] == 1  # one attention layer of four


def _engines(out, slots, **kw):
    from sparkq.runtime.lite import load as load_lite
    from sparkq.runtime.serve.engine import Engine
    mk = lambda **k: Engine(load_lite(str(out), max_model_len=256, kv_budget_mib=8, slots=slots), prefill_slice=16, **k)  # noqa: E731
    return mk(**kw), mk(prefix_cache=False)


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_serve_reuses_a_prefix_from_its_state_copies_and_changes_no_answer(kernel_build, hybrid):
    """The engine on a hybrid model: a prefix is reused only up to a slice boundary it holds a state
    copy at (prefix.py Snapshots), a newcomer restarts from it, and every answer is the bits an
    engine without the prefix cache gives."""
    _, out, _, _, _ = hybrid("qwen3_5")
    on, off = _engines(out, 2)
    try:
        tok = on.tok
        base = tok.encode("The lighthouse keeper climbed the stairs at dusk, every day.")[:50]
        assert len(base) == 50
        answer = off.generate(base, 10, ignore_eos=True)["ids"]
        follow = base + answer + tok.encode(" ok")
        seq = [(base, {}), (base, {}), (follow, {}), (tok.encode("zz top"), {}),
               (base, {"temperature": 0.9, "seed": 3}), (base[:40], {})]
        a = [on.generate(ids, 10, ignore_eos=True, **kw) for ids, kw in seq]
        b = [off.generate(ids, 10, ignore_eos=True, **kw) for ids, kw in seq]
        assert [x["ids"] for x in a] == [x["ids"] for x in b] and a[0]["ids"] == answer
        # copies at 16, 32, 48 and the prompt's end, 50: the same prompt restarts from 48 (never its
        # last token), the follow-up from 50 (not the answer's decoded positions; 48 where the
        # prompt GEMM needs whole slices), base[:40] from 32
        g = on.reuse_grid
        held = lambda n: max(p for p in (0, 16, 32, 48, 50) if p <= n // g * g)  # noqa: E731
        assert [x["cached_tokens"] for x in a] == [0, held(49), held(50), 0, held(49), held(39)]
        assert on.snaps is not None and on.load()["snapshot_bytes"] == on.snaps.bytes > 0 and off.stats["cached"] == 0
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_serve_copies_a_running_prompts_state_and_batches_mixed_layers(kernel_build, hybrid):
    """n choices of one prompt admitted together: the second copies the first's KV positions and its
    state copy when its prompt starts; the batched step over the hybrid's mixed layers gives each
    request what it decodes alone."""
    import threading as th

    from sparkq.runtime.serve.engine import Request
    _, out, _, _, _ = hybrid("olmo_hybrid")
    on, off = _engines(out, 3)
    try:
        tok = on.tok
        base = tok.encode("Write a long story about a lighthouse keeper, please.")[:40]
        jobs = [(base, 12), (base, 6), (base + tok.encode(" and more"), 8)]
        want = [off.generate(ids, n, ignore_eos=True)["ids"] for ids, n in jobs]
        done, got = th.Semaphore(0), [None] * len(jobs)

        def emit(i):
            def f(ev):
                if "finish" in ev:
                    got[i] = ev
                    done.release()
            return f
        reqs = [Request(list(ids), n, emit(i), ignore_eos=True) for i, (ids, n) in enumerate(jobs)]
        on.submit_many(reqs)
        for _ in jobs:
            done.acquire()
        assert [r.new for r in reqs] == want
        g = on.reuse_grid  # copies at 16, 32 and the first prompt's end, 40
        held = lambda n: max(p for p in (0, 16, 32, 40) if p <= n // g * g)  # noqa: E731
        assert [x["cached_tokens"] for x in got] == [0, held(39), held(40)] and on.stats["max_batch"] >= 2
    finally:
        on.close()
        off.close()


def test_chat_continues_the_state_or_starts_over(tmp_path):
    """Chat keeps the history's state: a next turn whose prompt extends all of it prefills only the
    new tokens, and answers as a cold prompt of the whole conversation does; a history the state
    cannot continue (a prefix of it: the state holds all of it) starts from position 0."""
    from helpers import CHATML
    from sparkq.runtime.chat import ChatSession
    from sparkq.runtime.lite import load as load_lite
    src = make_hybrid(tmp_path / "src", "qwen3_5")
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "chat_template": CHATML}))
    out = tmp_path / "art"
    convert(str(src), str(out), Options(progress=False, method="minmax"))
    m = load_lite(str(out), max_model_len=256)
    assert m.resumable(10, 10) == 10 and m.resumable(9, 10) == 0
    # the generator continues a state: a prompt prefilled, then extended, gives the bits of the
    # whole prompt prefilled at once (the prompt path's arithmetic does not depend on the split)
    a, b = m.tokenizer.encode("a turn"), m.tokenizer.encode(" and on")  # (shorter than any W4A16 GEMM's rows)
    m.prefill(a)
    cont = m.prefill_from(a + b, len(a)).copy()
    cold = load_lite(str(out), max_model_len=256)
    assert np.array_equal(cont, cold.prefill(a + b))
    chat = ChatSession(m)
    "".join(chat.turn("hello there", max_new_tokens=6))
    held = len(chat.cached)
    "".join(chat.turn("and again", max_new_tokens=6))
    # all of the history's state, or (where the answer does not re-encode to the same tokens) none
    assert chat.last["prefilled"] in (chat.last["prompt_tokens"] - held, chat.last["prompt_tokens"])
    chat.messages[0]["content"] = "hello there!"  # the history rewritten after its first tokens
    "".join(chat.turn("once more", max_new_tokens=4))
    assert chat.last["prefilled"] == chat.last["prompt_tokens"]  # the state cannot be cut back: all of it
    assert load(str(src), max_model_len=64).resumable(9, 10) == 0  # the torch runtime alike


def test_cli_generate_memory_and_an_openai_client_on_serve(hybrid):
    """The commands a user runs, on a hybrid artifact: generate, memory (the state as its own
    category), and the server through the openai client (n choices of one prompt)."""
    from helpers import run_cli
    _, out, _, _, _ = hybrid("olmo_hybrid")
    p = run_cli("sparkq", "generate", out, "Hello", "--max-new-tokens", "6", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["stats"]["new_tokens"] >= 1
    p = run_cli("sparkq", "memory", out, "--json", "--max-model-len", "64")
    assert p.returncode == 0, p.stderr
    cats = json.loads(p.stdout)["ledger"]["categories"]
    spec = Artifact.open(out).spec
    from sparkq.formats.mixers import state_bytes
    assert cats["recurrent state"]["bytes"] == state_bytes(spec)
    from openai import OpenAI
    from test_serve import _server
    from sparkq.runtime.lite import load as load_lite
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.serve.server import App
    e = Engine(load_lite(str(out), max_model_len=128, kv_budget_mib=8, slots=2), prefill_slice=16)
    try:
        with _server(App(e, "hybrid")) as url:
            c = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            r = c.completions.create(model="hybrid", prompt="Once upon a time, in a lighthouse", max_tokens=8, n=2)
            ref = e.generate(e.tok.encode("Once upon a time, in a lighthouse"), 8)
            assert [ch.text for ch in r.choices] == [ref["text"]] * 2
    finally:
        e.close()
