"""Anthropic's Messages API on `sparkq serve` (runtime/serve/anthropic.py) through the real `anthropic`
SDK against a tiny chat model on 127.0.0.1: the text the engine generates for the same rendered
prompt, the event stream accumulated by the SDK's helper giving the same Message, a forced tool call
and its result round-tripping into the next prompt, stop reasons, count_tokens, x-api-key auth,
thinking blocks, and refusals by name in Anthropic's error shape."""
import json

import jsonschema
import pytest

from helpers import make_chat_llama
from sparkq.convert.pipeline import Options, convert
from test_serve import _raw, _server

anthropic = pytest.importorskip("anthropic")

ASK = [{"role": "user", "content": "hello there"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"name": "weather", "description": "the weather in a city", "input_schema": PARAMS}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from sparkq.runtime.lite import load
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.serve.server import App

    d = tmp_path_factory.mktemp("anthropic")
    src = make_chat_llama(d / "m", layers=2, seed=5, max_position_embeddings=2048)
    (src / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 256}))
    convert(str(src), str(d / "art"), Options(progress=False, method="minmax"))
    e = Engine(load(str(d / "art"), max_model_len=2048, kv_budget_mib=32, threads=2, slots=2))
    app = App(e, "tiny")
    with _server(app) as url:
        yield url, e, app
    e.close()


def _client(url, key="unused"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_messages_create_and_stream_are_the_engines_text(served):
    url, e, _ = served
    c = _client(url)
    ids = e.tok.encode_chat([{"role": "system", "content": "be brief"}, *ASK])
    ref = e.generate(ids, 12)  # the engine's own answer (greedy: generation_config)
    m = c.messages.create(model="tiny", system="be brief", messages=ASK, max_tokens=12, metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == "tiny"
    assert _text(m) == ref["text"] and m.usage.input_tokens == len(ids) and m.usage.output_tokens == len(ref["ids"])
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref["finish"]] and m.stop_sequence is None
    # system as text blocks, the user's content as blocks (cache_control: accepted, the prefix cache needs no hint)
    blocks = c.messages.create(model="tiny", max_tokens=12, system=[{"type": "text", "text": "be brief",
                                                                     "cache_control": {"type": "ephemeral"}}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                                      {"type": "text", "text": "there"}]}])
    assert _text(blocks) == ref["text"]
    with c.messages.stream(model="tiny", system="be brief", messages=ASK, max_tokens=12) as st:
        streamed = "".join(st.text_stream)
        final = st.get_final_message()
    assert streamed == _text(m) == _text(final)
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in m.content]
    assert (final.stop_reason, final.stop_sequence, final.usage.input_tokens, final.usage.output_tokens) == \
        (m.stop_reason, m.stop_sequence, m.usage.input_tokens, m.usage.output_tokens)
    raw = list(c.messages.create(model="tiny", system="be brief", messages=ASK, max_tokens=12, stream=True))
    kinds = [ev.type for ev in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert raw[0].message.content == [] and raw[0].message.usage.input_tokens == len(ids)
    # sampling controls reach the sampler: the same seed-free greedy answer at temperature 0
    t0 = c.messages.create(model="tiny", messages=ASK, max_tokens=8, extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    assert _text(t0) == e.generate(e.tok.encode_chat(ASK), 8)["text"]


def test_stop_reasons_and_count_tokens(served):
    url, e, _ = served
    c = _client(url)
    ids = e.tok.encode_chat(ASK)
    ref = e.generate(ids, 16, ignore_eos=True)
    cut = c.messages.create(model="tiny", messages=ASK, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    text = e.generate(ids, 16)["text"]
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip()
                 and "\ufffd" not in text[:i + 2]), None)
    assert stop is not None, ref
    m = c.messages.create(model="tiny", messages=ASK, max_tokens=16, stop_sequences=["@@@", stop])
    assert (m.stop_reason, m.stop_sequence, _text(m)) == ("stop_sequence", stop, text[:text.find(stop)])
    with c.messages.stream(model="tiny", messages=ASK, max_tokens=16, stop_sequences=[stop]) as st:
        final = st.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == ("stop_sequence", stop, _text(m))
    # count_tokens: the prompt the same request renders, tools and all
    assert c.messages.count_tokens(model="tiny", messages=ASK).input_tokens == len(ids)
    n = c.messages.count_tokens(model="tiny", system="be brief", messages=ASK, tools=TOOLS).input_tokens
    used = c.messages.create(model="tiny", system="be brief", messages=ASK, tools=TOOLS, max_tokens=1)
    assert n == used.usage.input_tokens > len(ids)


def test_a_forced_tool_call_and_its_result_round_trip(served):
    url, e, app = served
    c = _client(url)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    m = c.messages.create(model="tiny", messages=ask, tools=TOOLS, max_tokens=200,
                          tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == "weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, PARAMS)
    with c.messages.stream(model="tiny", messages=ask, tools=TOOLS, max_tokens=200,
                           tool_choice={"type": "any", "disable_parallel_tool_use": True}) as st:
        kinds = [ev.type for ev in st]
        final = st.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]
    # the result turn: rendered into the next prompt as the chat path renders a tool message
    hist = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    r = c.messages.create(model="tiny", messages=hist, tools=TOOLS, max_tokens=6)
    from sparkq.runtime.serve.anthropic import to_chat
    cbody = to_chat({"model": "tiny", "messages": hist, "tools": TOOLS, "max_tokens": 6})
    ids = app._prompts(cbody, chat=True)[0][0]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in e.tok.decode(ids)
    assert r.usage.input_tokens == len(ids)
    from openai import OpenAI
    oc = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ref = oc.chat.completions.create(model="tiny", max_tokens=6, tools=[{"type": "function", "function": {
        "name": "weather", "description": "the weather in a city", "parameters": PARAMS}}], messages=ask + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": uses[0].id, "type": "function", "function": {
            "name": "weather", "arguments": json.dumps(uses[0].input)}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "sunny, 21 C"}])
    assert r.usage.input_tokens == ref.usage.prompt_tokens and _text(r) == (ref.choices[0].message.content or "")
    err = to_chat({"model": "tiny", "max_tokens": 6, "messages": ask + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}]}]})
    assert err["messages"][-1] == {"role": "tool", "tool_call_id": "t", "content": "Error: boom"}


