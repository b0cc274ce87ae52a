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
    """The App's response builders (a mixin: ``self.engine``). A response holds one or more
    choices (n, a batch of prompts), each an engine request with its ``index``; their events
    arrive on one queue as (index, event)."""

    def _gone(self, reqs, q) -> None:
        """the client disconnected: the slots are freed before the next step, the waiter woken"""
        for req in reqs:
            if not req.done:
                self.engine.cancel(req)
        q.put_nowait((None, {"gone": True}))

    @staticmethod
    def _usage(finals: list, n: int) -> dict:
        """token counts of the final events, choices in index order: a prompt counted once for its n
        choices (as OpenAI bills n), the completions of all"""
        first = finals[::n]
        prompt, done = sum(f["prompt_tokens"] for f in first), sum(f["completion_tokens"] for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": sum(f.get("cached_tokens", 0) for f in first)}}

    def _logprobs(self, entries: list, chat: bool, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for the tokens of ``entries`` (the engine's logprob events; an
        echoed prompt's first token has none: null, as OpenAI gives it)"""
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
                "top_logprobs": [None if e["top"] is None else {tok.decode([t]): lp for t, lp in e["top"]} for e in entries],
                "text_offset": offs}

    @staticmethod
    def _sse(body: dict) -> bytes:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    @staticmethod
    def _calls(req, msg: dict) -> list[dict] | None:
        """The reply's tool calls (OpenAI's form) parsed from its content, which keeps the rest (less
        any calls the format drops: Spark2_5's of unknown functions)"""
        if not req.tool:
            return None
        msg["content"], calls = req.tool["format"].parse(msg["content"])
        if not calls:
            return None
        return tools_mod.openai_calls(calls if req.tool["parallel"] else calls[:1])

    @staticmethod
    async def _gather(reqs, q):
        """Every request's events to its end: (texts, logprob entries — an echoed prompt's first —,
        final events), or an error response, or None when the client left."""
        text, lps, finals = [[] for _ in reqs], [[] for _ in reqs], [None] * len(reqs)
        while any(f is None for f in finals):
            i, ev = await q.get()
            if "gone" in ev:
                return None
            if "error" in ev:
                return error(503, ev["error"], type_="server_error")
            if "delta" in ev:
                text[i].append(ev["delta"])
            elif "logprob" in ev or "prompt_logprob" in ev:
                lps[i].append(ev.get("logprob") or ev["prompt_logprob"])
            else:
                finals[i] = ev
        return ["".join(t) for t in text], lps, finals

    async def _collect(self, reqs, n, q, meta, chat):
        got = await self._gather(reqs, q)
        if not isinstance(got, tuple):
            return got
        texts, lps, finals = got
        choices = []
        for i, (req, out, ev) in enumerate(zip(reqs, texts, finals)):
            choice = {"index": i, "finish_reason": ev["finish"],
                      "logprobs": self._logprobs(lps[i], chat) if req.logprobs is not None else None}
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
                choice["text"] = (req.echo or "") + out
            choices.append(choice)
        return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                             "usage": self._usage(finals, n)})

    async def _chunks(self, reqs, n, q, meta, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"
        pending = [[] for _ in reqs]  # logprob events not yet sent with a chunk
        held = [[] for _ in reqs]  # a reply that may call tools: its content until the end
        sent = [0] * len(reqs)  # characters of text sent (completions' text_offset)
        echoed = [r.echo is None for r in reqs]  # an echoed prompt goes out before its choice's first text
        finals = [None] * len(reqs)

        def chunk(i, delta: str | None, finish=None, role=False, reasoning: str = ""):
            lp = self._logprobs(pending[i], chat, sent[i]) if reqs[i].logprobs is not None and not role else None
            if lp is not None:
                pending[i] = []
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                if reasoning:
                    d["reasoning_content"] = reasoning
                c = {"index": i, "delta": d, "finish_reason": finish, "logprobs": lp}
            else:
                c = {"index": i, "text": delta or "", "finish_reason": finish, "logprobs": lp}
            sent[i] += len(delta or "")
            body = {**meta, "object": obj, "choices": [c]}
            if include_usage:
                body["usage"] = None
            return self._sse(body)

        if chat:
            for i in range(len(reqs)):
                yield chunk(i, None, role=True)
        while any(f is None for f in finals):
            i, ev = await q.get()
            if "gone" in ev:
                return
            if "error" in ev:
                yield self._sse({"error": {"message": ev["error"], "type": "server_error"}})
                return
            if "prompt_logprob" in ev:
                pending[i].append(ev["prompt_logprob"])
                continue
            if not echoed[i]:  # the prompt's text (and log-probabilities) before anything of the completion
                echoed[i] = True
                yield chunk(i, reqs[i].echo)
            if "logprob" in ev:
                pending[i].append(ev["logprob"])
                continue
            req = reqs[i]
            if "delta" in ev:
                if not chat:
                    yield chunk(i, ev["delta"])
                    continue
                reasoning, content = req.split.feed(ev["delta"])
                if req.tool:  # a reply that may call tools: its content is parsed at the end
                    held[i].append(content)
                    content = ""
                if reasoning or content or pending[i]:
                    yield chunk(i, content, reasoning=reasoning)
                continue
            finals[i], finish = ev, ev["finish"]
            if chat:
                reasoning, content = req.split.feed("", last=True)
                if req.tool:
                    msg = {"content": "".join(held[i]) + content}
                    calls = self._calls(req, msg)
                    content = msg["content"] or ""
                    if reasoning or content:
                        yield chunk(i, content, reasoning=reasoning)
                    if calls:  # one delta per call: its id, name and whole arguments
                        for k, cl in enumerate(calls):
                            yield self._sse({**meta, "object": obj, "choices": [{"index": i, "finish_reason": None,
                                             "logprobs": None, "delta": {"tool_calls": [{"index": k, **cl}]}}],
                                             **({"usage": None} if include_usage else {})})
                        finish = "tool_calls"
                elif reasoning or content:
                    yield chunk(i, content, reasoning=reasoning)
            yield chunk(i, None, finish)
        if include_usage:
            yield self._sse({**meta, "object": obj, "choices": [], "usage": self._usage(finals, n)})
        yield b"data: [DONE]\n\n"


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


async def reply_parts(req, q, calls_of):
    """One streamed chat reply's parts as its events arrive (the Responses and Messages APIs' event
    loops): ("reasoning", text) and ("content", text) as they grow (a reply that may call tools
    holds its content to the end), then ("end", (final event, content, tool calls)), or ("error",
    message); nothing more once the client went away. calls_of(text) -> (content, calls)."""
    held: list[str] = []
    while True:
        _, ev = await q.get()
        if "gone" in ev:
            return
        if "error" in ev:
            yield "error", ev["error"]
            return
        if "delta" not in ev and "finish" not in ev:
            continue
        last = "finish" in ev
        reasoning, content = req.split.feed("" if last else ev["delta"], last=last)
        if reasoning:
            yield "reasoning", reasoning
        if req.tool:  # its text is parsed at the end
            held.append(content)
        elif content and not last:
            yield "content", content
        if last:
            content, calls = calls_of("".join(held)) if req.tool else (content, [])
            yield "end", (ev, content, calls)
            return
