"""Tool calling: the request's ``tools`` through the model's chat template (its ``tools`` argument),
the model's tool-call text parsed into OpenAI ``tool_calls`` per template family, and a grammar
for ``tool_choice`` "required" or a named function (structured.py), so even a small model returns
arguments that validate.

Families, by what the template writes: Hermes / Qwen / Granite / SmolLM3 (``<tool_call>{json}
</tool_call>``, a JSON object or list inside), Mistral (``[TOOL_CALLS][...]``), Llama 3.x (the reply
is a JSON object, after ``<|python_tag|>`` or alone), Phi-4-mini (``<|tool_call|>[...]<|/tool_call|>``),
Spark2_5 (``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` lines: each value
text read by its parameter's schema type, as vllm-spark2-5-plugin's ``spark25`` parser reads it).
A format object is made per request (``detect``) and holds the request's tools.
A template that never mentions tools gets a generic prompt in a system message (as llama-server
does) asking for the Hermes form; the response says so in ``system_fingerprint``.
"""
from __future__ import annotations

import json
import re
import uuid

from .protocol import BadRequest

GENERIC_FINGERPRINT = "sparkq-generic-tool-prompt"


class ToolFormat:
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []  # the request's (checked) tools

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(the text outside tool calls or None, [{"name", "arguments"}]) of a reply"""
        calls, rest, pos = [], [], 0
        for m in re.finditer(re.escape(self.open) + r"\s*(.*?)\s*(?:" + re.escape(self.close) + r"|$)", text, re.S):
            got = _calls(m.group(1))
            if got is None:
                continue
            rest.append(text[pos:m.start()])
            pos = m.end()
            calls += got
        rest.append(text[pos:])
        content = "".join(rest).strip()
        return (content or None) if calls else text, calls

    def forced(self, functions: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance) of replies that are tool calls of ``functions`` only"""
        one = f'"{self.open}\\n" call "\\n{self.close}"'
        return f"start: {one}" + (f' ("\\n" {one})*' if parallel else "") + \
            f"\ncall: %json {json.dumps(call_schema(functions))}"

    def render(self, calls: list[dict]) -> str:
        """an assistant's earlier tool calls as this format writes them (the generic prompt's history)"""
        return "\n".join(f"{self.open}\n{json.dumps(c, ensure_ascii=False)}\n{self.close}" for c in calls)


