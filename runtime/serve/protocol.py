"""The OpenAI wire format as ``sparkq serve`` reads it: the fields a request may carry, their checks
(each refusal names its field: HTTP 400 in OpenAI's error shape), chat messages as text."""
from __future__ import annotations

from starlette.responses import JSONResponse

MAX_BODY = 4 << 20
MAX_STOP = 4
# fields a request may carry; any other is refused by name (never silently ignored)
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user",
          "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos"}
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                 "function_call", "parallel_tool_calls", "response_format"}
COMPLETION = COMMON | {"prompt", "echo", "suffix", "best_of"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type_


def error(status: int, message: str, param=None, code=None, type_="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


def number(body, name, lo, hi, default, integer=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {v}", name)
    return v


def unsupported(body: dict, allowed: set) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unsupported field '{unknown[0]}' (sparkq serve does not implement it)", unknown[0])
    if body.get("n") not in (None, 1):
        raise BadRequest("n > 1 is not supported: send one request per completion", "n")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of > 1 is not supported", "best_of")
    for f in ("tools", "functions"):
        if body.get(f):
            raise BadRequest(f"'{f}' (tool calling) is not supported", f)
    for f in ("tool_choice", "function_call"):
        if body.get(f) not in (None, "none"):
            raise BadRequest(f"'{f}' is not supported (no tool calling)", f)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise BadRequest("logprobs are not supported", "logprobs")
    for f in ("presence_penalty", "frequency_penalty"):
        if number(body, f, -2.0, 2.0, 0.0) != 0:
            raise BadRequest(f"'{f}' is not supported (only 0)", f)
    if body.get("logit_bias") not in (None, {}):
        raise BadRequest("logit_bias is not supported", "logit_bias")
    if body.get("echo") not in (None, False):
        raise BadRequest("echo is not supported", "echo")
    if body.get("suffix") not in (None, ""):
        raise BadRequest("suffix (insertion) is not supported", "suffix")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise BadRequest("response_format other than {\"type\": \"text\"} is not supported", "response_format")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("'user' must be a string", "user")


def message_text(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object", f"messages[{i}]")
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "developer", "user", "assistant"):
        raise BadRequest(f"messages[{i}].role must be system, developer, user or assistant, got {role!r}",
                         f"messages[{i}].role")
    extra = set(m) - {"role", "content", "name"}
    if extra:
        raise BadRequest(f"messages[{i}].{sorted(extra)[0]} is not supported", f"messages[{i}]")
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise BadRequest(f"messages[{i}].content[{j}]: only text parts are supported", f"messages[{i}].content")
            parts.append(p["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
    return {"role": "system" if role == "developer" else role, "content": content}
