"""The responses of ``sparkq serve``: a whole JSON completion or server-sent events, built from the
engine's events (text deltas, log-probabilities, the final one) with the reasoning split
(reasoning.py) and tool calls parsed (tools.py); a client that goes away frees its slot."""
from __future__ import annotations

import asyncio
import json

from starlette.responses import JSONResponse

from . import tools as tools_mod
from .protocol import error


class Responses:
    """The App's response builders (a mixin: ``self.engine``)."""

    def _gone(self, req, q) -> None:
        """the client disconnected: its slot is freed before the next step, the waiter woken"""
        if not req.done:
            self.engine.cancel(req)
        q.put_nowait({"gone": True})

    @staticmethod
    def _usage(ev: dict) -> dict:
        return {"prompt_tokens": ev["prompt_tokens"], "completion_tokens": ev["completion_tokens"],
                "total_tokens": ev["prompt_tokens"] + ev["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": ev.get("cached_tokens", 0)}}

    def _logprobs(self, entries: list, chat: bool, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for the tokens of ``entries`` (the engine's logprob events)"""
        if not entries:
            return None
        tok = self.engine.tok

        def one(t, lp):
            s = tok.decode([t])
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        if chat:
            return {"content": [{**one(e["id"], e["logprob"]), "top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                                for e in entries]}
        toks = [tok.decode([e["id"]]) for e in entries]
        offs = [offset + sum(len(x) for x in toks[:i]) for i in range(len(toks))]
        return {"tokens": toks, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{tok.decode([t]): lp for t, lp in e["top"]} for e in entries], "text_offset": offs}

    @staticmethod
    def _sse(body: dict) -> bytes:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    @staticmethod
    def _calls(req, msg: dict) -> list[dict] | None:
        """The reply's tool calls (OpenAI's form) parsed from its content, which keeps the rest"""
        if not req.tool:
            return None
        content, calls = req.tool["format"].parse(msg["content"])
        if not calls:
            return None
        msg["content"] = content
        return tools_mod.openai_calls(calls if req.tool["parallel"] else calls[:1])

    async def _collect(self, req, q, meta, chat):
        text, lps = [], []
        while True:
            ev = await q.get()
            if "gone" in ev:
                return None
            if "error" in ev:
                return error(503, ev["error"], type_="server_error")
            if "delta" in ev:
                text.append(ev["delta"])
                continue
            if "logprob" in ev:
                lps.append(ev["logprob"])
                continue
            out = "".join(text)
            choice = {"index": 0, "finish_reason": ev["finish"],
                      "logprobs": self._logprobs(lps, chat) if req.logprobs is not None else None}
            if chat:
                reasoning, content = req.split.feed(out, last=True)
                msg = {"role": "assistant", "content": content}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                calls = self._calls(req, msg)
                if calls:
                    msg["tool_calls"] = calls
                    choice["finish_reason"] = "tool_calls"
                choice["message"] = msg
            else:
                choice["text"] = out
            return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                                 "usage": self._usage(ev)})

    async def _chunks(self, req, q, meta, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        pending: list = []  # logprob events not yet sent with a chunk
        held: list = []  # a reply that may call tools: its content until the end
        sent = 0  # characters of text sent (completions' text_offset)

        def chunk(delta: str | None, finish=None, role=False, reasoning: str = ""):
            nonlocal pending, sent
            lp = self._logprobs(pending, chat, sent) if req.logprobs is not None and not role else None
            if lp is not None:
                pending = []
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                if reasoning:
                    d["reasoning_content"] = reasoning
                c = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": lp}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": lp}
            sent += len(delta or "")
            body = {**meta, "object": obj, "choices": [c]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

        if chat:
            yield chunk(None, role=True)
        while True:
            ev = await q.get()
            if "gone" in ev:
                return
            if "error" in ev:
                yield f"data: {json.dumps({'error': {'message': ev['error'], 'type': 'server_error'}})}\n\n".encode()
                return
            if "logprob" in ev:
                pending.append(ev["logprob"])
                continue
            if "delta" in ev:
                if not chat:
                    yield chunk(ev["delta"])
                    continue
                reasoning, content = req.split.feed(ev["delta"])
                if req.tool:  # a reply that may call tools: its content is parsed at the end
                    held.append(content)
                    content = ""
                if reasoning or content or pending:
                    yield chunk(content, reasoning=reasoning)
                continue
            finish = ev["finish"]
            if chat:
                reasoning, content = req.split.feed("", last=True)
                if req.tool:
                    msg = {"content": "".join(held) + content}
                    calls = self._calls(req, msg)
                    content = msg["content"] or ""
                    if reasoning or content:
                        yield chunk(content, reasoning=reasoning)
                    if calls:  # one delta per call: its id, name and whole arguments
                        for i, cl in enumerate(calls):
                            yield self._sse({**meta, "object": obj, "choices": [{"index": 0, "finish_reason": None,
                                             "logprobs": None, "delta": {"tool_calls": [{"index": i, **cl}]}}],
                                             **({"usage": None} if include_usage else {})})
                        finish = "tool_calls"
                elif reasoning or content:
                    yield chunk(content, reasoning=reasoning)
            yield chunk(None, finish)
            if include_usage:
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': self._usage(ev)})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return


async def _watch_disconnect(receive, on_gone) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            on_gone()
            return


class EventStream:
    """An SSE response that watches the connection: a disconnect cancels the request at once,
    whether or not a token is being written."""

    def __init__(self, chunks, on_gone):
        self.chunks, self.on_gone = chunks, on_gone

    async def __call__(self, scope, receive, send):
        watcher = asyncio.create_task(_watch_disconnect(receive, self.on_gone))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                    (b"x-accel-buffering", b"no")]})
            async for data in self.chunks:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote
            self.on_gone()
        finally:
            watcher.cancel()
            await self.chunks.aclose()


class Collected:
    """A non-streaming response: waits for the whole completion, cancelled if the client leaves."""

    def __init__(self, result, on_gone):
        self.result, self.on_gone = result, on_gone

    async def __call__(self, scope, receive, send):
        watcher = asyncio.create_task(_watch_disconnect(receive, self.on_gone))
        try:
            resp = await self.result
        finally:
            watcher.cancel()
        if resp is None:  # nobody is listening; complete the exchange all the same
            resp = error(400, "the client closed the request", code="client_closed")
        try:
            await resp(scope, receive, send)
        except OSError:
            pass
