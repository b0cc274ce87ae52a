"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), what the
``anthropic`` SDK and Claude Code send: as oairesponses.py does for the Responses API, the request
is translated into a chat request (``to_chat``) and runs through the same checks, template,
grammars, tool parsing and engine as /v1/chat/completions; the result comes back as a Message or
its stream of typed events.

| Messages API | chat request |
|---|---|
| ``system`` (string or text blocks) | the first system message |
| user ``text`` / ``tool_result`` blocks | user text / ``tool`` messages (``is_error``: the text after "Error: ") |
| assistant ``text`` / ``tool_use`` / ``thinking`` | content / ``tool_calls`` / ``reasoning_content`` |
| ``tools`` {name, description, input_schema} | function tools |
| ``tool_choice`` auto / any / tool / none | "auto" / "required" / the named function / "none" |
| ``disable_parallel_tool_use`` | ``parallel_tool_calls: false`` |
| ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` | the same controls |
| ``thinking`` enabled / adaptive / disabled | ``reasoning_effort`` medium / medium / none |
| ``output_config`` {effort, format json_schema} | ``reasoning_effort`` (xhigh, max: high), ``response_format`` |

``metadata.user_id``, ``cache_control`` (the prefix cache reuses prompts unasked) and
``service_tier`` auto / standard_only are accepted without effect, an earlier turn's
``redacted_thinking`` is dropped (opaque); anything else (images, documents, server tools, an
assistant prefill, ``container``, ``mcp_servers``...) is refused by name. Errors come in
Anthropic's shape {"type": "error", "error": {"type", "message"}}."""
from __future__ import annotations

import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from .protocol import CHAT, BadRequest, unsupported
from .responses import Collected, EventStream, reply_parts

FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "metadata",
          "stream", "tools", "tool_choice", "thinking", "output_config", "cache_control", "service_tier"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control"}
# chat's names in the chat path's errors, as a Messages request calls them
RENAMED = {"max_completion_tokens": "max_tokens", "'stop'": "'stop_sequences'",
           "response_format.json_schema.schema": "output_config.format.schema", "response_format": "output_config.format",
           **{f"reasoning_effort '{x}'": "'thinking' (or output_config.effort)" for x in ("low", "medium", "high")},
           'drop the field or send "none"': 'drop it or send {"type": "disabled"}', "reasoning_effort": "thinking"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
BLOCK_EXTRAS = {"cache_control", "citations"}  # block fields accepted without effect (citations: null / empty)


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def anthropic_error(status: int, message: str) -> JSONResponse:
    """An error in Anthropic's shape (a full queue: 529 overloaded; a failed engine: 500 api_error)."""
    status = {503: 500}.get(status, status)
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}},
                        status_code=status)


def reshaped(resp: JSONResponse) -> JSONResponse:
    """an OpenAI-shaped error response of the chat path in Anthropic's shape"""
    err = json.loads(resp.body)["error"]
    status = 529 if resp.status_code == 429 else resp.status_code
    return anthropic_error(status, err["message"])


def _block(b, where: str, kinds: tuple) -> dict:
    """one content block, its type among ``kinds`` (a BadRequest naming any other)"""
    kind = b.get("type") if isinstance(b, dict) else None
    if kind not in kinds:
        raise BadRequest(f"{where}: {kind!r} blocks are not supported here (sparkq serve takes {', '.join(kinds)})")
    fields = {"text": {"text"}, "tool_use": {"id", "name", "input"}, "thinking": {"thinking", "signature"},
              "redacted_thinking": {"data"}, "tool_result": {"tool_use_id", "content", "is_error"}}[kind]
    extra = sorted(set(b) - fields - BLOCK_EXTRAS - {"type"})
    if extra or b.get("citations"):
        raise BadRequest(f"{where}.{extra[0] if extra else 'citations'} is not supported")
    return b


def _text(content, where: str) -> str:
    """a string, or text blocks, as one string"""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks")
    out = []
    for j, b in enumerate(content):
        b = _block(b, f"{where}[{j}]", ("text",))
        if not isinstance(b.get("text"), str):
            raise BadRequest(f"{where}[{j}].text must be a string")
        out.append(b["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    """the conversation as chat messages (OpenAI's form, which the chat path checks further)"""
    msgs = []
    if body.get("system") is not None:
        msgs.append({"role": "system", "content": _text(body["system"], "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadRequest("'messages' must be a non-empty list of {\"role\": \"user\" | \"assistant\", \"content\"}")
    for i, m in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or set(m) - {"role", "content"}:
            raise BadRequest(f"{where} must be {{\"role\": \"user\" | \"assistant\", \"content\"}}")
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content must be a string or a list of content blocks")
        if m["role"] == "assistant":
            msgs.append(_assistant(content, where))
            continue
        text = []  # a user turn: its tool results (as tool messages) and its text, in order
        for j, b in enumerate(content):
            b = _block(b, f"{where}.content[{j}]", ("text", "tool_result"))
            if b["type"] == "text":
                text.append(_text([b], f"{where}.content"))
                continue
            if text:
                msgs.append({"role": "user", "content": "".join(text)})
                text = []
            if not isinstance(b.get("tool_use_id"), str) or not isinstance(b.get("is_error", False), (bool, type(None))):
                raise BadRequest(f"{where}.content[{j}]: a tool_result needs 'tool_use_id' (a string)")
            out = _text(b.get("content", ""), f"{where}.content[{j}].content")
            msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                         "content": f"Error: {out}" if b.get("is_error") else out})
        if text:
            msgs.append({"role": "user", "content": "".join(text)})
    if turns[-1].get("role") == "assistant":
        raise BadRequest("messages: a final assistant turn (a prefill to continue) is not supported; end with a user turn")
    return msgs


def _assistant(content: list, where: str) -> dict:
    msg, text, calls = {"role": "assistant"}, [], []
    for j, b in enumerate(content):
        b = _block(b, f"{where}.content[{j}]", ("text", "tool_use", "thinking", "redacted_thinking"))
        if b["type"] == "text":
            text.append(_text([b], f"{where}.content"))
        elif b["type"] == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input"), dict):
                raise BadRequest(f"{where}.content[{j}]: a tool_use needs 'id', 'name' and 'input' (an object)")
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif b["type"] == "thinking" and isinstance(b.get("thinking"), str):  # templates that keep it read it
            msg["reasoning_content"] = msg.get("reasoning_content", "") + b["thinking"]
    msg["content"] = "".join(text) or (None if calls else "")
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(body: dict, out: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list of {\"name\", \"description\", \"input_schema\"}")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
                raise BadRequest(f"tools[{i}]: only client tools {{\"name\", \"description\", \"input_schema\"}} are "
                                 f"supported, got {t.get('type') if isinstance(t, dict) else t!r}")
            extra = sorted(set(t) - {"type", "name", "description", "input_schema", "cache_control"})
            if extra:
                raise BadRequest(f"tools[{i}].{extra[0]} is not supported")
            out["tools"].append({"type": "function", "function": {
                "name": t.get("name"), "parameters": t["input_schema"],
                **({"description": t["description"]} if t.get("description") is not None else {})}})
        out["tools"] = out["tools"] or None
    tc = body.get("tool_choice")
    if tc is None:
        return
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if not isinstance(tc, dict) or not (tc.get("type") in kinds or tc.get("type") == "tool" and isinstance(
            tc.get("name"), str)) or set(tc) - {"type", "name", "disable_parallel_tool_use"}:
        raise BadRequest("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\"}")
    out["tool_choice"] = kinds.get(tc["type"]) or {"type": "function", "function": {"name": tc["name"]}}
    if tc.get("disable_parallel_tool_use") is not None:
        out["parallel_tool_calls"] = not tc["disable_parallel_tool_use"]


def _thinking(body: dict, out: dict) -> None:
    th, oc = body.get("thinking"), body.get("output_config")
    if th is not None:
        budget = th.get("budget_tokens", 1) if isinstance(th, dict) else None
        if not isinstance(th, dict) or th.get("type") not in ("enabled", "adaptive", "disabled") \
                or set(th) - {"type", "budget_tokens", "display"} or isinstance(budget, bool) or not isinstance(budget, int):
            raise BadRequest("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\"}, {\"type\": \"adaptive\"} "
                             "or {\"type\": \"disabled\"}")
        if th.get("display") not in (None, "summarized"):  # the whole thinking comes back, never less
            raise BadRequest("'thinking.display': only \"summarized\" (sparkq returns the thinking text as generated)")
        out["reasoning_effort"] = "none" if th["type"] == "disabled" else "medium"
    if oc is None:
        return
    efforts = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}  # chat's highest: high
    if not isinstance(oc, dict) or set(oc) - {"effort", "format"} or oc.get("effort") not in (None, *efforts):
        raise BadRequest("'output_config': only {\"effort\": low | medium | high | xhigh | max, \"format\"} is supported")
    if oc.get("effort") and out.get("reasoning_effort") != "none":
        out["reasoning_effort"] = efforts[oc["effort"]]
    fmt = oc.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or set(fmt) - {"type", "schema"}:
            raise BadRequest("'output_config.format' must be {\"type\": \"json_schema\", \"schema\"}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def to_chat(body: dict, count: bool = False) -> dict:
    """The chat-completions request a Messages request stands for (``count``: a count_tokens body,
    without max_tokens); BadRequest naming a field sparkq does not implement."""
    unknown = sorted(set(body) - (COUNT_FIELDS if count else FIELDS))
    if unknown:
        raise BadRequest(f"unsupported field '{unknown[0]}' (sparkq serve does not implement it)")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise BadRequest("'service_tier': only \"auto\" or \"standard_only\" (one tier here)")
    md = body.get("metadata")
    if md is not None and (not isinstance(md, dict) or set(md) - {"user_id"}
                           or not isinstance(md.get("user_id"), (str, type(None)))):
        raise BadRequest("'metadata': only {\"user_id\": a string} is supported")
    out = {k: body[k] for k in ("model", "stream", "temperature", "top_p", "top_k") if k in body}
    out["messages"] = _messages(body)
    if not count:
        mt = body.get("max_tokens")
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise BadRequest("'max_tokens' (an integer >= 1) is required")
        out["max_completion_tokens"] = mt
        stop = body.get("stop_sequences")
        if stop is not None:
            out["stop"] = stop if stop else None
    _tools(body, out)
    _thinking(body, out)
    return {k: v for k, v in out.items() if v is not None}


class Reply:
    """One reply as a Message: its content blocks, stop reason and usage, and (streamed) its events."""

    def __init__(self, app, req):
        self.app, self.req, self.id = app, req, _new("msg")
        self.content: list[dict] = []

    def message(self, stop_reason=None, stop_sequence=None, output_tokens=0) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.app.name, "content": self.content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": len(self.req.ids), "output_tokens": output_tokens}}

    def calls(self, content: str) -> tuple[str, list[dict]]:
        """the reply's text outside tool calls, and its tool_use blocks"""
        msg = {"content": content}
        calls = self.app._calls(self.req, msg) or []
        return msg["content"] or "", [{"type": "tool_use", "id": _new("toolu"), "name": c["function"]["name"],
                                       "input": json.loads(c["function"]["arguments"])} for c in calls]

    def stop(self, ev: dict, calls) -> tuple[str, str | None]:
        """(stop_reason, the stop sequence that ended the reply or None)"""
        if calls:
            return "tool_use", None
        if ev["finish"] == "length":
            return "max_tokens", None
        r, e = self.req, self.app.engine
        rest = e.tok.decode([t for t in r.new if t not in e.stop_ids])[r.sent:]  # the engine stopped at r.sent
        hit = next((s for s in r.stop if rest.startswith(s)), None)
        return ("stop_sequence", hit) if hit else ("end_turn", None)

    @staticmethod
    def event(kind: str, **fields) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n".encode()

    def open(self, block: dict) -> bytes:
        self.content.append(block)
        start = {**block, "input": {}} if block["type"] == "tool_use" else \
            {**block, block["type"]: "", **({"signature": ""} if block["type"] == "thinking" else {})}
        return self.event("content_block_start", index=len(self.content) - 1, content_block=start)

    def delta(self, text: str) -> bytes:
        block = self.content[-1]
        block[block["type"]] += text
        kind = block["type"] + "_delta"
        return self.event("content_block_delta", index=len(self.content) - 1, delta={"type": kind, block["type"]: text})


async def collect(app, req, q):
    """The whole Message (a JSONResponse), or None when the client left."""
    got = await app._gather([req], q)
    if not isinstance(got, tuple):
        return reshaped(got) if got is not None else None
    r, ((text,), _, (ev,)) = Reply(app, req), got
    reasoning, content = req.split.feed(text, last=True)
    content, calls = r.calls(content)
    if reasoning:
        r.content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        r.content.append({"type": "text", "text": content})
    r.content += calls
    return JSONResponse(r.message(*r.stop(ev, calls), ev["completion_tokens"]))


async def events(app, req, q):
    """The Message as server-sent events: message_start, each block's start / deltas / stop as the
    text grows (a reply that may call tools: its text at the end, then one tool_use block per
    call, its input as one input_json_delta), message_delta (stop reason, output tokens),
    message_stop."""
    r = Reply(app, req)
    yield r.event("message_start", message=r.message())
    yield r.event("ping")

    def grow(kind: str, text: str) -> bytes:
        out = b""
        if not r.content or r.content[-1]["type"] != kind:
            if r.content:
                out += r.event("content_block_stop", index=len(r.content) - 1)
            out += r.open({"type": kind, kind: ""})
        return out + r.delta(text)

    async for kind, part in reply_parts(req, q, r.calls):
        if kind == "error":
            yield r.event("error", error={"type": "api_error", "message": part})
            return
        if kind != "end":
            yield grow("thinking" if kind == "reasoning" else "text", part)
            continue
        ev, content, calls = part
        if content:
            yield grow("text", content)
        for call in calls:
            if r.content:
                yield r.event("content_block_stop", index=len(r.content) - 1)
            yield r.open(call)
            yield r.event("content_block_delta", index=len(r.content) - 1,
                          delta={"type": "input_json_delta", "partial_json": json.dumps(call["input"], ensure_ascii=False)})
        if r.content:
            yield r.event("content_block_stop", index=len(r.content) - 1)
        reason, seq = r.stop(ev, calls)
        yield r.event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                      usage={"output_tokens": ev["completion_tokens"]})
        yield r.event("message_stop")
        return


class MessagesAPI:
    """The App's /v1/messages routes (a mixin: ``self._auth``, ``self._body``, ``self._start``)."""

    def shaped(self, request, resp: JSONResponse) -> JSONResponse:
        """an error response of the App in Anthropic's shape on the Messages API's paths"""
        return reshaped(resp) if request.url.path.startswith("/v1/messages") else resp

    async def messages(self, request: Request):
        """Anthropic's Messages API over the chat path (anthropic.py)"""
        resp = await self._messages(request, count=False)
        self.metrics.requests.labels("messages", str(getattr(resp, "status_code", 200))).inc()
        return resp

    async def count_tokens(self, request: Request):
        """{"input_tokens"}: the prompt a Messages request renders, counted"""
        return await self._messages(request, count=True)

    async def _messages(self, request: Request, count: bool):
        if (bad := self._auth(request)) is not None:
            return reshaped(bad)
        try:
            body = await self._body(request, FIELDS)
            cbody = to_chat(body, count)
            unsupported(cbody, CHAT)
            if count:
                return JSONResponse({"input_tokens": len(self._prompts(cbody, chat=True)[0][0])})
        except BadRequest as e:
            msg = e.message
            for a, b in RENAMED.items():
                msg = msg.replace(a, b)
            return anthropic_error(e.status, msg)
        started = self._start(cbody, chat=True, names=RENAMED)
        if not isinstance(started, tuple):
            return reshaped(started)
        (req,), _, q, _ = started
        if body.get("stream"):
            return EventStream(events(self, req, q), lambda: self._gone([req], q))
        return Collected(collect(self, req, q), lambda: self._gone([req], q))
