"""The OpenAI wire format as ``sparkq serve`` reads it: the fields a request may carry, their checks
(each refusal names its field: HTTP 400 in OpenAI's error shape), chat messages as text."""
from __future__ import annotations

import json

from starlette.responses import JSONResponse

MAX_BODY = 4 << 20
MAX_STOP = 16  # OpenAI takes 4; lm-eval's generate_until sends a task's stop strings and the EOS text
MAX_CHOICES = 64  # sequences one request may ask for: n x prompts
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# an earlier reply sent back as the client received it carries these, empty
EMPTY_REPLY_FIELDS = {"refusal", "annotations", "audio", "function_call"}
# fields that only mean something to a hosted service, accepted (type-checked) and without effect here:
# nothing is stored, there is one service tier, the prefix cache needs no key, no abuse tracking
INFORMATIONAL = {"user": str, "metadata": dict, "store": bool, "service_tier": str, "prompt_cache_key": str,
                 "safety_identifier": str}
# fields a request may carry; any other is refused by name (never silently ignored)
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
          "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
          "top_k", "min_p", "repetition_penalty"} | set(INFORMATIONAL)  # (top_k.. as vLLM and llama-server take them)
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                 "function_call", "parallel_tool_calls", "response_format", "chat_template_kwargs",
                 "reasoning_effort", "modalities", "prediction"}
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
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES):
        raise BadRequest(f"'n' must be an integer in 1..{MAX_CHOICES}", "n")
    if body.get("best_of") not in (None, n or 1):  # best_of = n: every candidate is returned
        raise BadRequest("best_of > n is not supported (ranking candidates by log-probability): send n instead",
                         "best_of")
    for name, kind in INFORMATIONAL.items():
        v = body.get(name)
        if v is not None and not isinstance(v, kind):
            what = {dict: "an object", bool: "a boolean"}.get(kind, "a string")
            raise BadRequest(f"'{name}' must be {what}", name)
    if body.get("metadata") and not all(isinstance(v, str) for v in body["metadata"].values()):
        raise BadRequest("'metadata' must map strings to strings", "metadata")
    pred = body.get("prediction")  # predicted outputs: a speed hint that changes no token; without effect here
    if pred is not None and not (isinstance(pred, dict) and pred.get("type") == "content"
                                 and isinstance(pred.get("content"), (str, list))):
        raise BadRequest("'prediction' must be {\"type\": \"content\", \"content\": text}", "prediction")
    if body.get("modalities") not in (None, ["text"]):
        raise BadRequest("'modalities': only [\"text\"] is supported (no audio output)", "modalities")
    if body.get("reasoning_effort") not in (None, *REASONING_EFFORTS):
        raise BadRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    if body.get("functions") or body.get("function_call") not in (None, "none"):
        raise BadRequest("'functions' / 'function_call' (the deprecated form): send 'tools' / 'tool_choice'", "functions")
    if body.get("tool_choice") not in (None, "none", "auto") and not body.get("tools"):
        raise BadRequest("'tool_choice' forces a call but there are no 'tools'", "tool_choice")
    if not isinstance(body.get("parallel_tool_calls"), (bool, type(None))):
        raise BadRequest("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and (not isinstance(ctk, dict) or not all(isinstance(k, str) for k in ctk)):
        raise BadRequest("'chat_template_kwargs' must be an object (e.g. {\"enable_thinking\": false})",
                         "chat_template_kwargs")
    if not isinstance(body.get("echo"), (bool, type(None))):
        raise BadRequest("'echo' must be a boolean", "echo")
    if body.get("suffix") not in (None, ""):
        raise BadRequest("suffix (insertion) is not supported", "suffix")


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
    allowed = {"role", "content", "name"} | ({"tool_calls", "reasoning_content"} if role == "assistant" else set()) | \
        ({"tool_call_id"} if role == "tool" else set())
    # an earlier reply sent back as the client received it (EMPTY_REPLY_FIELDS)
    extra = {k for k in set(m) - allowed if not (role == "assistant" and k in EMPTY_REPLY_FIELDS and not m[k])}
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
    if m.get("reasoning_content") is not None:  # templates that keep an earlier turn's thinking read it
        if not isinstance(m["reasoning_content"], str):
            raise BadRequest(f"messages[{i}].reasoning_content must be a string", f"messages[{i}].reasoning_content")
        out["reasoning_content"] = m["reasoning_content"]
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


def thinking_kwargs(effort: str | None, kwargs: dict, template: str | None) -> dict:
    """reasoning_effort as the template's thinking switch: "none" turns enable_thinking off, any
    other level on (an explicit chat_template_kwargs value wins); the level itself reaches the
    template as ``reasoning_effort``. A model whose template has no such switch takes only "none"."""
    if effort is None:
        return kwargs
    tmpl = template or ""
    if "enable_thinking" in tmpl:
        kwargs.setdefault("enable_thinking", effort != "none")
    elif "reasoning_effort" not in tmpl and effort != "none":
        raise BadRequest(f"reasoning_effort '{effort}': this model's chat template has no thinking switch; drop the "
                         "field or send \"none\"", "reasoning_effort")
    kwargs.setdefault("reasoning_effort", effort)
    return kwargs