class MistralFormat(ToolFormat):
    name = "mistral"

    def parse(self, text):
        i = text.find("[TOOL_CALLS]")
        if i < 0:
            return text, []
        calls = _calls(text[i + len("[TOOL_CALLS]"):].strip())
        return (text[:i].strip() or None, calls) if calls else (text, [])

    def forced(self, functions, parallel):
        items = {"type": "array", "items": call_schema(functions), "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps(items)}'


class Phi4Format(ToolFormat):
    name = "phi4"
    open, close = "<|tool_call|>", "<|/tool_call|>"


class Llama3Format(ToolFormat):
    name = "llama3"

    def parse(self, text):
        body = text.split("<|python_tag|>", 1)[-1].strip()
        calls = _calls(body) if body.startswith("{") else None
        return (None, calls) if calls else (text, [])

    def forced(self, functions, parallel):
        # Llama 3.x writes {"name": ..., "parameters": {...}}
        s = json.loads(json.dumps(call_schema(functions)).replace('"arguments"', '"parameters"'))
        return f"start: call\ncall: %json {json.dumps(s)}"


class Spark25Format(ToolFormat):
    """Spark2_5's calls (GLM-4.5's form), as vllm-spark2-5-plugin's ``spark25`` parser reads them:

        <tool_call>get_weather
        <arg_key>city</arg_key><arg_value>Paris</arg_value>
        <arg_key>days</arg_key><arg_value>3</arg_value>
        </tool_call>

    Each value is text, read by its parameter's schema ``type`` (``spark_value``). A call of a
    function not among the request's tools is dropped, reply text and all; one without a name, or
    without its closing tag, stays text."""
    name = "spark25"
    ARG = re.compile(r"<arg_key>(.*?)</arg_key><arg_value>(.*?)</arg_value>", re.S)

    def parse(self, text):
        calls, rest, pos = [], [], 0
        while (start := text.find(self.open, pos)) >= 0:
            end = text.find(self.close, start + len(self.open))
            if end < 0:
                break
            end += len(self.close)
            rest.append(text[pos:start])
            body = text[start + len(self.open):end - len(self.close)]
            name = body.split("<arg_key>", 1)[0].strip()
            props = self._properties(name)
            if not name:
                rest.append(text[start:end])
            elif props is not None:
                calls.append({"name": name, "arguments": {k: spark_value(v, _param_type(props.get(k)))
                                                          for k, v in self.ARG.findall(body) if k}})
            pos = end
        rest.append(text[pos:])
        content = "".join(rest)
        return ((content.strip() or None) if calls else content), calls

    def _properties(self, name: str) -> dict | None:
        """the function's parameter schemas by name; None for a name not among the tools (any name
        counts when the request has none)"""
        for t in self.tools:
            if t["function"]["name"] == name:
                return (t["function"].get("parameters") or {}).get("properties") or {}
        return None if self.tools else {}

    def render(self, calls):
        return "\n".join(f"{self.open}{c['name']}\n" + "".join(
            f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            "</arg_value>\n" for k, v in c["arguments"].items()) + self.close for c in calls)

    def forced(self, functions, parallel):
        """One rule per function (its name, then its declared parameters in their order, the required
        ones always) and one per parameter's value (``_value_rule``)."""
        rules = ["start: call" + (' ("\\n" call)*' if parallel else ""),
                 "call: " + " | ".join(f"call{i}" for i in range(len(functions)))]
        for i, f in enumerate(functions):
            name, params = f["function"]["name"], f["function"].get("parameters") or {}
            need, defs = set(params.get("required") or []), {k: params[k] for k in ("$defs", "definitions") if k in params}
            args = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                value, rule = _value_rule(f"v{i}_{j}", schema if isinstance(schema, dict) else {}, defs)
                rules.append(rule)
                arg = f'{_lit(f"<arg_key>{key}</arg_key><arg_value>")} {value} "</arg_value>\\n"'
                args.append(arg if key in need else f"({arg})?")
            rules.append(f"call{i}: " + " ".join([_lit(f"{self.open}{name}\n"), *args, _lit(self.close)]))
        return "\n".join(rules)


# a parameter's schema type as the spark25 parser names it -> the JSON schema type
SPARK_TYPES = {"str": "string", "text": "string", "int": "integer", "float": "number", "bool": "boolean"}


def _param_type(schema) -> str:
    """a parameter's declared type as the spark25 parser takes it (``_get_param_type``): its schema's
    ``type`` if that is one string, else "string" (a list of types, anyOf, $ref, undeclared)"""
    t = schema.get("type") if isinstance(schema, dict) else None
    return t if isinstance(t, str) else "string"


def spark_value(value: str, param_type: str):
    """A Spark2_5 value's text as its parameter's type reads it, the plugin's ``_convert_value``
    to the letter: "null" (any case) is None; a string stays text; an integer, number (integral:
    an int) or boolean (true/1/false/0) is read as one, any other type as JSON; what does not read
    as its type is JSON if it parses, else the text."""
    if value.lower() == "null":
        return None
    t = SPARK_TYPES.get(param_type.lower(), param_type.lower())
    try:
        if t == "string":
            return value
        if t == "integer":
            return int(value)
        if t == "number":
            x = float(value)
            return int(x) if x.is_integer() else x
        if t == "boolean":
            b = value.strip().lower()
            if b not in ("true", "1", "false", "0"):
                raise ValueError(f"invalid boolean: {value}")
            return b in ("true", "1")
        return json.loads(value)
    except (TypeError, ValueError):  # json.JSONDecodeError is a ValueError
        try:
            return json.loads(value)
        except (TypeError, ValueError):
            return value


def _value_rule(name: str, schema: dict, defs: dict) -> tuple[str, str]:
    """(the symbol, its Lark rule) of one argument's value text: text that ``spark_value`` reads back
    as a value of ``schema``. Enum / const: one of the values; string: text without '<' (where the
    value ends), within minLength / maxLength, never "null"; any other type: its JSON (%json of the
    schema, the parameters' $defs beside it)."""
    t = _param_type(schema).lower()
    t = SPARK_TYPES.get(t, t)
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        texts = [v if isinstance(v, str) and t == "string" else json.dumps(v, ensure_ascii=False) for v in values]
        return name, f"{name}: " + " | ".join(map(_lit, texts))
    if t == "string":
        lo, hi = (n if type(n) is int else d for n, d in ((schema.get("minLength"), 0), (schema.get("maxLength"), "")))
        return name.upper(), f"{name.upper()}: /[^<]{{{lo},{hi}}}/ & ~/(?i:null)/"
    from .structured import COMPACT
    return name, f"{name}: %json {json.dumps({'x-guidance': COMPACT, **defs, **schema, 'type': t}, ensure_ascii=False)}"


def _lit(text: str) -> str:
    """a Lark string literal"""
    return json.dumps(text, ensure_ascii=False)


def _calls(body: str) -> list[dict] | None:
    """JSON tool calls ({"name", "arguments" | "parameters"}, or a list of them) -> [{name, arguments}]"""
    try:
        v = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = v if isinstance(v, list) else [v]
    out = []
    for c in items:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = c.get("arguments", c.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        out.append({"name": c["name"], "arguments": args})
    return out or None


def detect(template: str | None, tools: list[dict] | None = None) -> tuple[ToolFormat, bool]:
    """(the template's tool-call format, holding the request's ``tools``; whether the template
    renders tools itself)"""
    t = template or ""
    native = "tools" in t
    for mark, fmt in (("<arg_key>", Spark25Format), ("[TOOL_CALLS]", MistralFormat), ("<|tool_call|>", Phi4Format),
                      ("<|python_tag|>", Llama3Format), ("ipython", Llama3Format)):
        if mark in t:
            return fmt(tools), native
    return ToolFormat(tools), native


def check_tools(tools) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise BadRequest("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}", "tools")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", f["name"]):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": [A-Za-z0-9_.-]{{1,64}}, "
                             "...}}", f"tools[{i}]")
        if not isinstance(f.get("parameters", {}), dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        if f["name"] in names:
            raise BadRequest(f"tools[{i}]: the name {f['name']!r} is used twice", f"tools[{i}].function.name")
        names.add(f["name"])
    return tools


def chosen(tools: list[dict], tool_choice) -> list[dict] | None:
    """The functions a reply must call (tool_choice "required" or a named one), None for auto / none."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return tools
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance((tool_choice.get("function") or {}).get("name"), str):
        name = tool_choice["function"]["name"]
        pick = [t for t in tools if t["function"]["name"] == name]
        if not pick:
            raise BadRequest(f"tool_choice names {name!r}, which is not among 'tools'", "tool_choice")
        return pick
    raise BadRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}}", "tool_choice")


def call_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call of any of ``functions``: {"name": its name, "arguments": its parameters}"""
    alts = [{"type": "object", "properties": {"name": {"const": f["function"]["name"]},
                                              "arguments": f["function"].get("parameters") or {"type": "object"}},
             "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    from .structured import COMPACT
    return {**(alts[0] if len(alts) == 1 else {"anyOf": alts}), "x-guidance": COMPACT}


def generic_prompt(tools: list[dict], fmt: ToolFormat) -> str:
    """The system text for a template without tool support (llama-server's generic tool prompt, Hermes form)."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions. Their definitions, one JSON object per line:\n" + listing +
            f"\nTo call one, reply with {fmt.open}\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n"
            f"{fmt.close} and nothing else. Otherwise answer normally.")


def openai_calls(calls: list[dict]) -> list[dict]:
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}} for c in calls]


def generic_messages(msgs: list[dict], tools, fmt) -> list[dict]:
    """Messages for a template without tools: the tools in a system message (generic_prompt),
    earlier calls as the format's text, results as user turns in <tool_response>"""
    out = []
    for m in msgs:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + fmt.render(calls)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = generic_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
