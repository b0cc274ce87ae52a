"""`sparkq serve` (runtime/serve/server.py) over continuous batching (runtime/serve/engine.py, csrc/batch.c):
the batched decode step against single steps, batch invariance (a request's tokens alone = beside
others), the OpenAI API through the real `openai` client and raw HTTP for malformed requests,
disconnects freeing slots, and the CLI server under a mixed load (RSS, no torch)."""
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import kernel_builds, make_chat_llama, make_llama
from sparkq.convert.pipeline import Options, convert

@pytest.fixture(scope="module")
def serve_art(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    src = make_chat_llama(d / "m", layers=2, seed=5)
    (src / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 256}))
    out = d / "art"
    convert(str(src), str(out), Options(progress=False, method="minmax"))
    return out


def _lite(art, slots, **kw):
    from sparkq.runtime.lite import load
    return load(str(art), max_model_len=kw.pop("max_model_len", 256), kv_budget_mib=kw.pop("kv_budget_mib", 8),
                threads=2, slots=slots, **kw)


@pytest.fixture(scope="module")
def variants(serve_art, tmp_path_factory):
    """the same checkpoint with other products: lut4 g32 body + int8 head, int4 g64 + split head;
    a qwen2 checkpoint (a qkv bias); one layer with a 4096-wide MLP, int4 g128 and lut4 g256"""
    src, d = serve_art.parent / "m", tmp_path_factory.mktemp("variants")
    out = {"default": serve_art}
    for name, o in {"lut4-g32-int8head": Options(progress=False, method="minmax", kind="lut4", group_size=32, head="int8"),
                    "int4-g64-split": Options(progress=False, method="minmax", kind="int4", group_size=64, head="split")}.items():
        convert(str(src), str(d / name), o)
        out[name] = d / name
    # down over 4096 columns: three or four tokens' activations past the AVX512 products' L1 span
    wide = make_llama(d / "widesrc", inter=4096, layers=1, seed=7)
    convert(str(wide), str(d / "wide-mlp"), Options(progress=False, method="minmax", kind="int4", group_size=128))
    convert(str(wide), str(d / "wide-mlp-lut4"), Options(progress=False, method="minmax", kind="lut4", group_size=256))
    out["wide-mlp"], out["wide-mlp-lut4"] = d / "wide-mlp", d / "wide-mlp-lut4"
    q2 = make_llama(d / "q2src", arch="qwen2", layers=2, seed=6)  # a qkv bias
    convert(str(q2), str(d / "qwen2-bias"), Options(progress=False, method="minmax"))
    out["qwen2-bias"] = d / "qwen2-bias"
    return out


PROMPTS = ["hello there", "the quick brown fox jumps over the lazy dog " * 2, "a", "0123456789" * 9, "zz top"]


@pytest.mark.parametrize("variant", ["default", "default@bf16", "lut4-g32-int8head", "int4-g64-split", "qwen2-bias",
                                     "wide-mlp", "wide-mlp-lut4"])
@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_step_many_is_the_decode_step_bit_for_bit_in_any_company(variants, variant, kernel_build):
    """The batched decode step's rows are the single-sequence step's logits exactly (the same
    products per token, each sequence's attention over its own slot), alone, paired or reordered;
    with the default int8 KV cache and (@bf16) the bf16 one."""
    name, _, kv = variant.partition("@")
    serve_art, kw = variants[name], {"kv_dtype": kv} if kv else {}
    batch, single = _lite(serve_art, 3, **kw), _lite(serve_art, 1, **kw)
    s, tok = batch.session, batch.tokenizer
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    offs = [i * batch.slot_elems for i in range(3)]
    for i, p in enumerate(ids):
        s.prefill(p, 0, kvoff=offs[i])
    nxt = [int(np.argmax(single.prefill(p))) for p in ids]
    pos = [len(p) for p in ids]
    logits = s.step_many(nxt, pos, offs)
    for i, p in enumerate(ids):
        single.prefill(p)
        assert np.array_equal(logits[i], single.step(nxt[i], pos[i])), i
        assert np.array_equal(s.head_many(single.session.prefill(p + [nxt[i]]))[0], single.prefill(p + [nxt[i]])), i
    for sub in ([0], [2], [2, 0], [1, 2]):  # (each step rewrites the same K/V at pos[i])
        assert np.array_equal(s.step_many([nxt[i] for i in sub], [pos[i] for i in sub], [offs[i] for i in sub]),
                              logits[sub]), sub
    # five sequences: a full group of four tokens and one more (the AVX2 products' token tiles)
    five = _lite(serve_art, 5, **kw)
    offs5 = [i * five.slot_elems for i in range(5)]
    ids5 = [tok.encode(p) for p in PROMPTS]
    for i, p in enumerate(ids5):
        five.session.prefill(p, 0, kvoff=offs5[i])
    got = five.session.step_many([7] * 5, [len(p) for p in ids5], offs5)
    for i, p in enumerate(ids5):
        single.prefill(p)
        assert np.array_equal(got[i], single.step(7, len(p))), i
    with pytest.raises(Exception, match="beyond the KV cache"):
        s.step_many([1], [batch.cap], [0])


@pytest.mark.parametrize("kv", ["int8", "bf16"])
@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_step_many_over_contexts_of_several_attention_blocks(serve_art, kv, kernel_build):
    """Sequences whose contexts span 1 and 2 of the decode attention's 256-key blocks (split over
    the threads, reduced per sequence) in one batched step: each row still sq_step's bits (more
    blocks: test_kvcache's long contexts)."""
    batch, single = (_lite(serve_art, n, max_model_len=510, kv_budget_mib=16, kv_dtype=kv) for n in (3, 1))
    rng = np.random.default_rng(0)
    lens = [5, 300, 500]
    ids = [rng.integers(0, 256, n).tolist() for n in lens]
    offs = [i * batch.slot_elems for i in range(3)]
    for i, p in enumerate(ids):
        batch.session.prefill(p, 0, kvoff=offs[i])
    got = batch.session.step_many([9, 9, 9], lens, offs)
    for i, p in enumerate(ids):
        single.prefill(p)
        assert np.array_equal(got[i], single.step(9, lens[i])), i


