"""Spark2_5's tool calls (runtime/serve/tools.py Spark25Format, convert/data/spark2_5_chat_template.jinja):
the parser against vllm-spark2-5-plugin's ``spark25`` semantics, the forced-call grammar through
llguidance on a byte-level tokenizer (no model), the chat template through sparkq's own rendering,
and a tiny random model behind `sparkq serve` returning typed calls through the real `openai` client."""
import json

import jsonschema
import pytest

from helpers import ROOT, byte_tokenizer
from sparkq.runtime.serve import tools

TEMPLATE = (ROOT / "convert/data/spark2_5_chat_template.jinja").read_text()


def _fn(name, properties, required=()):
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


WEATHER = _fn("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"])
TYPED = _fn("typed", {"s": {"type": "string"}, "n": {"type": "number"}, "f": {"type": "number"}, "b": {"type": "boolean"},
                      "b1": {"type": "boolean"}, "z": {"type": "integer"}, "o": {"type": "object"}, "a": {"type": "array"},
                      "u": {"type": ["string", "null"]}, "bad": {"type": "integer"}})
README_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>\n"
               "<arg_key>days</arg_key><arg_value>3</arg_value>\n</tool_call>")


def _parse(text, tool_list=(WEATHER, TYPED)):
    fmt, _ = tools.detect("{{ tools }}<arg_key>", list(tool_list))
    content, calls = fmt.parse(text)
    return content, [(c["name"], c["arguments"]) for c in calls]


# -- the parser: the plugin's semantics --

def test_the_plugin_readme_call_is_typed_by_the_tools_schema():
    assert _parse(README_CALL) == (None, [("get_weather", {"city": "Paris", "days": 3})])
    assert _parse(README_CALL, ()) == (None, [("get_weather", {"city": "Paris", "days": "3"})])  # no tools: all text


def test_values_are_read_by_their_declared_type():
    args = {"s": "42", "n": "2.50", "f": "4.0", "b": "True", "b1": "0", "z": "null", "o": '{"k": [1, "x"]}',
            "a": "[1, 2]", "u": "7", "bad": "seven", "undeclared": "[3]"}
    text = "<tool_call>typed\n" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>\n" for k, v in args.items()) + \
        "</tool_call>"
    assert _parse(text) == (None, [("typed", {
        "s": "42", "n": 2.5, "f": 4, "b": True, "b1": False, "z": None, "o": {"k": [1, "x"]}, "a": [1, 2],
        "u": "7",  # a list of types reads as a string, as the plugin's _get_param_type says
        "bad": "seven",  # not an integer, not JSON: the text
        "undeclared": "[3]"})])  # undeclared: a string
    assert _parse("<tool_call>typed\n<arg_key>n</arg_key><arg_value>1e3</arg_value>\n<arg_key>b</arg_key>"
                  "<arg_value>yes</arg_value>\n<arg_key>z</arg_key><arg_value>2.0</arg_value>\n</tool_call>") == \
        (None, [("typed", {"n": 1000, "b": "yes", "z": 2.0})])  # an unreadable type falls back to JSON, then text
    assert [tools.spark_value(v, t) for v, t in [("3", "int"), ("x", "TEXT"), ("1", "bool"), ("NULL", "string")]] == \
        [3, "x", True, None]


def test_content_unknown_functions_unclosed_calls_and_two_calls():
    assert _parse("Let me check.\n" + README_CALL) == ("Let me check.", [("get_weather", {"city": "Paris", "days": 3})])
    unknown = "<tool_call>nope\n<arg_key>x</arg_key><arg_value>1</arg_value>\n</tool_call>"
    assert _parse("a " + unknown + " b") == ("a  b", [])  # dropped from the content, as the plugin drops it
    assert _parse(unknown + README_CALL) == (None, [("get_weather", {"city": "Paris", "days": 3})])
    assert _parse("<tool_call>\n</tool_call>") == ("<tool_call>\n</tool_call>", [])  # no name: stays text
    unclosed = "x " + README_CALL[:-len("</tool_call>")]
    assert _parse(unclosed) == (unclosed, [])
    assert _parse(README_CALL + "\n" + README_CALL.replace("Paris", "Lyon").replace(">3<", ">5<") + "\ntail")[1] == \
        [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Lyon", "days": 5})]
    assert _parse("no call here") == ("no call here", [])


def test_render_writes_what_parse_reads():
    calls = [{"name": "typed", "arguments": {"s": "a b", "n": 1.5, "b": False, "o": {"k": "é"}, "a": [1]}},
             {"name": "get_weather", "arguments": {}}]
    fmt, _ = tools.detect("<arg_key>", [WEATHER, TYPED])
    text = fmt.render(calls)
    assert text.startswith("<tool_call>typed\n<arg_key>s</arg_key><arg_value>a b</arg_value>\n")
    assert fmt.parse(text) == (None, calls)


# -- the forced grammar, through llguidance on a byte-level tokenizer --

@pytest.fixture(scope="module")
def chat_tok():
    from tokenizers import Tokenizer

    from sparkq.runtime.tokenizer import ChatTokenizer
    return ChatTokenizer(Tokenizer.from_str(byte_tokenizer(320)), {"eos_token": "<|eos|>"}, {}, {}, TEMPLATE)


GRAMMAR_TOOLS = [_fn("get_weather", {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1},
                                     "unit": {"enum": ["C", "F"]}, "detail": {"type": "boolean"}}, ["city", "days"]),
                 _fn("store", {"rate": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
                               "meta": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}},
                     ["meta"])]


