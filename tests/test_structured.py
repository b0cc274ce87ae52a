"""sparkq serve for agents and apps, through the real `openai` client against the example
(SmolLM2-135M-Instruct): JSON-schema output and forced tool calls that validate (grammar-constrained
decoding, runtime/serve/structured.py), tool results round-tripping, the tool-call formats of the
template families, and the chat page in a real headless browser."""
import contextlib
import json
import shutil
import threading
import time

import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                              "country": {"enum": ["France", "Spain", "Italy"]}},
             "required": ["name", "country"], "additionalProperties": False},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}}]
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@contextlib.contextmanager
def _serving(art, slots=4, max_model_len=1024, **engine):
    import uvicorn

    from sparkq.runtime.lite import load
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.serve.server import App, listen_socket

    e = Engine(load(str(art), max_model_len=max_model_len, kv_budget_mib=32, slots=slots, threads=2), **engine)
    sock = listen_socket("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(App(e, "ex").asgi, log_level="warning", access_log=False))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", e
    finally:
        srv.should_exit = True
        th.join(10)
        sock.close()
        e.close()


@pytest.fixture(scope="module")
def ex(example_art):
    with _serving(example_art) as (url, e):
        yield url, e


def _client(url):
    from openai import OpenAI
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_json_schema_output_validates_alone_and_in_four_concurrent_streams(ex):
    url, _ = ex
    c = _client(url)
    for i in range(20):  # temperature 0.8: the grammar, not greed, keeps it valid
        r = c.chat.completions.create(model="ex", messages=ASK, max_tokens=200, temperature=0.8, seed=i,
                                      response_format=RF)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    texts = [None] * 20

    def stream(k):
        for i in range(k, 20, 4):
            texts[i] = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="ex", messages=ASK, max_tokens=200, temperature=0.8, seed=100 + i, response_format=RF, stream=True)
                if ch.choices)

    th = [threading.Thread(target=stream, args=(k,)) for k in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    obj = c.chat.completions.create(model="ex", messages=ASK, max_tokens=120, temperature=0.8, seed=1,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_schemas_and_tools_it_cannot_take_are_400s_naming_them(ex):
    import openai

    url, _ = ex
    c = _client(url)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema"):
        c.chat.completions.create(model="ex", messages=ASK, max_tokens=8, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="tools"):
        c.chat.completions.create(model="ex", messages=ASK, max_tokens=8, tools=[{"type": "function"}])
    with pytest.raises(openai.BadRequestError, match="not among 'tools'"):
        c.chat.completions.create(model="ex", messages=ASK, max_tokens=8, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="exclude each other"):
        c.chat.completions.create(model="ex", messages=ASK, max_tokens=8, tools=TOOLS, tool_choice="required",
                                  response_format={"type": "json_object"})


def test_required_tool_calls_validate_and_a_tool_result_round_trips(ex):
    url, _ = ex
    c = _client(url)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for i in range(6):
        r = c.chat.completions.create(model="ex", messages=msgs, tools=TOOLS, tool_choice="required", temperature=0.8,
                                      seed=i, max_tokens=120)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # SmolLM2's template knows no tools: the generic prompt, said in system_fingerprint
    assert r.system_fingerprint == "sparkq-generic-tool-prompt"
    named = c.chat.completions.create(model="ex", messages=msgs, tools=TOOLS, max_tokens=120,
                                      tool_choice={"type": "function", "function": {"name": "add"}})
    assert {t.function.name for t in named.choices[0].message.tool_calls} == {"add"}
    one = c.chat.completions.create(model="ex", messages=msgs, tools=TOOLS, max_tokens=120, tool_choice="required",
                                    parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    streamed = list(c.chat.completions.create(model="ex", messages=msgs, tools=TOOLS, tool_choice="required",
                                              max_tokens=120, stream=True))
    deltas = [t for ch in streamed if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name in schemas
    jsonschema.validate(json.loads(deltas[0].function.arguments), schemas[deltas[0].function.name])
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
    call = r.choices[0].message.tool_calls[0]
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "unit": "C"})}]
    final = c.chat.completions.create(model="ex", messages=history, tools=TOOLS, tool_choice="none", max_tokens=30,
                                      temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


def test_the_responses_api_is_the_chat_path(ex):
    """POST /v1/responses through the openai client: the same prompt ids, tokens and usage as the
    equivalent chat request (instructions, message and tool-call items), function_call items from a
    forced tool choice, text.format json_schema, the event stream (raw, and accumulated by the SDK's
    helper) giving the non-streamed Response, and one-line refusals for what needs a store."""
    import openai

    url, e = ex
    c = _client(url)
    ref = c.chat.completions.create(model="ex", messages=[{"role": "system", "content": "be brief"},
                                                            {"role": "user", "content": "hello"}], max_tokens=8)
    r = c.responses.create(model="ex", instructions="be brief", input=[{"role": "user", "content": "hello"}],
                           max_output_tokens=8)
    assert r.output_text == ref.choices[0].message.content and r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.usage.output_tokens == ref.usage.completion_tokens and r.object == "response"
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
        ("incomplete", "max_output_tokens") if ref.choices[0].finish_reason == "length" else ("completed", None))
    raw = list(c.responses.create(model="ex", instructions="be brief", input=[{"role": "user", "content": "hello"}],
                                  max_output_tokens=8, stream=True))
    assert raw[0].type == "response.created" and raw[-1].type in ("response.completed", "response.incomplete")
    assert [x.sequence_number for x in raw] == list(range(1, len(raw) + 1))
    assert "".join(x.delta for x in raw if x.type == "response.output_text.delta") == r.output_text
    assert raw[-1].response.output_text == r.output_text
    # tools: a forced call is a function_call item whose arguments validate; the history round-trips as
    # the chat request with tool_calls / tool messages would
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    tools = [{"type": "function", "name": "weather", "description": "the weather", "parameters": params}]
    r = c.responses.create(model="ex", input="weather?", tools=tools, tool_choice="required", parallel_tool_calls=False,
                           max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "weather"
    jsonschema.validate(json.loads(calls[0].arguments), params)
    with c.responses.stream(model="ex", input="weather?", tools=tools, tool_choice="required", parallel_tool_calls=False,
                            max_output_tokens=60) as st:
        kinds = [ev.type for ev in st]
        final = st.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == [(calls[0].name, calls[0].arguments)]
    hist = [{"role": "user", "content": "weather?"}, calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    r2 = c.responses.create(model="ex", input=hist, tools=tools, max_output_tokens=4)
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}} for t in tools]
    ref2 = c.chat.completions.create(model="ex", tools=chat_tools, max_tokens=4, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": calls[0].name, "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}])
    assert r2.usage.input_tokens == ref2.usage.prompt_tokens and r2.output_text == (ref2.choices[0].message.content or "")
    # text.format: a JSON schema, enforced; the SDK's stream helper accumulates the same text
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    r = c.responses.create(model="ex", input="json", text=fmt, max_output_tokens=40)
    jsonschema.validate(json.loads(r.output_text), schema)
    with c.responses.stream(model="ex", input="json", text=fmt, max_output_tokens=40) as st:
        assert st.get_final_response().output_text == r.output_text
    for kw, needle in [(dict(previous_response_id="resp_1"), "needs responses stored"),
                       (dict(tools=[{"type": "web_search"}]), "only function tools"),
                       (dict(truncation="auto"), "truncation"),
                       (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                        "only text parts"),
                       (dict(input=[{"type": "item_reference", "id": "x"}]), "'item_reference' are not supported"),
                       (dict(extra_body={"mirostat": 1}), "unsupported field 'mirostat'"),
                       (dict(reasoning={"effort": "max"}), "'reasoning.effort' must be one of"),
                       (dict(max_output_tokens=0), "'max_output_tokens' must be an integer >= 1"),
                       (dict(max_output_tokens=5000), "lower max_output_tokens to at most"),  # chat's check, renamed
                       (dict(tools=tools, tool_choice="sometimes"), "\\{\"type\": \"function\", \"name\"\\}")]:
        kw = {"input": "hi", "max_output_tokens": 2, **kw}
        with pytest.raises(openai.BadRequestError, match=needle):
            c.responses.create(model="ex", **kw)
    # hosted-service fields and reasoning.effort "none" are accepted
    assert c.responses.create(model="ex", input="hi", max_output_tokens=2, store=False, metadata={"k": "v"},
                              include=["reasoning.encrypted_content"], reasoning={"effort": "none"}).usage.output_tokens


