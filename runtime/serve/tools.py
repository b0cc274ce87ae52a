"""Tool calling: the request's ``tools`` through the model's chat template (its ``tools`` argument),
the model's tool-call text parsed into OpenAI ``tool_calls`` per template family, and a grammar
for ``tool_choice`` "required" or a named function (structured.py), so even a small model returns
arguments that validate.

Families, by what the template writes: Hermes / Qwen / Granite / SmolLM3 (``<tool_call>{json}
</tool_call>``, a JSON object or list inside), Mistral (``[TOOL_CALLS][...]``), Llama 3.x (the reply
is a JSON object, after ``<|python_tag|>`` or alone), Phi-4-mini (``<|tool_call|>[...]<|/tool_call|>``).
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

    def forced(self, call_schema: dict, parallel: bool) -> str:
        """A Lark grammar (llguidance) of replies that are tool calls only"""
        one = f'"{self.open}\\n" call "\\n{self.close}"'
        return f"start: {one}" + (f' ("\\n" {one})*' if parallel else "") + f"\ncall: %json {json.dumps(call_schema)}"

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

    def forced(self, call_schema, parallel):
        items = {"type": "array", "items": call_schema, "minItems": 1, **({} if parallel else {"maxItems": 1})}
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

    def forced(self, call_schema, parallel):
        # Llama 3.x writes {"name": ..., "parameters": {...}}
        s = json.loads(json.dumps(call_schema).replace('"arguments"', '"parameters"'))
        return f"start: call\ncall: %json {json.dumps(s)}"


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


def detect(template: str | None) -> tuple[ToolFormat, bool]:
    """(the template's tool-call format, whether the template renders tools itself)"""
    t = template or ""
    native = "tools" in t
    if "[TOOL_CALLS]" in t:
        return MistralFormat(), native
    if "<|tool_call|>" in t:
        return Phi4Format(), native
    if "<|python_tag|>" in t or "ipython" in t:
        return Llama3Format(), native
    return ToolFormat(), native


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