def _engine(art, slots=4, **kw):
    from sparkq.runtime.serve.engine import Engine
    return Engine(_lite(art, slots), **kw)


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_batch_invariance_a_request_decodes_the_same_alone_or_beside_others(serve_art, kernel_build):
    e = _engine(serve_art, slots=4, prefill_slice=16)  # prompts of 1-90 tokens: prefills in slices between steps
    try:
        tok = e.tok
        reqs = [(tok.encode(p), {}) for p in PROMPTS] + [(tok.encode("sampled"), {"temperature": 0.9, "seed": 7})]
        alone = [e.generate(ids, 24, ignore_eos=True, **kw) for ids, kw in reqs]
        assert e.stats["max_batch"] == 1
        from sparkq.runtime.serve.engine import Request
        done = [threading.Event() for _ in reqs]
        finish = [None] * len(reqs)

        def emit(ev, i):
            if "finish" in ev:
                finish[i] = ev["finish"]
                done[i].set()

        subs = []
        # every request queued before the engine's next look (its lock is re-entrant: submit takes it
        # too): threads submitting one by one let a 24-token request finish before the last arrived
        with e.cv:
            for i, (ids, kw) in enumerate(reqs):
                subs.append(e.submit(Request(list(ids), 24, lambda ev, i=i: emit(ev, i),
                                             ignore_eos=True, **kw)))
        for d in done:
            assert d.wait(120)
        out = [{"ids": list(r.new), "finish": f} for r, f in zip(subs, finish)]
        assert e.stats["max_batch"] == 4  # 6 requests over 4 slots: they did run together
        for a, b in zip(alone, out):
            assert a["ids"] == b["ids"] and len(a["ids"]) == 24 and a["finish"] == b["finish"] == "length"
    finally:
        e.close()


