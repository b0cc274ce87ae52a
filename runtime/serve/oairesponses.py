"""OpenAI's Responses API (``POST /v1/responses``), what the OpenAI Agents SDK and Codex send: the
request is translated into a chat request (``to_chat``) and runs through the same checks, template,
grammars, tool parsing and engine as /v1/chat/completions; the result comes back as a Response
object or its stream of typed events.

Input: a string or items: messages (text parts), ``function_call`` and ``function_call_output``
items (the history of tool calls), ``reasoning`` items (dropped: the template re-renders earlier
turns without them, as Qwen3's does); ``instructions`` as the first system message; function
``tools`` and ``tool_choice``; ``text.format`` (json_object / json_schema); ``reasoning.effort`` (the
thinking switch, as chat's reasoning_effort); ``max_output_tokens`` and the sampling controls.
Output: a ``reasoning`` item (the <think> text), a ``message`` with one ``output_text`` part, and a
``function_call`` item per call. Nothing is stored (``store`` is accepted; ``previous_response_id``,
``conversation`` and ``background`` need a store and are refused by name)."""
from __future__ import annotations

import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from .protocol import CHAT, INFORMATIONAL, REASONING_EFFORTS, BadRequest, error, unsupported
from .responses import Collected, EventStream, reply_parts

SAMPLING = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "logit_bias", "seed", "stop", "ignore_eos"}  # (beyond OpenAI's two, as chat takes them)
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens", "text",
          "reasoning", "stream", "stream_options", "include", "truncation"} | SAMPLING | set(INFORMATIONAL)
