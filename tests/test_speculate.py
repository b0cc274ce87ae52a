"""Speculative decoding (runtime/speculate.py): drafted tokens checked in one pass change no token.
Greedy and seeded sampled outputs identical to decoding without a draft, on every build, dense and
hybrid, with each drafter (n-gram lookup, a draft model, one always right, one always wrong); the
acceptance rule against its definition; a rejected draft leaves the KV cache and the recurrent state
as single steps leave them; the server's batched steps with drafts give each request its bits alone;
the CLI's flags and refusals."""
import contextlib
import json

import numpy as np
import pytest

from helpers import generate_at_once, kernel_builds, make_hybrid, make_llama, run_cli
from sparkq.convert.pipeline import Options, convert
from sparkq.runtime.sampling import Sampler, SamplingParams
from sparkq.runtime.speculate import DraftLength, NgramDrafter

GREEDY, SAMPLED = SamplingParams(), SamplingParams(0.9, 0.95, top_k=40, seed=7)


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """tiny dense and hybrid int4 artifacts with the same byte tokenizer, and a second dense one
    (another checkpoint: a draft model that is often wrong)"""
    d = tmp_path_factory.mktemp("spec")
    out = {}
    for name, src in (("dense", make_llama(d / "dense", layers=3)), ("hybrid", make_hybrid(d / "hybrid", "qwen3_5")),
                      ("other", make_llama(d / "other", layers=2, seed=5))):
        convert(str(src), str(d / f"{name}-q"), Options(progress=False, method="minmax"))
        out[name] = d / f"{name}-q"
    return out


PROMPT = [ord(c) for c in "abcabcabd hello hello world, hello hello there; abcabc"]


class Oracle:
    """A drafter that knows the answer (``shift`` 0: always right) or is always wrong (``shift`` 1:
    each proposed token one past the right one)."""

    def __init__(self, full: list[int], shift: int, vocab: int):
        self.full, self.shift, self.vocab = full, shift, vocab

    def warm(self, key, ids):
        pass

    def propose_many(self, asks):
        out = []
        for _, ids, k in asks:
            assert ids == self.full[:len(ids)], "the drafter saw a context that is not the output"
            out.append([(t + self.shift) % self.vocab for t in self.full[len(ids):len(ids) + k]])
        return out


class Answers(Oracle):
    """an always-right drafter for several sequences (the answers they will get)"""

    def __init__(self, fulls):
        self.fulls = fulls

    def propose_many(self, asks):
        out = []
        for _, ids, k in asks:
            (full,) = [f for f in self.fulls if f[:len(ids)] == ids]
            out.append(full[len(ids):len(ids) + k])
        return out


def _drafters(arts, which, ref_full, gen):
    from sparkq.runtime.speculate import drafter
    vocab = gen.spec.vocab if hasattr(gen, "spec") else gen.model.spec.vocab
    me = drafter(str(arts[which]), gen)
    me.cost = 0.0  # (drafting for itself costs a step a token: priced free here, so it drafts all along)
    return {"ngram": NgramDrafter(), "right": Oracle(ref_full, 0, vocab), "wrong": Oracle(ref_full, 1, vocab),
            "model": drafter(str(arts["other" if which == "dense" else "dense"]), gen),
            "hybrid-model": drafter(str(arts["hybrid"]), gen), "self": me}


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_greedy_and_seeded_outputs_are_the_plain_ones(kernel_build, which, arts):
    from sparkq.runtime.lite import load
    m = load(str(arts[which]), max_model_len=256)
    for sampling in (GREEDY, SAMPLED):
        ref = list(m.stream_ids(PROMPT, 80, sampling=sampling, stop_ids=()))
        for name, d in _drafters(arts, which, PROMPT + ref, m).items():
            got = list(m.stream_ids(PROMPT, 80, sampling=sampling, stop_ids=(), draft=d, draft_tokens=6))
            assert got == ref, (which, name, sampling.temperature)
            st = m.last_stats
            if name == "right":  # every draft accepted: fewer passes than tokens
                assert st.accepted == st.drafted > 0 and st.passes < len(ref) // 3, st
            if name == "wrong":  # nothing accepted; the drafts pause after misses
                assert st.accepted == 0 and 0 < st.drafted < len(ref), st
            if name == "self" and sampling is GREEDY:  # the model drafting for itself: its draft slot (catch-ups,
                # a hybrid's state copies) follows the answer, so it agrees (up to the prompt path's rounding)
                assert st.drafted > 0 and st.accepted >= 0.9 * st.drafted, st