@pytest.mark.parametrize("kv", ["int8", "bf16"])
@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_a_prompt_continued_from_a_kept_prefix_is_the_same_bits(serve_art, kv, kernel_build):
    """The prefix cache's premise on the torch-free runtime: a prompt prefilled whole, or as a
    prefix and then the rest from any position (in the server's 64-token slices), leaves the same
    hidden states, bit for bit, with either cache; where the prompt GEMM depends on the slice
    length (AVX512-BF16) only at whole slices, which is all the engine reuses there."""
    m = _lite(serve_art, 2, kv_dtype=kv)
    s = m.session
    ids = m.tokenizer.encode(PROMPTS[3] * 2)[:150]
    whole = s.prefill(ids, 0, kvoff=0, chunk=64, last_only=False)
    grid = 64 if s.lib.sq_prefill_bf16() else 1
    cuts = sorted({c // grid * grid for c in (1, 7, 33, 64, 100, 128, 149)} - {0})
    assert cuts
    for cut in cuts:
        s.prefill(ids[:cut], 0, kvoff=m.slot_elems, chunk=64)
        rest = s.prefill(ids[cut:], cut, kvoff=m.slot_elems, chunk=64, last_only=False)
        assert np.array_equal(rest, whole[cut:]), cut


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_prefix_cache_reuses_prompt_positions_and_changes_no_answer(serve_art, kernel_build):
    """A repeated prompt, one that extends it, an unrelated one, a seeded sample and a shorter
    prefix through an engine with the prefix cache and one without: the same tokens; the reused
    counts are what the slots' kept prompts allow (never the decoded positions, never the prompt's
    last token), a newcomer with nothing to reuse takes the least recently used slot."""
    on = _engine(serve_art, slots=2, prefill_slice=16)
    off = _engine(serve_art, slots=2, prefill_slice=16, prefix_cache=False)
    try:
        tok = on.tok
        base = tok.encode(PROMPTS[3])  # 90 tokens
        more = base + tok.encode(" and then")
        answer = off.generate(base, 12, ignore_eos=True)["ids"]
        # a client resending the conversation: the prompt, its answer (decoded, not kept), a new turn
        follow = base + answer + tok.encode(" ok")
        seq = [(base, {}), (base, {}), (follow, {}), (more, {}), (tok.encode("zz top"), {}),
               (base, {"temperature": 0.9, "seed": 3}), (base[:50], {}), (tok.encode("zz top and"), {})]
        a = [on.generate(ids, 12, ignore_eos=True, **kw) for ids, kw in seq]
        b = [off.generate(ids, 12, ignore_eos=True, **kw) for ids, kw in seq]
        assert [x["ids"] for x in a] == [x["ids"] for x in b] and all(len(x["ids"]) == 12 for x in a)
        assert a[0]["ids"] == answer
        g = on.reuse_grid
        assert g == (16 if on.session.lib.sq_prefill_bf16() else 1)
        snap = lambda n: n // g * g  # noqa: E731
        # 1: nothing kept; 2: all but the last token; 3: the kept prompt, not the answer the decode
        # steps wrote after it; 4: the 90 of base (the slot now keeps `follow`); 5: nothing in
        # common, so the other (least recently used) slot; 6: slot 1 kept `more`; 7: 49 of its 50;
        # 8: "zz top" from slot 2 (slot 1 holds base[:50])
        want = [0, snap(89), snap(90), snap(90), 0, snap(89), snap(49), snap(len(tok.encode("zz top")))]
        assert [x["cached_tokens"] for x in a] == want
        assert [x["cached_tokens"] for x in b] == [0] * len(seq) and off.stats["cached"] == 0
        total = sum(len(ids) for ids, _ in seq)
        assert on.stats["cached"] == sum(want) and on.stats["prefilled"] == total - sum(want)
        assert off.stats["prefilled"] == total + len(base)
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("kv", ["int8", "bf16"])
@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_a_prompt_running_in_another_slot_is_copied_not_prefilled(serve_art, kv, kernel_build):
    """Two requests of one prompt admitted together (n choices; a shared system prompt): the second
    copies the first's prompt-path positions into its slot when its prompt starts (prefix.py) and
    prefills only the rest; every answer is the bits an engine without the prefix cache gives."""
    import threading as th

    from sparkq.runtime.serve.engine import Engine
    on = Engine(_lite(serve_art, 3, kv_dtype=kv), prefill_slice=16)
    off = Engine(_lite(serve_art, 3, kv_dtype=kv), prefill_slice=16, prefix_cache=False)
    try:
        tok = on.tok
        base = tok.encode(PROMPTS[3])  # 90 tokens
        jobs = [(base, 12), (base, 6), (base + tok.encode(" and more"), 8)]
        want = [off.generate(ids, n, ignore_eos=True)["ids"] for ids, n in jobs]
        from sparkq.runtime.serve.engine import Request
        done, out = th.Semaphore(0), [None] * len(jobs)

        def emit(i):
            def f(ev):
                if "finish" in ev:
                    out[i] = ev
                    done.release()
            return f
        reqs = [Request(list(ids), n, emit(i), ignore_eos=True) for i, (ids, n) in enumerate(jobs)]
        on.submit_many(reqs)  # admitted together: nothing kept yet, so the copies happen at prefill
        for _ in jobs:
            done.acquire()
        assert [r.new for r in reqs] == want
        g = on.reuse_grid
        shared = 89 // g * g  # all of base but the last token (whole slices where the GEMM needs them)
        assert [o["cached_tokens"] for o in out] == [0, shared, 90 // g * g]
        assert on.stats["prefilled"] == sum(len(ids) for ids, _ in jobs) - on.stats["cached"]
        assert on.stats["cached"] == shared + 90 // g * g
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_echo_prompt_logprobs_on_every_build(serve_art, kernel_build):
    """The engine's echo path on each C-core build: the prompt's logprobs are log-softmax of the head
    over sq_prefill's every-position states in the engine's slices (whose products depend on the
    build), and the completion is the bits of the same request without echo."""
    import threading as th

    from sparkq.runtime.sampling import logprobs as log_softmax
    from sparkq.runtime.serve.engine import Request

    e = _engine(serve_art, slots=1, prefill_slice=16)
    try:
        ids = e.tok.encode(PROMPTS[3])[:40]
        single = _lite(serve_art, 1)
        rows = np.concatenate([single.session.head_many(single.session.prefill(ids[a:a + 16], a, last_only=False,
                                                                               chunk=16)) for a in range(0, 40, 16)])
        got, done = [], th.Event()
        r = Request(list(ids), 5, lambda ev: got.append(ev) or ("finish" in ev and done.set()), ignore_eos=True,
                    echo_logprobs=1)
        e.submit(r)
        assert done.wait(60)
        plp = [ev["prompt_logprob"] for ev in got if "prompt_logprob" in ev]
        assert [p["id"] for p in plp] == ids and plp[0]["logprob"] is None
        assert np.allclose([p["logprob"] for p in plp[1:]], [log_softmax(rows[i])[ids[i + 1]] for i in range(39)],
                           atol=1e-5)
        assert [p["top"][0][0] for p in plp[1:]] == [int(np.argmax(rows[i])) for i in range(39)]
        assert r.new == e.generate(ids, 5, ignore_eos=True)["ids"]
    finally:
        e.close()


def test_batch_invariance_on_the_example(example_art):
    """Real text: greedy answers of the example alone and four at a time, token for token."""
    from sparkq.runtime.lite import load
    from sparkq.runtime.serve.engine import Engine

    e = Engine(load(str(example_art), threads=2, slots=4, kv_budget_mib=64))
    try:
        ids = [e.tok.encode(p) for p in ("The capital of France is", "Water boils at", "def fibonacci(n):",
                                          "The days of the week are Monday,")]
        alone = [e.generate(i, 16) for i in ids]
        out = [None] * 4
        th = [threading.Thread(target=lambda k=k: out.__setitem__(k, e.generate(ids[k], 16))) for k in range(4)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        assert e.stats["max_batch"] >= 3
        assert [a["ids"] for a in alone] == [b["ids"] for b in out]
        assert "Paris" in alone[0]["text"]
        if not e.model.lib.sq_prefill_bf16():  # (bf16 prompt GEMMs from 32 tokens: slices round differently)
            g = e.model.generate("The capital of France is", max_new_tokens=16)  # the engine is idle: slot 0 is free
            assert g["token_ids"][:len(alone[0]["ids"])] == alone[0]["ids"]  # what `sparkq generate` says
    finally:
        e.close()


# -- the HTTP API, in process (uvicorn on a pre-bound loopback socket) --

@contextlib.contextmanager
def _server(app):
    import uvicorn

    from sparkq.runtime.serve.server import listen_socket

    sock = listen_socket("127.0.0.1", 0)  # as sparkq serve binds it (TCP_NODELAY on its connections)
    srv = uvicorn.Server(uvicorn.Config(app.asgi, log_level="warning", access_log=False))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        th.join(10)
        sock.close()


@pytest.fixture(scope="module")
def api(serve_art):
    from sparkq.runtime.serve.server import App

    e = _engine(serve_art, slots=2, max_queue=1)
    app = App(e, "tiny")
    with _server(app) as url:
        yield url, e
    e.close()


def _client(url, key="unused"):
    from openai import OpenAI
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_chat_and_completions_stream_and_not(api):
    url, e = api
    c = _client(url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ref = e.generate(e.tok.encode_chat(msgs), 12)  # the engine's own answer (greedy: generation_config)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12)
    assert r.choices[0].message.content == ref["text"] and r.choices[0].finish_reason == ref["finish"]
    assert r.usage.prompt_tokens == len(e.tok.encode_chat(msgs)) and r.usage.completion_tokens == len(ref["ids"])
    n = r.usage.prompt_tokens  # the same prompt again: the slot kept it (the prefix cache)
    assert r.usage.prompt_tokens_details.cached_tokens == (n - 1) // e.reuse_grid * e.reuse_grid
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=12, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref["text"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [ref["finish"]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["ids"])
    # completions: text and token-id prompts, a stop string cuts the text before it
    ids = e.tok.encode("the quick brown fox")
    ref = e.generate(ids, 16, ignore_eos=True)
    r = c.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=16, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref["text"] and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    r2 = c.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert r2.choices[0].text == ref["text"]
    text = ref["text"]
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[:i + 2]), None)
    if stop is not None:
        cut = text[:text.find(stop)]
        r3 = c.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=16, temperature=0, stop=[stop, "@@"],
                                  extra_body={"ignore_eos": True})
        assert r3.choices[0].text == cut and r3.choices[0].finish_reason == "stop"
        got = "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt="the quick brown fox", max_tokens=16, temperature=0, stop=stop, stream=True,
            extra_body={"ignore_eos": True}))
        assert got == cut
    # seeded sampling: the same seed, the same text
    a = c.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=1.0, seed=3).choices[0].text
    b = c.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=1.0, seed=3).choices[0].text
    assert a == b