@pytest.fixture(scope="module")
def accepts(chat_tok):
    """accepts(grammar, text): whether ``text`` is a whole reply the grammar allows (each token in
    the mask, then the end), with the grammar compiled by the server's own code"""
    from sparkq.runtime.serve.structured import Grammars
    g = Grammars(chat_tok, 320)

    def accepts(lark: str, text: str) -> bool:
        c = g.constraint(g.lark(lark, "tools"))
        for t in chat_tok.encode(text):
            if not c.mask()[t]:
                return False
            c.consume(t)
        return bool(c.mask()[min(chat_tok.stop_ids)])
    return accepts


def _call(name, **args):
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>\n" for k, v in args.items()) + \
        "</tool_call>"


@pytest.mark.parametrize("text,ok", [
    (_call("get_weather", city="Paris", days=3), True),
    (_call("get_weather", city="Paris", days=3, unit="F", detail="false"), True),
    (_call("store", rate="-1.5e3", tags='["a", "b"]', meta='{"k": 2}'), True),
    (_call("store", meta='{"k": 2}'), True),
    (_call("get_weather", city="Paris", days=3) + "\n" + _call("store", meta='{"k": 0}'), True),  # parallel
    (_call("get_wether", city="Paris", days=3), False),  # wrong name
    (_call("get_weather", city="Paris", days=3, country="FR"), False),  # undeclared key
    (_call("get_weather", city="Paris", days="3.5"), False),  # not an integer
    (_call("get_weather", city="Paris", days="0"), False),  # below the minimum
    (_call("get_weather", city="Paris"), False),  # missing a required parameter
    (_call("get_weather", days=3, city="Paris"), False),  # out of the declared order
    (_call("get_weather", city="null", days=3), False),  # reads as None, not a string
    (_call("get_weather", city="A very long city", days=3), False),  # over maxLength
    (_call("get_weather", city="Paris", days=3, unit="K"), False),  # not in the enum
    (_call("get_weather", city="Paris", days=3, detail="yes"), False),
    (_call("store", meta='{"j": 2}'), False),  # the sub-schema holds
    ("Sure. " + _call("store", meta='{"k": 2}'), False),  # calls only
])
def test_forced_grammar_accepts_typed_calls_and_rejects_the_rest(accepts, text, ok):
    fmt, _ = tools.detect(TEMPLATE, GRAMMAR_TOOLS)
    assert isinstance(fmt, tools.Spark25Format)
    assert accepts(fmt.forced(GRAMMAR_TOOLS, parallel=True), text) is ok
    if ok:  # what the grammar lets through parses into arguments that validate
        for name, args in _parse(text, GRAMMAR_TOOLS)[1]:
            schema = next(t["function"]["parameters"] for t in GRAMMAR_TOOLS if t["function"]["name"] == name)
            jsonschema.validate(args, schema)


def test_forced_grammar_one_call_and_a_named_function(accepts):
    fmt, _ = tools.detect(TEMPLATE, GRAMMAR_TOOLS)
    two = _call("store", meta='{"k": 1}') + "\n" + _call("store", meta='{"k": 2}')
    assert accepts(fmt.forced(GRAMMAR_TOOLS, parallel=True), two)
    assert not accepts(fmt.forced(GRAMMAR_TOOLS, parallel=False), two)
    named = fmt.forced(tools.chosen(GRAMMAR_TOOLS, {"type": "function", "function": {"name": "store"}}), parallel=True)
    assert accepts(named, two) and not accepts(named, _call("get_weather", city="Paris", days=3))


