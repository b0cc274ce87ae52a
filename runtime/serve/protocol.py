"""The OpenAI wire format as ``sparkq serve`` reads it: the fields a request may carry, their checks
(each refusal names its field: HTTP 400 in OpenAI's error shape), chat messages as text."""
from __future__ import annotations

import json

from starlette.responses import JSONResponse

MAX_BODY = 4 << 20
MAX_STOP = 4
# fields a request may carry; any other is refused by name (never silently ignored)
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user",
          "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
          "top_k", "min_p", "repetition_penalty"}  # (the last three as vLLM and llama-server take them)
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                 "function_call", "parallel_tool_calls", "response_format", "chat_template_kwargs"}
COMPLETION = COMMON | {"prompt", "echo", "suffix", "best_of", "response_format"}


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
    if body.get("functions") or body.get("function_call") not in (None, "none"):
        raise BadRequest("'functions' / 'function_call' (the deprecated form): send 'tools' / 'tool_choice'", "functions")
    if body.get("tool_choice") not in (None, "none", "auto") and not body.get("tools"):
        raise BadRequest("'tool_choice' forces a call but there are no 'tools'", "tool_choice")
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise BadRequest("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and (not isinstance(ctk, dict) or not all(isinstance(k, str) for k in ctk)):
        raise BadRequest("'chat_template_kwargs' must be an object (e.g. {\"enable_thinking\": false})",
                         "chat_template_kwargs")
    if body.get("echo") not in (None, False):
        raise BadRequest("echo is not supported", "echo")
    if body.get("suffix") not in (None, ""):
        raise BadRequest("suffix (insertion) is not supported", "suffix")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("'user' must be a string", "user")


def message_text(m, i: int) -> dict:
    """One chat message as the template reads it: role and text content; an assistant's earlier
    ``tool_calls`` (their arguments as objects, as chat templates expect) and a ``tool`` result's
    ``tool_call_id``."""
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object", f"messages[{i}]")
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise BadRequest(f"messages[{i}].role must be system, developer, user, assistant or tool, got {role!r}",
                         f"messages[{i}].role")
    allowed = {"role", "content", "name"} | ({"tool_calls"} if role == "assistant" else set()) | \
        ({"tool_call_id"} if role == "tool" else set())
    extra = set(m) - allowed
    if extra:
        raise BadRequest(f"messages[{i}].{sorted(extra)[0]} is not supported", f"messages[{i}]")
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise BadRequest(f"messages[{i}].content[{j}]: only text parts are supported", f"messages[{i}].content")
            parts.append(p["text"])
        content = "".join(parts)
    calls = m.get("tool_calls")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
    out = {"role": "system" if role == "developer" else role, "content": content}
    if calls is not None:
        out["tool_calls"] = []
        for j, c in enumerate(calls if isinstance(calls, list) else [None]):
            f = c.get("function") if isinstance(c, dict) else None
            try:
                args = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
                assert isinstance(f["name"], str) and isinstance(args, dict)
            except (TypeError, KeyError, AssertionError, json.JSONDecodeError):
                raise BadRequest(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                                 "{\"name\", \"arguments\": a JSON object string}}", f"messages[{i}].tool_calls") from None
            out["tool_calls"].append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    if role == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out