def _raw(url, method, path, body=None, headers=None):
    from urllib.parse import urlsplit
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data)


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "'model'"),
    (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "does not exist"),
    (json.dumps({"model": "tiny", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}).encode(), 400, "role"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), 400,
     "only text parts"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 65}).encode(), 400, "'n' must be"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 4}).encode(), 400,
     "asks for 4 sequences"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "metadata": {"a": 1}}).encode(), 400,
     "'metadata' must map strings"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "store": "yes"}).encode(), 400,
     "'store' must be a boolean"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"}).encode(),
     400, "'reasoning_effort' must be one of"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}).encode(),
     400, "no thinking switch"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}).encode(),
     400, "modalities"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prediction": "hi"}).encode(),
     400, "'prediction' must be"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                 "stream_options": {"include_obfuscation": True, "x": 1}}).encode(), 400, "stream_options"),
    (json.dumps({"model": "tiny", "messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}).encode(), 400,
     "refusal is not supported"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}).encode(),
     400, "tools[0] must be"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}).encode(),
     400, "no 'tools'"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}).encode(),
     400, "deprecated"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}).encode(), 400,
     "logprobs"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}).encode(), 400,
     "needs 'logprobs'"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 5}}).encode(),
     400, "outside the vocabulary"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"7": 500}}).encode(),
     400, "[-100, 100]"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_k": -1}).encode(), 400, "top_k"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}).encode(), 400,
     "presence_penalty"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": 3}).encode(),
     400, "chat_template_kwargs"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "mirostat": 2}).encode(), 400,
     "unsupported field 'mirostat'"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}).encode(), 400,
     "temperature"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), 400,
     "max_tokens"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 17}).encode(), 400, "stop"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}).encode(), 400,
     "context of 256 tokens"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "long " * 100}]}).encode(), 400,
     "context is 256 tokens"),
])
def test_malformed_and_unsupported_requests_get_openai_errors(api, body, status, needle):
    url, e = api
    code, j = _raw(url, "POST", "/v1/chat/completions", body)
    assert code == status, j
    assert set(j["error"]) == {"message", "type", "param", "code"} and needle in j["error"]["message"], j


def test_other_routes_prompt_forms_and_the_openai_client_errors(api):
    import openai

    url, e = api
    assert _raw(url, "GET", "/v1/nothing")[0] == 404
    assert _raw(url, "GET", "/v1/chat/completions")[0] == 405
    code, j = _raw(url, "GET", "/health")
    assert code == 200 and j["status"] == "ok" and j["slots"] == 2
    from sparkq.runtime.core import build_name
    assert j["build"] == build_name(e.session.lib)  # the C-core build the engine runs
    code, j = _raw(url, "POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": ["a", [1, 2], 3]}).encode())
    assert code == 400 and "a list of either (a batch)" in j["error"]["message"]
    for body, needle in [({"prompt": "a", "max_tokens": 0}, "'max_tokens' must be an integer >= 1"),
                         ({"prompt": "a", "echo": 1}, "'echo' must be a boolean"),
                         ({"prompt": "a", "n": 2, "best_of": 3}, "best_of > n"),
                         ({"prompt": ["a", "b"], "n": 2}, "asks for 4 sequences")]:
        code, j = _raw(url, "POST", "/v1/completions", json.dumps({"model": "tiny", **body}).encode())
        assert code == 400 and needle in j["error"]["message"], (body, j)
    code, j = _raw(url, "POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": [1, 99999]}).encode())
    assert code == 400 and "token ids" in j["error"]["message"]
    c = _client(url)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="tiny", prompt="x" * 300)