def test_thinking_blocks_from_the_reasoning_split(served):
    url, e, _ = served
    c = _client(url)
    template = e.tok.chat_template
    try:  # a template with a thinking switch that opens <think>; the random model never closes it
        e.tok.chat_template = template + "{% if enable_thinking %}<think>\n{% endif %}"
        ref = e.generate(e.tok.encode_chat(ASK, enable_thinking=True, reasoning_effort="medium"), 6)
        m = c.messages.create(model="tiny", messages=ASK, max_tokens=6, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == ref["text"] and ref["text"]
        with c.messages.stream(model="tiny", messages=ASK, max_tokens=6,
                               thinking={"type": "enabled", "budget_tokens": 1024}) as st:
            final = st.get_final_message()
        assert [(b.type, b.thinking) for b in final.content] == [("thinking", ref["text"])]
        off = c.messages.create(model="tiny", messages=ASK, max_tokens=6, thinking={"type": "disabled"})
        assert _text(off) == e.generate(e.tok.encode_chat(ASK), 6)["text"]
    finally:
        e.tok.chat_template = template


def test_api_key_and_errors_in_anthropics_shape(served):
    url, e, _ = served
    c = _client(url)
    for kw, needle in [
            (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), "'image' blocks are not supported"),
            (dict(extra_body={"mcp_servers": []}), "unsupported field 'mcp_servers'"),
            (dict(extra_body={"container": "c1"}), "unsupported field 'container'"),
            (dict(service_tier="priority"), "service_tier"),
            (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "only client tools"),
            (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "not among 'tools'"),
            (dict(max_tokens=5000), "lower max_tokens to at most"),  # chat's check, renamed
            (dict(max_tokens=0), "'max_tokens'"),
            (dict(stop_sequences=[""]), "stop_sequences"),
            (dict(messages=ASK + [{"role": "assistant", "content": "Sure"}]), "a final assistant turn"),
            (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),  # this template has no switch
            (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "'document' blocks")]:
        kw = {"messages": ASK, "max_tokens": 2, **kw}
        with pytest.raises(anthropic.BadRequestError, match=needle) as ex:
            c.messages.create(model="tiny", **kw)
        assert ex.value.body["type"] == "error" and ex.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as ex:
        c.messages.create(model="claude-x", messages=ASK, max_tokens=2)
    assert ex.value.body["error"]["type"] == "not_found_error"
    status, body = _raw(url, "POST", "/v1/messages/batches", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    from sparkq.runtime.serve.server import App
    with _server(App(e, "tiny", api_key="s3cret")) as keyed:
        with pytest.raises(anthropic.AuthenticationError) as ex:
            _client(keyed, "wrong").messages.create(model="tiny", messages=ASK, max_tokens=2)
        assert ex.value.body == {"type": "error", "error": {"type": "authentication_error", "message": ex.value.body[
            "error"]["message"]}}
        status, body = _raw(keyed, "POST", "/v1/messages", json.dumps({"model": "tiny", "messages": ASK,
                                                                       "max_tokens": 2}).encode())
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert _client(keyed, "s3cret").messages.create(model="tiny", messages=ASK, max_tokens=2).usage.output_tokens >= 1
        assert _client(keyed, "s3cret").messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0


def test_a_stream_of_thinking_then_text_is_the_collected_message(served):
    """the event stream of a reply that thinks, then answers: a thinking block closed before the text
    block opens, accumulated by the SDK's own helper into the Message ``collect`` returns"""
    import asyncio

    from anthropic.lib.streaming._messages import accumulate_event

    from sparkq.runtime.serve.anthropic import collect, events
    from sparkq.runtime.serve.reasoning import ReasoningSplitter
    from sparkq.runtime.serve.request import Request as GenRequest

    _, e, app = served
    finish = {"finish": "stop", "prompt_tokens": 3, "completion_tokens": 5}

    async def run(consume):
        q = asyncio.Queue()
        req = GenRequest([1, 2, 3], 8, None)
        req.split = ReasoningSplitter()
        for d in ("<thi", "nk>ab", "c</think>\n\nhel", "lo"):
            q.put_nowait((0, {"delta": d}))
        q.put_nowait((0, finish))
        return await consume(req, q)

    async def stream(req, q):
        return [chunk async for chunk in events(app, req, q)]

    async def whole(req, q):
        return json.loads((await collect(app, req, q)).body)

    sse = b"".join(asyncio.run(run(stream))).decode().strip().split("\n\n")
    evs = [json.loads(part.split("\ndata: ", 1)[1]) for part in sse]
    assert [part.split("\n", 1)[0] for part in sse] == [f"event: {ev['type']}" for ev in evs]
    assert [ev["type"] for ev in evs] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                         "content_block_delta", "content_block_stop", "content_block_start",
                                         "content_block_delta", "content_block_delta", "content_block_stop",
                                         "message_delta", "message_stop"]
    snap = None
    for ev in evs:
        if ev["type"] != "ping":
            snap = accumulate_event(event=ev, current_snapshot=snap, json_bufs={})
    got = asyncio.run(run(whole))
    assert got["content"] == [{"type": "thinking", "thinking": "abc", "signature": ""}, {"type": "text", "text": "hello"}]
    assert [b.model_dump(exclude_none=True) for b in snap.content] == got["content"]
    assert (snap.stop_reason, snap.usage.output_tokens, got["stop_reason"]) == ("end_turn", 5, "end_turn")