def test_the_torch_runtime_and_the_python_api(arts):
    from sparkq.runtime import load
    for which in ("dense", "hybrid"):
        m = load(str(arts[which]), max_model_len=256)
        ref = list(m.stream_ids(PROMPT, 60, stop_ids=()))
        right = Oracle(PROMPT + ref, 0, m.model.spec.vocab)
        for d in (NgramDrafter(), right, Oracle(PROMPT + ref, 1, m.model.spec.vocab)):
            assert list(m.stream_ids(PROMPT, 60, stop_ids=(), draft=d)) == ref, which
        r = m.generate("hello hello hello", max_new_tokens=30, draft="ngram")
        assert r["token_ids"] == m.generate("hello hello hello", max_new_tokens=30)["token_ids"]
        assert {"drafted", "accepted", "passes"} <= set(r["stats"])
    # the torch reference on a bf16 checkpoint (no C core: one decode step per drafted row)
    m = load(str(arts["hybrid"].parent / "hybrid"), max_model_len=128)
    ref = list(m.stream_ids(PROMPT, 30, stop_ids=()))
    assert list(m.stream_ids(PROMPT, 30, stop_ids=(), draft=Oracle(PROMPT + ref, 0, 320))) == ref
    assert list(m.stream_ids(PROMPT, 30, stop_ids=(), draft=Oracle(PROMPT + ref, 1, 320))) == ref


def test_a_rejected_draft_leaves_the_cache_and_state_as_single_steps_do(arts):
    """verify 6 rows then keep 2: the recurrent states and the KV rows of the kept positions are the
    bits two single steps leave, and the next step's logits are the single step's"""
    from sparkq.runtime.lite import load
    for which in ("dense", "hybrid"):
        a, b = (load(str(arts[which]), max_model_len=64) for _ in range(2))
        for m in (a, b):
            m.prefill(PROMPT[:20])
        rows = a.verify([5, 6, 7, 8, 9, 10], 20)
        a.keep(2)
        single = [b.step(t, 20 + j).copy() for j, t in enumerate([5, 6])]
        assert np.array_equal(rows[:2], np.stack(single))
        for x, y in zip(a.state_buffers(), b.state_buffers()):
            assert np.array_equal(x, y), which
        assert np.array_equal(a.k[:, :, :, :22], b.k[:, :, :, :22]) and np.array_equal(a.v[:, :, :, :22], b.v[:, :, :, :22])
        assert np.array_equal(a.step(77, 22), b.step(77, 22)), which