def test_api_key_is_required_when_set(serve_art):
    import openai
    from sparkq.runtime.serve.server import App

    e = _engine(serve_art, slots=1)
    try:
        with _server(App(e, "tiny", api_key="s3cret")) as url:
            with pytest.raises(openai.AuthenticationError):
                _client(url, "wrong").models.list()
            with pytest.raises(openai.AuthenticationError):
                _client(url, "wrong").completions.create(model="tiny", prompt="a", max_tokens=2)
            assert _raw(url, "GET", "/v1/models")[0] == 401  # no header at all
            assert _client(url, "s3cret").completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens >= 1
            assert _raw(url, "GET", "/health")[0] == 200  # liveness stays open
    finally:
        e.close()


def _wait(pred, timeout=20.0):
    t = time.time() + timeout
    while time.time() < t:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_a_disconnect_frees_the_slot_and_a_full_queue_is_429(api):
    from sparkq.runtime.measure.servebench import post

    url, e = api
    body = {"model": "tiny", "prompt": "go", "max_tokens": 200, "ignore_eos": True, "stream": True}
    before = dict(e.stats)
    r = post(url, "/v1/completions", body, stream=True, read_events=3)
    assert r.get("left") and r["status"] == 200
    assert _wait(lambda: e.load()["running"] == 0 and e.stats["cancelled"] == before["cancelled"] + 1)
    assert e.stats["decoded"] - before["decoded"] < 150  # it stopped early, not at 200 tokens

    # two slots busy and one request waiting (max_queue=1): the next one is refused with 429
    results = []
    th = [threading.Thread(target=lambda: results.append(post(url, "/v1/completions", {**body, "stream": False})))
          for _ in range(3)]
    for t in th:
        t.start()
    assert _wait(lambda: e.load()["running"] == 2 and e.load()["waiting"] == 1)
    code, j = _raw(url, "POST", "/v1/completions", json.dumps({**body, "stream": False}).encode())
    assert code == 429 and j["error"]["type"] == "rate_limit_exceeded"
    for t in th:
        t.join()
    assert [x["status"] for x in results] == [200] * 3
    assert all(x["json"]["usage"]["completion_tokens"] == 200 for x in results)

    # a non-streaming client that leaves while waiting for its answer frees its slot too
    u = url.split("//")[1]
    s = socket.create_connection((u.split(":")[0], int(u.split(":")[1])))
    payload = json.dumps({**body, "stream": False}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    assert _wait(lambda: e.load()["running"] == 1)
    n = e.stats["cancelled"]
    s.close()
    assert _wait(lambda: e.load()["running"] == 0 and e.stats["cancelled"] == n + 1)


def test_bench_serve_prompts_per_level_never_meet_the_prefix_cache(api):
    """bench() with prompts per (pass, level), as `sparkq bench-serve --prompt-ids` passes them: the
    same list again is served from the prefix cache (70 tokens: a whole 64-token slice even where
    reuse is cut to slices), fresh ones never are"""
    from sparkq.runtime.measure.servebench import bench

    url, e = api

    def fresh(p, c):
        return [[3 + (7 * p + 31 * c + 13 * i + 5 * k) % 240 for k in range(70)] for i in range(2)]

    assert _wait(lambda: e.load()["running"] == 0)
    c0 = e.stats["cached"]
    r = bench({"tiny": (url, "tiny")}, fresh(9, 9), [1, 2], 3, 2, per_client=1)
    assert len(r["runs"]) == 4 and all(x["errors"] == 0 and x["tokens"] == 3 * x["concurrency"] for x in r["runs"])
    c1 = e.stats["cached"]
    assert c1 >= c0 + 4 * 64  # of the six requests all but the first of each prompt find it in a slot
    r = bench({"tiny": (url, "tiny")}, fresh, [1, 2], 3, 2, per_client=1)
    assert all(x["errors"] == 0 and x["tokens"] == 3 * x["concurrency"] for x in r["runs"])
    assert e.stats["cached"] == c1
    assert r["builds"] == {"tiny": e.build}  # the server's build, from its /health


# -- the CLI server under a mixed load: RSS, no torch, every well-formed answer right --

def _rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_server_under_mixed_load(example_art, tmp_path):
    from serveload import load_test

    port = _free_port()
    exe = Path(sys.executable).parent / "sparkq"
    budget = 64
    p = subprocess.Popen([str(exe), "serve", str(example_art), "--port", str(port), "--parallel", "4", "--threads", "2",
                          "--kv-budget-mib", str(budget), "--model-name", "ex"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait(lambda: _health(url), 120), p.stderr.read() if p.poll() is not None else "no answer"
        busy = subprocess.run([str(exe), "serve", str(example_art), "--port", str(port)], capture_output=True, text=True,
                              timeout=120)
        assert busy.returncode == 2 and busy.stderr.strip().splitlines() == [
            f"error: cannot listen on 127.0.0.1:{port} (Address already in use); pick another --port or --host"]
        maps = open(f"/proc/{p.pid}/maps").read()
        assert "libtorch" not in maps and "torch/lib" not in maps  # the torch-free runtime
        r = load_test(url, "ex", requests=int(os.environ.get("SPARKQ_LOAD_REQUESTS", "48")), clients=16,
                      rss=lambda: _rss_mib(p.pid))
        assert p.poll() is None, "the server died"
        assert r["wrong"] == [] and r["failed"] == [], r
        assert r["ok"] >= r["requests"] // 2 and r["refused"] > 0 and r["left"] > 0
        art_mib = sum(f.stat().st_size for f in Path(example_art).iterdir()) / 2**20
        assert r["rss_peak_mib"] <= art_mib + budget + 200, r
        assert r["rss_after_mib"] <= r["rss_settled_mib"] + 16, r  # back to where it settled
    finally:
        p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = None
    assert rc == 0, p.stderr.read()


def _health(url):
    try:
        conn = http.client.HTTPConnection(url.split("//")[1].split(":")[0], int(url.rsplit(":", 1)[1]), timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def test_sampling_controls_logprobs_and_reasoning_through_the_openai_client(api, serve_art):
    """top_k / min_p / penalties / logit_bias reach the one sampler (runtime/sampling.py); logprobs
    are the log-softmax of the logits the step sampled from; <think> goes to reasoning_content."""
    from sparkq.runtime.sampling import logprobs as log_softmax

    url, e = api
    c = _client(url)
    msgs = [{"role": "user", "content": "hello there"}]
    ids = e.tok.encode_chat(msgs)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    got = r.choices[0].logprobs.content
    new = e.generate(ids, 8)["ids"]
    assert len(got) == len(new)
    single = _lite(serve_art, 1)
    row = single.prefill(ids)
    for j, t in enumerate(new):  # the step's own fp32 logits, as the batched step gives them (batch invariance)
        lp = log_softmax(row)
        assert got[j].token == e.tok.decode([t]) and abs(got[j].logprob - lp[t]) < 1e-3, j
        tops = [x.logprob for x in got[j].top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 3
        assert got[j].token in [x.token for x in got[j].top_logprobs]  # greedy: the sampled token is the top one
        row = single.step(t, len(ids) + j)
    # completions' logprobs (an integer: that many alternatives)
    rc = c.completions.create(model="tiny", prompt="the quick", max_tokens=4, temperature=0, logprobs=2)
    assert len(rc.choices[0].logprobs.token_logprobs) == len(rc.choices[0].logprobs.tokens) == rc.usage.completion_tokens
    # logit_bias forces a token; penalties and top_k / min_p are accepted and seeded sampling stays reproducible
    forced = e.tok.encode("Z")[0]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0, logit_bias={str(forced): 100})
    assert r.choices[0].message.content.startswith("Z")
    kw = dict(model="tiny", messages=msgs, max_tokens=10, temperature=0.9, seed=5, presence_penalty=1.5,
              frequency_penalty=0.5, extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3})
    a, b = (c.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    plain = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0.9, seed=5)
    assert a == b and a != plain.choices[0].message.content
    # reasoning: a template that opens <think> (a chat_template_kwargs switch): the reply is reasoning
    # until </think>; the random model never closes it, so everything is reasoning_content
    template = e.tok.chat_template
    try:
        e.tok.chat_template = template + "{% if think %}<think>\n{% endif %}"
        ref = e.generate(e.tok.encode_chat(msgs, think=True), 6)
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                      extra_body={"chat_template_kwargs": {"think": True}})
        m = r.choices[0].message
        assert m.content == "" and m.model_extra["reasoning_content"] == ref["text"] and ref["text"]
        chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                                extra_body={"chat_template_kwargs": {"think": True}}))
        streamed = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks
                           if ch.choices)
        assert streamed == m.model_extra["reasoning_content"]
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        plain = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
        assert plain.choices[0].message.content == e.generate(ids, 6)["text"]  # no <think>: all content
    finally:
        e.tok.chat_template = template