def test_error_types_and_statuses():
    from sparkq.runtime.serve.anthropic import reshaped
    from sparkq.runtime.serve.protocol import error

    for status, want in [(400, (400, "invalid_request_error")), (401, (401, "authentication_error")),
                         (404, (404, "not_found_error")), (413, (413, "request_too_large")),
                         (429, (529, "overloaded_error")), (500, (500, "api_error")), (503, (500, "api_error"))]:
        r = reshaped(error(status, "m"))
        assert (r.status_code, json.loads(r.body)) == (want[0], {"type": "error", "error": {"type": want[1], "message": "m"}})


def test_output_config_format_is_enforced(served):
    url, _, _ = served
    c = _client(url)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    m = c.messages.create(model="tiny", messages=ASK, max_tokens=60, output_config=fmt)
    jsonschema.validate(json.loads(_text(m)), schema)
    assert m.stop_reason == "end_turn"
    with c.messages.stream(model="tiny", messages=ASK, max_tokens=60, output_config=fmt) as st:
        assert _text(st.get_final_message()) == _text(m)
    for oc, needle in [({"format": {"type": "json_schema", "schema": {"type": "frob"}}}, "output_config.format.schema"),
                       ({"effort": "high"}, "'thinking' \\(or output_config.effort\\)"),  # no thinking switch here
                       ({"task_budget": 3}, "'output_config': only")]:
        with pytest.raises(anthropic.BadRequestError, match=needle):
            c.messages.create(model="tiny", messages=ASK, max_tokens=2, output_config=oc)