def test_the_acceptance_rule_is_the_standard_one():
    """A drafted token d (q one-hot at d) is accepted when the token picked from p equals it: with
    probability min(1, p(d)/q(d)) = p(d); otherwise the token follows normalized max(0, p - q) = p
    without d. Counted over 20000 draws of the sampler's per-position streams."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(p).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, seed=11))
    picks = np.array([s(logits) for _ in range(20000)])
    for d in range(4):
        acc = np.mean(picks == d)
        assert abs(acc - p[d]) < 0.015, (d, acc)
        rest = picks[picks != d]
        resid = np.maximum(p - np.eye(4)[d], 0)
        resid /= resid.sum()
        emp = np.bincount(rest, minlength=4) / rest.size
        assert np.abs(emp - resid).max() < 0.02, (d, emp, resid)
    # the token at a position is that position's draw: how many draws came before does not matter
    a, b = Sampler(SamplingParams(0.7, seed=3)), Sampler(SamplingParams(0.7, seed=3))
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]


def test_ngram_lookup_and_the_draft_length():
    d = NgramDrafter()
    ids = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert d.propose(0, ids, 3) == [4, 5, 9]  # the 3-gram 1 2 3 occurred before: what followed it
    assert d.propose(0, ids + [4], 2) == [5, 9]  # the index grows with the sequence
    assert d.propose(0, [7, 8, 6], 4) == []  # another sequence under the key: re-indexed, no match
    assert d.propose(1, [1, 2, 1, 2], 4) == [1, 2]  # the latest occurrence
    c = DraftLength(kmax=8)
    k0 = c.next(100)
    assert 1 <= k0 <= 8 and c.next(2) <= 2  # never past the room
    for _ in range(6):  # every draft accepted: the longest drafts
        c.observe(8, 8)
    assert c.next(100) == 8
    for _ in range(15):  # half the drafted tokens accepted: short drafts
        c.observe(2, 1)
    assert 1 <= c.next(100) <= 2
    for _ in range(15):  # nothing accepted: no drafts, a probe after a pause that doubles
        c.observe(1, 0)
    assert c.next(100) == 0 and c.wait == 2
    assert [c.next(100) for _ in range(2)] == [0, 2]  # the pause, then its probe
    c.observe(2, 0)
    assert c.next(100) == 0 and c.wait == 4
    costly = DraftLength(kmax=8, draft_cost=0.6)  # a draft model as costly as 0.6 target steps a token
    for _ in range(6):
        costly.observe(4, 2)
    assert costly.next(100) == 0  # a = 2/3: no draft length pays for itself
    assert DraftLength(kmax=8, draft_cost=0.1, hits=9, trials=10).next(100) >= 3
    # in a batch of 4 sequences a drafted row costs what it buys less often: shorter drafts, none sooner
    assert 0 < DraftLength(kmax=8, hits=9, trials=10).best(4) < DraftLength(kmax=8, hits=9, trials=10).best(1)
    assert DraftLength(kmax=8, hits=5, trials=10).best(1) > 0 == DraftLength(kmax=8, hits=5, trials=10).best(4)
    # a draft model whose probes keep failing stops drafting (its catch-ups cost prompt passes)
    g = DraftLength(kmax=8, draft_cost=0.6, give_up=2)
    drafts = 0
    for _ in range(700):
        k = g.next(100)
        if k:
            drafts += 1
            g.observe(k, 0)
    assert drafts == 2 and g.next(100) == 0


def test_the_server_gives_each_request_its_bits_alone(arts):
    """An engine with a drafter (n-gram; a draft model with a slot per sequence) runs 4 requests at
    once, greedy and seeded, with stop strings: each gets the tokens it gets alone without a draft."""
    from sparkq.runtime.lite import load
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.speculate import drafter
    ids = [[ord(c) for c in t] for t in ("abcabcabc abc", "hello hello hello", "xyz xyz xy", "the the the")]
    kws = [{}, {"temperature": 0.8, "seed": 4}, {"stop": ["lo h"]}, {"temperature": 0.5, "seed": 1}]
    plain = Engine(load(str(arts["hybrid"]), max_model_len=128, kv_budget_mib=8, slots=1))
    ref = [plain.generate(i, 40, **kw) for i, kw in zip(ids, kws)]
    plain.close()
    for spec in ("ngram", str(arts["dense"]), str(arts["hybrid"]), "right"):
        m = load(str(arts["hybrid"]), max_model_len=128, kv_budget_mib=8, slots=4)
        d = Answers([i + r["ids"] for i, r in zip(ids, ref)]) if spec == "right" else drafter(spec, m, slots=4)
        if spec == str(arts["hybrid"]):  # the model drafting for itself, priced free: a hybrid draft's
            d.cost, d.give_up = 0.0, 0  # state copies in 4 slots at once, drafting all along
        e = Engine(m, draft=d, draft_tokens=5)
        got, load_ = generate_at_once(e, ids, 40, kws)
        for a, b in zip(got, ref):
            assert (a["ids"], a["text"], a["finish"]) == (b["ids"], b["text"], b["finish"]), spec
        assert load_["max_batch"] > 1, load_
        if spec == "right":  # drafts that are right pay even in a batch of 4: drafted, all accepted
            assert load_["accepted"] == load_["drafted"] > 0, load_
        if spec == str(arts["hybrid"]):
            assert load_["accepted"] >= 0.7 * load_["drafted"] > 0, load_  # (two of the four sample: a greedy draft misses more)


def test_cli_generate_and_refusals(arts, tmp_path):
    r = run_cli("sparkq", "generate", str(arts["dense"]), "hello hello hello hello", "--max-new-tokens", "24", "--json")
    plain = json.loads(r.stdout)
    for d in ("ngram", str(arts["other"])):
        r = run_cli("sparkq", "generate", str(arts["dense"]), "hello hello hello hello", "--max-new-tokens", "24", "--json",
                    "--draft", d, "--draft-tokens", "4")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["token_ids"] == plain["token_ids"] and out["stats"]["passes"] > 0
    r = run_cli("sparkq", "generate", str(arts["dense"]), "hello hello hello hello", "--draft", "ngram", "--max-new-tokens", "24")
    assert r.returncode == 0 and "decode 24 tok" in r.stderr, r.stderr
    src = make_llama(tmp_path / "v")  # the same shape, two tokens' ids swapped: another vocabulary
    cfg = json.loads((src / "tokenizer.json").read_text())
    v = cfg["model"]["vocab"]
    v["a"], v["b"] = v["b"], v["a"]
    (src / "tokenizer.json").write_text(json.dumps(cfg))
    convert(str(src), str(tmp_path / "v-q"), Options(progress=False, method="minmax"))
    for args, words in (((str(tmp_path / "v-q"),), "vocabulary differs"), ((str(tmp_path),), "not a sparkq artifact"),
                        (("ngram", "--draft-tokens", "0"), "--draft-tokens must be in 1..32")):
        r = run_cli("sparkq", "generate", str(arts["dense"]), "hi", "--draft", *args)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_structured_output_and_stop_strings_through_drafts(example_art):
    """The example through the `openai` client: JSON-schema output (the grammar's mask on every drafted
    row) and stop strings, greedy and seeded, with the n-gram drafter on: the replies without it."""
    from openai import OpenAI

    from sparkq.runtime.speculate import NgramDrafter
    from test_structured import _serving

    @contextlib.contextmanager
    def serving(draft):
        with _serving(example_art, slots=2, max_model_len=512, draft=draft) as (url, e):
            yield OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), e

    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 4}}, "required": ["names"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    asks = [dict(messages=[{"role": "user", "content": "List the names Anna, Anna, Bob and Anna as JSON."}],
                 response_format=rf, max_tokens=80),
            dict(messages=[{"role": "user", "content": "Count: one, two, three, four, five, six, seven"}],
                 stop=["six"], max_tokens=60, temperature=0.7, seed=2),
            dict(messages=[{"role": "user", "content": "Repeat: the cat sat on the mat, the cat sat on the mat"}],
                 max_tokens=60)]
    out = {}
    for draft in (None, NgramDrafter()):
        with serving(draft) as (c, e):
            out[draft is None] = [(r.choices[0].message.content, r.choices[0].finish_reason) for r in
                                  (c.chat.completions.create(model="ex", **a) for a in asks)]
            if draft is not None:
                assert e.load()["accepted"] > 0
    assert out[True] == out[False]
    json.loads(out[False][0][0])


def test_chat_turns_with_a_draft(arts):
    """chat keeps its history in the cache (a hybrid's state where it stands) with drafts on: each
    turn's answer is the one without them"""
    from sparkq.runtime.chat import ChatSession
    from sparkq.runtime.lite import load
    for which in ("dense", "hybrid"):
        m = load(str(arts[which]), max_model_len=512)
        m.tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
        answers = {}
        for draft in (None, "ngram", str(arts["dense"])):
            kw = {"draft": draft, "draft_tokens": 5} if draft else {}
            chat = ChatSession(m, **kw)
            answers[draft] = ["".join(chat.turn(t, max_new_tokens=40)) for t in ("abc abc abc", "hello hello", "abc")]
        assert answers[None] == answers["ngram"] == answers[str(arts["dense"])], which


def test_cli_serve_with_a_draft_model(arts):
    """`sparkq serve --draft DRAFT_ART`: an OpenAI completion is the engine's answer without drafts,
    /health counts the drafts; a draft the server cannot use is one line, exit 2"""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    from openai import OpenAI

    from sparkq.runtime.lite import load
    from sparkq.runtime.serve.engine import Engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "sparkq"
    bad = subprocess.run([str(exe), "serve", str(arts["dense"]), "--port", str(port), "--draft", str(arts["dense"].parent)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a sparkq artifact" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    p = subprocess.Popen([str(exe), "serve", str(arts["dense"]), "--port", str(port), "--parallel", "2", "--threads", "2",
                          "--kv-budget-mib", "8", "--model-name", "d", "--draft", str(arts["other"]), "--draft-tokens", "4"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for _ in range(600):
            try:
                c.models.list()
                break
            except Exception:  # noqa: BLE001 (still loading)
                assert p.poll() is None, p.stderr.read()
                time.sleep(0.2)
        got = c.completions.create(model="d", prompt="hello hello hello", max_tokens=30, temperature=0)
        health = json.loads(__import__("urllib.request").request.urlopen(f"http://127.0.0.1:{port}/health").read())
    finally:
        p.terminate()
        p.wait(30)
    e = Engine(load(str(arts["dense"]), kv_budget_mib=8, slots=1))
    ref = e.generate(e.tok.encode("hello hello hello"), 30)
    e.close()
    assert got.choices[0].text == ref["text"] and "drafted" in health and "accepted" in health, health


def test_a_hybrid_draft_model_rewinds_its_own_state(arts):
    """A hybrid draft drafts 6 tokens (its state runs through 5 of them), the model keeps 2 and picks
    another: the draft's next pass restores its state copy and takes the kept tokens, leaving the
    bits a fresh draft fed the same tokens the same way holds"""
    from sparkq.runtime.lite import load
    from sparkq.runtime.speculate import drafter
    target = load(str(arts["hybrid"]), max_model_len=128)
    d = drafter(str(arts["hybrid"]), target)
    ctx = PROMPT[:30]
    d.warm(0, ctx[:-1])
    out = d.propose_many([(0, ctx, 6)])[0]
    new = ctx + out[:2] + [(out[2] + 1) % 256]
    d.propose_many([(0, new, 1)])
    fresh = load(str(arts["hybrid"]), max_model_len=128)
    fresh.session.prefill(ctx[:-1], 0)
    fresh.session.step_many([ctx[-1]], [29], [0])
    fresh.session.step_many(new[30:], [30, 31, 32], [0, 0, 0])
    for a, b in zip(d.m.state_buffers(), fresh.state_buffers()):
        assert np.array_equal(a, b)