def test_n_choices_and_prompt_batches_are_the_requests_they_stand_for(api):
    """n choices: choice j is what a request with seed + j gives (streamed: merged by index); a
    completions batch: one choice per prompt (and n each, prompt-major), usage counting each prompt once."""
    from sparkq.runtime.sampling import SamplingParams

    url, e = api
    c = _client(url)
    msgs = [{"role": "user", "content": "name a colour"}]
    ids = e.tok.encode_chat(msgs)
    r = c.chat.completions.create(model="tiny", messages=msgs, n=3, temperature=1.0, seed=11, max_tokens=6)
    alone = [e.generate(ids, 6, sampling=SamplingParams(1.0, seed=11 + j)) for j in range(3)]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.message.content for ch in r.choices] == [a["text"] for a in alone]
    assert len({a["text"] for a in alone}) > 1  # the seeds differ, so the choices do
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == sum(len(a["ids"]) for a in alone)
    got = {}
    for ch in c.chat.completions.create(model="tiny", messages=msgs, n=2, temperature=1.0, seed=11, max_tokens=6,
                                        stream=True, stream_options={"include_usage": True}):
        for cc in ch.choices:
            got[cc.index] = got.get(cc.index, "") + (cc.delta.content or "")
        if ch.usage:
            assert ch.usage.completion_tokens == sum(len(a["ids"]) for a in alone[:2])
    assert got == {0: alone[0]["text"], 1: alone[1]["text"]}
    # completions: a batch of a string and token ids, greedy, n = 1 then the batch's choices in order
    p2 = e.tok.encode("zz top")
    refs = [e.generate(e.tok.encode("hello there"), 5, ignore_eos=True), e.generate(p2, 5, ignore_eos=True)]
    r = c.completions.create(model="tiny", prompt=["hello there", p2], max_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
    assert [ch.text for ch in r.choices] == [x["text"] for x in refs] and [ch.index for ch in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(e.tok.encode("hello there")) + len(p2) and r.usage.completion_tokens == 10
    streamed = {}
    for ch in c.completions.create(model="tiny", prompt=["hello there", p2], max_tokens=5, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True}):
        for cc in ch.choices:
            streamed[cc.index] = streamed.get(cc.index, "") + cc.text
    assert streamed == {0: refs[0]["text"], 1: refs[1]["text"]}


def test_echo_returns_the_prompts_own_logprobs(api, serve_art):
    """completions' echo (what lm-eval's loglikelihood sends: a batch, echo, logprobs 1, max_tokens 1):
    the prompt's text and tokens first, the first token's logprob null, every other the log-softmax of
    the logits at the token before it (sq_prefill over all positions, then the head); max_tokens 0
    returns the prompt alone; the completion is the same bits as without echo."""
    from sparkq.runtime.sampling import logprobs as log_softmax

    url, e = api
    c = _client(url)
    ids = e.tok.encode("the quick brown fox jumps over the lazy dog " * 2)
    single, k = _lite(serve_art, 1), e.prefill_slice  # the engine's slices (the prompt GEMM's bits depend on them)
    assert len(ids) > k
    rows = np.concatenate([single.session.head_many(single.session.prefill(ids[a:a + k], a, last_only=False, chunk=k))
                           for a in range(0, len(ids), k)])
    want = [log_softmax(rows[i])[ids[i + 1]] for i in range(len(ids) - 1)]
    plain = c.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=1,
                                 extra_body={"ignore_eos": True})
    r = c.completions.create(model="tiny", prompt=[ids, ids[:5]], max_tokens=3, temperature=0, logprobs=1, echo=True,
                             extra_body={"ignore_eos": True})
    ch = r.choices[0]
    lp = ch.logprobs
    assert ch.text == e.tok.decode(ids) + plain.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 3
    assert lp.tokens[:len(ids)] == [e.tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert np.allclose(lp.token_logprobs[1:len(ids)], want, atol=1e-5)
    for i in range(1, len(ids)):  # one alternative each: the most probable token at that position
        best = int(np.argmax(rows[i - 1]))
        assert lp.top_logprobs[i] == {e.tok.decode([best]): pytest.approx(float(log_softmax(rows[i - 1])[best]), abs=1e-5)}
    assert lp.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs  # the completion: unchanged bits
    rows5 = single.session.head_many(single.session.prefill(ids[:5], 0, last_only=False))  # its own products (5 rows)
    assert r.choices[1].logprobs.token_logprobs[1:5] == pytest.approx([log_softmax(rows5[i])[ids[i + 1]] for i in range(4)],
                                                                       abs=1e-5)
    assert r.usage.prompt_tokens == len(ids) + 5
    # max_tokens 0: the prompt alone; logprobs 0: no alternatives
    r0 = c.completions.create(model="tiny", prompt="hello there", max_tokens=0, echo=True, logprobs=0)
    assert r0.choices[0].text == "hello there" and r0.usage.completion_tokens == 0 and r0.choices[0].finish_reason == "length"
    assert r0.choices[0].logprobs.top_logprobs[1:] == [{}] * (len(e.tok.encode("hello there")) - 1)
    # echo without logprobs, streamed: the prompt's text is the first piece
    chunks = list(c.completions.create(model="tiny", prompt="hello there", max_tokens=3, echo=True, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == "hello there" and chunks[0].choices[0].logprobs is None
    assert "".join(x.choices[0].text for x in chunks) == "hello there" + e.generate(e.tok.encode("hello there"), 3,
                                                                                     ignore_eos=True)["text"]


def test_what_apps_send_besides_the_request(api):
    """Hosted-service fields (store, metadata, service_tier, user, prompt_cache_key) are accepted and
    change nothing; an earlier reply goes back as the client received it (null refusal / annotations
    / audio, reasoning_content); GET /v1/models/{id}; reasoning_effort is the template's thinking switch."""
    import openai

    url, e = api
    c = _client(url)
    msgs = [{"role": "user", "content": "hello"}]
    ref = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, store=False, metadata={"run": "a"},
                                  service_tier="auto", user="u", prompt_cache_key="k", modalities=["text"],
                                  reasoning_effort="none", prediction={"type": "content", "content": "hi"})
    assert r.choices[0].message.content == ref.choices[0].message.content
    back = ref.choices[0].message.model_dump()  # role, content, refusal, annotations, audio, function_call, tool_calls
    assert {"refusal", "annotations", "audio"} <= set(back)
    back["reasoning_content"] = "thought"
    r2 = c.chat.completions.create(model="tiny", messages=msgs + [back, {"role": "user", "content": "more"}], max_tokens=4)
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    template = e.tok.chat_template
    try:  # a template with a thinking switch: "none" turns it off, any other level on
        e.tok.chat_template = template + "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
        on = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, reasoning_effort="low")
        off = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, reasoning_effort="none")
        assert on.usage.prompt_tokens == len(e.tok.encode_chat(msgs, enable_thinking=True)) == off.usage.prompt_tokens + \
            len(e.tok.encode("<think>\n")) - int(e.tok.add_bos)
        assert on.choices[0].message.model_extra.get("reasoning_content") and not off.model_extra.get("reasoning_content")
        explicit = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, reasoning_effort="low",
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert explicit.usage.prompt_tokens == off.usage.prompt_tokens  # the explicit switch wins
        # the Responses API: reasoning.effort is the same switch, the thinking a reasoning item
        r = c.responses.create(model="tiny", input=msgs, max_output_tokens=4, temperature=0, reasoning={"effort": "low"})
        assert r.output[0].type == "reasoning" and r.usage.input_tokens == on.usage.prompt_tokens
        assert r.output[0].content[0].text == on.choices[0].message.model_extra["reasoning_content"]
        raw = list(c.responses.create(model="tiny", input=msgs, max_output_tokens=4, temperature=0, stream=True,
                                      reasoning={"effort": "low"}))
        assert "".join(x.delta for x in raw if x.type == "response.reasoning_text.delta") == r.output[0].content[0].text
        assert raw[-1].response.output[0].content[0].text == r.output[0].content[0].text
    finally:
        e.tok.chat_template = template