NEEDS_STORE = {"previous_response_id", "conversation", "background", "prompt"}
# chat's names in the chat path's errors, as a Responses request calls them (longest first)
RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format.json_schema": "text.format", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort", "messages": "input"}


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text(content, where: str, kinds=("input_text", "output_text", "text")) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of text parts", where)
    out = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in kinds or not isinstance(p.get("text"), str):
            raise BadRequest(f"{where}.content[{j}]: only text parts ({', '.join(kinds[:2])}) are supported", where)
        out.append(p["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    msgs = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise BadRequest("'instructions' must be a string", "instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role must be user, system, developer or assistant, got {role!r}", where)
            msgs.append({"role": role, "content": _text(it.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("arguments"), str):
                raise BadRequest(f"{where}: a function_call needs 'name' and 'arguments' (a JSON string)", where)
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)  # parallel calls of one turn
            elif msgs and msgs[-1]["role"] == "assistant" and "tool_calls" not in msgs[-1]:
                msgs[-1]["tool_calls"] = [call]  # the turn's text, then its calls
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"),
                         "content": _text(it.get("output"), where, ("input_text", "output_text", "text"))})
        elif kind == "reasoning":
            continue
        else:
            raise BadRequest(f"{where}: input items of type {kind!r} are not supported (messages, function_call, "
                             "function_call_output, reasoning)", where)
    return msgs


def to_chat(body: dict) -> dict:
    """The chat-completions request a Responses request stands for (BadRequest naming a field sparkq
    does not implement)."""
    for name in sorted(NEEDS_STORE & set(body)):
        if body[name] not in (None, False):
            raise BadRequest(f"'{name}' needs responses stored on the server, which sparkq does not do: send the "
                             "whole conversation as 'input' items", name)
    unknown = sorted(set(body) - FIELDS - NEEDS_STORE)
    if unknown:
        raise BadRequest(f"unsupported field '{unknown[0]}' (sparkq serve does not implement it)", unknown[0])
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequest("'truncation': only \"disabled\" (a prompt beyond the context is an error)", "truncation")
    if body.get("include") is not None and not isinstance(body["include"], list):
        raise BadRequest("'include' must be a list", "include")
    out = {k: body[k] for k in SAMPLING | set(INFORMATIONAL) | {"model", "stream", "parallel_tool_calls"} if k in body}
    out["messages"] = _messages(body)
    mt = body.get("max_output_tokens")
    if mt is not None:
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise BadRequest("'max_output_tokens' must be an integer >= 1", "max_output_tokens")
        out["max_completion_tokens"] = mt
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list", "tools")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise BadRequest(f"tools[{i}]: only function tools are supported, got "
                                 f"{t.get('type') if isinstance(t, dict) else t!r}", "tools")
            out["tools"].append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                                     "strict") if k in t}})
    tc = body.get("tool_choice")
    if isinstance(tc, str) and tc not in ("auto", "none", "required"):
        tc = {}
    if isinstance(tc, dict):
        if tc.get("type") != "function" or not isinstance(tc.get("name"), str):
            raise BadRequest("'tool_choice': \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\"}",
                             "tool_choice")
        tc = {"type": "function", "function": {"name": tc["name"]}}
    if tc is not None:
        out["tool_choice"] = tc
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None,):
            raise BadRequest("'text': only 'format' is supported", "text")
        fmt = text.get("format") or {"type": "text"}
        if not isinstance(fmt, dict):
            raise BadRequest("'text.format' must be an object", "text.format")
        if fmt.get("type") == "json_schema":
            out["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        elif fmt.get("type") in ("json_object", "text"):
            out["response_format"] = {"type": fmt["type"]}
        else:
            raise BadRequest("'text.format.type' must be text, json_object or json_schema", "text.format")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise BadRequest("'reasoning': only {\"effort\"} is supported", "reasoning")
        if reasoning.get("effort") not in (None, *REASONING_EFFORTS):
            raise BadRequest(f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning.effort")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    return out


class Reply:
    """One reply's Response object, built from the engine's events (for the stream: the items and
    their events as they grow)."""

    def __init__(self, app, req, body: dict, meta: dict):
        self.app, self.req, self.body = app, req, body
        self.id, self.created = _new("resp"), meta["created"]
        self.output: list[dict] = []
        self.seq = 0

    def response(self, status: str, usage=None, incomplete=None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.app.name, "output": self.output, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
                "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
                "temperature": b.get("temperature"), "top_p": b.get("top_p"), "tool_choice": b.get("tool_choice", "auto"),
                "tools": b.get("tools") or [], "max_output_tokens": b.get("max_output_tokens"),
                "text": b.get("text") or {"format": {"type": "text"}}, "reasoning": b.get("reasoning"),
                "store": False, "truncation": "disabled", "usage": usage}

    @staticmethod
    def usage(ev: dict) -> dict:
        return {"input_tokens": ev["prompt_tokens"], "input_tokens_details": {"cached_tokens": ev.get("cached_tokens", 0)},
                "output_tokens": ev["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": ev["prompt_tokens"] + ev["completion_tokens"]}

    def event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        body = {"type": kind, "sequence_number": self.seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    # -- the items --

    def open_item(self, kind: str) -> tuple[dict, bytes]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _new("rs"), "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"type": "message", "id": _new("msg"), "role": "assistant", "status": "in_progress", "content": []}
        self.output.append(item)
        i = len(self.output) - 1
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out = self.event("response.output_item.added", output_index=i, item=dict(item, content=[]))
        item["content"].append(part)
        out += self.event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part)
        return item, out

    def delta(self, item: dict, text: str) -> bytes:
        i = self.output.index(item)
        item["content"][0]["text"] += text
        kind = "response.reasoning_text.delta" if item["type"] == "reasoning" else "response.output_text.delta"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return self.event(kind, item_id=item["id"], output_index=i, content_index=0, delta=text, **extra)

    def close_item(self, item: dict) -> bytes:
        i, part = self.output.index(item), item["content"][0]
        item["status"] = "completed"
        kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return (self.event(kind, item_id=item["id"], output_index=i, content_index=0, text=part["text"], **extra)
                + self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part)
                + self.event("response.output_item.done", output_index=i, item=item))

    def calls(self, content: str) -> tuple[str, list[dict]]:
        """the reply's text outside tool calls, and its function_call items"""
        msg = {"content": content}
        calls = self.app._calls(self.req, msg)
        return msg["content"] or "", [{"type": "function_call", "id": _new("fc"), "call_id": c["id"],
                                       "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                                       "status": "completed"} for c in calls or []]


async def collect(app, req, q, body: dict, meta: dict):
    """The whole Response (a JSONResponse), or None when the client left."""
    got = await app._gather([req], q)
    if not isinstance(got, tuple):
        return got
    r, ((text,), _, (ev,)) = Reply(app, req, body, meta), got
    reasoning, content = req.split.feed(text, last=True)
    content, calls = r.calls(content)
    if reasoning:
        r.output.append({"type": "reasoning", "id": _new("rs"), "summary": [], "status": "completed",
                         "content": [{"type": "reasoning_text", "text": reasoning}]})
    if content or not calls:
        r.output.append({"type": "message", "id": _new("msg"), "role": "assistant", "status": "completed",
                         "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]})
    r.output += calls
    cut = ev["finish"] == "length" and not calls
    return JSONResponse(r.response("incomplete" if cut else "completed", r.usage(ev), "max_output_tokens" if cut else None))


async def events(app, req, q, body: dict, meta: dict):
    """The Response as server-sent events: created, in_progress, each item's added / delta / done
    events as the text grows (a reply that may call tools: its text at the end, then one
    function_call item per call), then completed or incomplete."""
    r = Reply(app, req, body, meta)
    yield r.event("response.created", response=r.response("in_progress"))
    yield r.event("response.in_progress", response=r.response("in_progress"))
    items: dict[str, dict] = {}  # the open reasoning / message item

    def grow(kind: str, text: str) -> bytes:
        out = b""
        if kind == "message" and "reasoning" in items:  # the thinking ended
            out += r.close_item(items.pop("reasoning"))
        if kind not in items:
            items[kind], opened = r.open_item(kind)
            out += opened
        return out + r.delta(items[kind], text)

    async for kind, part in reply_parts(req, q, r.calls):
        if kind == "error":
            yield r.event("error", code="server_error", message=part, param=None)
            return
        if kind != "end":
            yield grow("message" if kind == "content" else "reasoning", part)
            continue
        ev, content, calls = part
        if content or (not calls and "message" not in items):
            yield grow("message", content)
        for kind in ("reasoning", "message"):
            if kind in items:
                yield r.close_item(items.pop(kind))
        for call in calls:
            i = len(r.output)
            r.output.append(call)
            yield r.event("response.output_item.added", output_index=i, item=dict(call, arguments="", status="in_progress"))
            yield r.event("response.function_call_arguments.delta", item_id=call["id"], output_index=i,
                          delta=call["arguments"])
            yield r.event("response.function_call_arguments.done", item_id=call["id"], output_index=i,
                          name=call["name"], arguments=call["arguments"])
            yield r.event("response.output_item.done", output_index=i, item=call)
        cut = ev["finish"] == "length" and not calls
        yield r.event("response.incomplete" if cut else "response.completed",
                      response=r.response("incomplete" if cut else "completed", r.usage(ev),
                                          "max_output_tokens" if cut else None))
        return


class ResponsesAPI:
    """The App's /v1/responses route (a mixin: ``self._auth``, ``self._body``, ``self._start``)."""

    async def responses(self, request: Request):
        """OpenAI's Responses API over the chat path (oairesponses.py)"""
        resp = None
        if (bad := self._auth(request)) is not None:
            resp = bad
        else:
            try:
                body = await self._body(request, FIELDS | NEEDS_STORE)
                cbody = to_chat(body)
                unsupported(cbody, CHAT)
            except BadRequest as e:
                resp = error(e.status, e.message, e.param, e.code, e.type)
        if resp is None:
            started = self._start(cbody, chat=True, names=RENAMED)
            if not isinstance(started, tuple):
                resp = started
            else:
                (req,), _, q, meta = started
                stream = events(self, req, q, body, meta) if body.get("stream") else None
                resp = (EventStream(stream, lambda: self._gone([req], q)) if stream else
                        Collected(collect(self, req, q, body, meta), lambda: self._gone([req], q)))
        self.metrics.requests.labels("responses", str(getattr(resp, "status_code", 200))).inc()
        return resp