# -- the chat template, rendered as sparkq renders it --

def test_the_template_renders_tools_calls_and_results_and_selects_the_spark_form(chat_tok):
    from sparkq.runtime.serve.protocol import message_text

    fmt, native = tools.detect(TEMPLATE)
    assert isinstance(fmt, tools.Spark25Format) and native
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
                {"id": "c2", "type": "function", "function": {"name": "typed", "arguments": {"o": {"k": [1]}, "b": True}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "tool_call_id": "c2", "content": "ok"}]
    text = chat_tok.render_chat([message_text(m, i) for i, m in enumerate(msgs)], tools=[WEATHER, TYPED])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER["function"], ensure_ascii=False) in text
    assert "<arg_key>argument-key</arg_key><arg_value>argument-value</arg_value>" in text
    history = ("<|im_start|>assistant\n" + _call("get_weather", city="Paris", days=3) + "\n" +
               _call("typed", o='{"k": [1]}', b="true") + "<|im_end|>\n")
    assert history in text  # arguments as a JSON string (the wire) and as an object, the same form
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nok\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text and text.endswith("<|im_start|>assistant\n")
    # the history parses back into the calls it came from
    fmt, _ = tools.detect(TEMPLATE, [WEATHER, TYPED])
    assert fmt.parse(history[len("<|im_start|>assistant\n"):-len("<|im_end|>\n")])[1] == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        {"name": "typed", "arguments": {"o": {"k": [1]}, "b": True}}]
    # no tools: a plain ChatML system turn; enable_thinking false: an empty think block
    plain = chat_tok.render_chat(msgs[:2], enable_thinking=False)
    assert plain == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                     "<|im_start|>assistant\n<think>\n\n</think>\n\n")


# -- end to end: a tiny random model with the Spark template behind sparkq serve --

SERVE_TOOLS = [_fn("get_weather", {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                                          "maximum": 14},
                                   "unit": {"enum": ["C", "F"]}}, ["city", "days"]),
               _fn("set_alarm", {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
                   ["hour", "loud"])]


@pytest.fixture(scope="module")
def spark_server(tmp_path_factory):
    from sparkq.convert.pipeline import Options, convert
    from test_structured import _serving

    from test_spark2_5 import make_spark

    d = tmp_path_factory.mktemp("spark")
    src = make_spark(d / "m", seed=3)  # a tiny Spark2_5 (gate, GELU, sliding layers) served with its template
    (src / "chat_template.jinja").write_text(TEMPLATE)
    (src / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 256}))
    convert(str(src), str(d / "art"), Options(progress=False, method="minmax"))
    assert (d / "art" / "chat_template.jinja").read_text() == TEMPLATE
    with _serving(d / "art", slots=2, max_model_len=2048) as (url, _):
        yield url


def _typed_calls(calls):
    """[(name, arguments)] of OpenAI tool calls, each validated against its schema (ints are ints)"""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in SERVE_TOOLS}
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, schemas[c.function.name])
        out.append((c.function.name, args))
    return out


@pytest.mark.parametrize("choice", ["required", "set_alarm"])
def test_served_calls_are_parsed_and_typed_whole_and_streamed(spark_server, choice):
    from test_structured import _client

    c = _client(spark_server)
    named = choice != "required"  # a named function, parallel calls allowed; "required": one call
    kw = dict(model="ex", messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}], tools=SERVE_TOOLS,
              tool_choice={"type": "function", "function": {"name": choice}} if named else choice,
              parallel_tool_calls=named, max_tokens=300)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    # parallel calls go on while the model writes them: one that max_tokens cut stays text, as the
    # plugin leaves an unclosed call
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.content is None or named and ch.message.content.startswith("<tool_call>"), ch
    calls = _typed_calls(ch.message.tool_calls)
    assert calls and (len(calls) == 1 or named) and all(name == choice for name, _ in calls if named)
    assert r.system_fingerprint is None  # the template renders the tools (no generic prompt)
    streamed = list(c.chat.completions.create(**kw, stream=True))
    deltas = [t for x in streamed if x.choices for t in (x.choices[0].delta.tool_calls or [])]
    assert _typed_calls(deltas) == calls and [d.index for d in deltas] == list(range(len(calls)))
    assert [x.choices[0].finish_reason for x in streamed if x.choices and x.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(x.choices[0].delta.content or "" for x in streamed if x.choices) == (ch.message.content or "")