def test_the_tokenizer_over_http(api):
    """POST /tokenize, /detokenize and GET /tokenizer_info in vLLM's shape (lm-eval's remote tokenizer
    reads them) with llama-server's names accepted: the server's own encoding, the chat template's
    ids, a round trip, one-line 4xx for bad bodies."""
    url, e = api

    def post(path, body):
        return _raw(url, "POST", path, json.dumps(body).encode())
    code, j = post("/tokenize", {"prompt": "hello there"})
    assert code == 200 and j["tokens"] == e.tok.encode("hello there") and j["count"] == len(j["tokens"])
    assert j["max_model_len"] == e.slot_cap
    raw = e.tok.tok.encode("hello there", add_special_tokens=False).ids
    assert post("/tokenize", {"prompt": "hello there", "add_special_tokens": False})[1]["tokens"] == raw
    assert post("/tokenize", {"content": "hello there", "add_special": False, "model": "tiny"})[1]["tokens"] == raw
    msgs = [{"role": "user", "content": "hi"}]
    assert post("/tokenize", {"messages": msgs})[1]["tokens"] == e.tok.encode_chat(msgs)
    code, j = post("/detokenize", {"tokens": raw})
    assert code == 200 and j["prompt"] == j["content"] == e.tok.decode(raw)
    code, j = _raw(url, "GET", "/tokenizer_info")
    assert code == 200 and j["eos_token"] == e.tok.eos_token and j["chat_template"] == e.tok.chat_template
    assert j["pad_token"] == e.tok.pad_token and j["model_max_length"] == e.slot_cap
    for path, body, status, needle in [("/tokenize", {"prompt": 3}, 400, "'prompt' (a string)"),
                                       ("/tokenize", {"prompt": "a", "messages": msgs}, 400, "either"),
                                       ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, 400, "boolean"),
                                       ("/tokenize", {"prompt": "a", "model": "other"}, 404, "does not exist"),
                                       ("/tokenize", {"text": "a"}, 400, "unsupported field 'text'"),
                                       ("/detokenize", {"tokens": [1, -1]}, 400, "token ids")]:
        code, j = post(path, body)
        assert code == status and needle in j["error"]["message"], (body, j)