@pytest.mark.parametrize("template,text,want_content,want", [
    ("{{ tools }}<tool_call>", 'ok <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "ok",
     [("add", {"a": 1, "b": 2})]),
    ("{{ tools }}<tool_call>", '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": "{\\"x\\": 1}"}]'
                              '</tool_call>', None, [("f", {}), ("g", {"x": 1})]),  # Granite: a list
    ("{{ tools }}[TOOL_CALLS]", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', None, [("add", {"a": 1})]),
    ("{{ tools }}<|python_tag|>", '<|python_tag|>{"name": "add", "parameters": {"a": 3}}', None, [("add", {"a": 3})]),
    ("{{ tools }}<|tool_call|>", '<|tool_call|>[{"name": "add", "arguments": {"b": 2}}]<|/tool_call|>', None,
     [("add", {"b": 2})]),
    ("{{ tools }}<tool_call>", "no call here", "no call here", []),
    ("{{ tools }}<tool_call>", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
])
def test_tool_call_formats_of_the_template_families(template, text, want_content, want):
    from sparkq.runtime.serve import tools

    fmt, native = tools.detect(template)
    assert native
    content, calls = fmt.parse(text)
    assert content == want_content and [(c["name"], c["arguments"]) for c in calls] == want


def test_forced_tool_grammars_compile_for_every_format(example_art):
    """Each family's forced-call grammar (tool_choice "required") compiles against a real tokenizer."""
    from sparkq.runtime.lite import load
    from sparkq.runtime.serve import tools
    from sparkq.runtime.serve.structured import Grammars

    m = load(str(example_art), max_model_len=64, kv_budget_mib=2)
    g = Grammars(m.tokenizer, m.session.vocab)
    for template in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>", "<arg_key>"):
        fmt, _ = tools.detect(template)
        for parallel in (True, False):
            assert g.lark(fmt.forced(TOOLS, parallel), "tools")


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium (.ci/run installs it: apt-get install chromium)")
def test_the_chat_page_streams_an_answer_in_a_headless_browser(ex):
    playwright = pytest.importorskip("playwright.sync_api")
    url, e = ex
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('model').textContent.length > 0")
            page.fill("#prompt", "What is the capital of France?")
            page.click("#send")
            page.wait_for_selector(".assistant[data-done='1']", timeout=120_000)
            answer = page.inner_text(".assistant")
            stats = page.inner_text("#stats")
        finally:
            browser.close()
    assert answer.strip() and "tokens/s" in stats, (answer, stats)