def test_the_servers_connections_send_without_delay():
    """sparkq serve's socket names IPPROTO_TCP, so asyncio sets TCP_NODELAY on every connection it
    accepts: a response's headers and body are not held for the client's delayed ACK (that cost
    ~40 ms per request on a kept-alive connection)."""
    import asyncio

    from sparkq.runtime.serve.server import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    seen = []

    class Peer(asyncio.Protocol):
        def connection_made(self, transport):
            s = transport.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        server = await asyncio.get_running_loop().create_server(Peer, sock=sock)
        _, w = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        w.close()
        server.close()
    asyncio.run(main())
    assert seen and seen[0] != 0
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    with pytest.raises(Exception, match="cannot listen on 127.0.0.1"):
        listen_socket("127.0.0.1", busy.getsockname()[1])
    busy.close()


def test_metrics_cors_and_the_chat_page(api):
    """GET /metrics parses with prometheus-client's parser and moves with requests; --cors-origin
    answers a browser's preflight; GET / is the chat page."""
    from prometheus_client.parser import text_string_to_metric_families

    from sparkq.runtime.serve.server import App

    url, e = api

    def metrics(u):
        import urllib.request
        text = urllib.request.urlopen(u + "/metrics", timeout=30).read().decode()
        return {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
                for s in f.samples}

    before = metrics(url)
    c = _client(url)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    after = metrics(url)
    key = "sparkq_requests_total[('endpoint', 'chat'), ('status', '200')]"
    assert after[key] == before.get(key, 0) + 1
    assert after["sparkq_completion_tokens_total[]"] == before.get("sparkq_completion_tokens_total[]", 0) + \
        r.usage.completion_tokens
    assert after["sparkq_time_to_first_token_seconds_count[]"] >= 1 and "sparkq_slots_in_use[]" in after
    assert after["sparkq_slots[]"] == e.parallel
    import urllib.request
    page = urllib.request.urlopen(url + "/", timeout=30)
    assert page.status == 200 and "/v1/chat/completions" in page.read().decode()
    with _server(App(e, "tiny", cors_origins=["http://app.example"])) as u2:
        from urllib.parse import urlsplit
        conn = http.client.HTTPConnection(urlsplit(u2).hostname, urlsplit(u2).port, timeout=30)
        conn.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and resp.getheader("access-control-allow-origin") == "http://app.example"
        conn.close()
    e.metrics = App(e, "tiny").metrics  # (the module's api app keeps counting on a fresh registry)



@pytest.mark.parametrize("variant", ["int4-g64-split", "lut4-g32-int8head"])
@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_a_grammars_allowed_tokens_get_the_heads_exact_logits(variants, variant, kernel_build):
    """The batched step refines its top candidates exactly; sq_head_exact gives any head row the
    same exact logit (bit for bit where the step refined it), from the row's final-normed state:
    what a grammar's allowed tokens get when the top candidates are masked out."""
    import numpy as np

    batch = _lite(variants[variant], 2)
    s, tok = batch.session, batch.tokenizer
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    offs = [i * batch.slot_elems for i in range(2)]
    for p, o in zip(ids, offs):
        s.prefill(p, 0, kvoff=o)
    logits = s.step_many([7, 9], [len(p) for p in ids], offs)
    for i in range(2):
        x = s.batch_xn(i)
        top = np.argsort(-logits[i], kind="stable")[:4]
        assert np.array_equal(s.head_exact(x, top), logits[i][top]), i  # the step's own exact values
        low = np.argsort(logits[i], kind="stable")[:64]
        exact = s.head_exact(x, low)
        if "split" in variant:  # a 320-row head: the step refined every row (REFINE_SPLIT 2048), all exact
            assert np.array_equal(exact, logits[i][low])
        else:  # an int8 head refines its top 8: the rest are the W4A8 screen's, not the exact values
            assert not np.array_equal(exact, logits[i][low]) and np.allclose(exact, logits[i][low], atol=0.5)
