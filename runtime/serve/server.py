"""``sparkq serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

Starlette (routing, requests, JSON responses) on uvicorn: a small, well-kept ASGI pair with no
validation framework to pull in (FastAPI would add pydantic for a handful of fields, checked
here by hand so every refusal names its field). The model runs on the torch-free runtime; the
engine (engine.py) runs on its own thread, and each request's events cross to the event loop
through an asyncio queue.

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions;
streaming as server-sent events ending in ``data: [DONE]``. Errors use OpenAI's shape
{"error": {"message", "type", "param", "code"}}: 400 malformed or unsupported, 401 bad key,
404 unknown model or route, 413 body too large, 429 queue full, 503 engine failed. A client that
disconnects frees its slot before the next decode step.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..common import DEFAULT_KV_DTYPE, check_kv_dtype
from ..errors import RuntimeUserError
from .engine import Engine, QueueFull
from .engine import Request as GenRequest

from .protocol import CHAT, COMPLETION, MAX_BODY, MAX_STOP, BadRequest, error, message_text, number, unsupported


class App:
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None):
        self.engine, self.name, self.api_key = engine, model_name, api_key
        self.created = int(time.time())
        gen = getattr(engine.tok, "generation_config", None) or {}
        # requests that leave sampling unset get generation_config.json's choice (greedy without do_sample)
        if gen.get("do_sample"):
            self.defaults = {"temperature": float(gen.get("temperature", 1.0)), "top_p": float(gen.get("top_p", 1.0))}
        elif gen:
            self.defaults = {"temperature": 0.0, "top_p": 1.0}
        else:
            self.defaults = {"temperature": 1.0, "top_p": 1.0}  # OpenAI's defaults
        routes = [Route("/health", self.health, methods=["GET"]), Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        self.asgi = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                 Exception: self._crash})

    async def _http_error(self, request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)

    async def _crash(self, request, exc):
        return error(500, f"internal error: {exc.__class__.__name__}: {exc}", type_="server_error")

    def _auth(self, request: Request) -> JSONResponse | None:
        if not self.api_key:
            return None
        h = request.headers.get("authorization", "")
        key = h[7:] if h.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(key.encode(), self.api_key.encode()):
            return error(401, "invalid or missing API key: send Authorization: Bearer KEY", code="invalid_api_key")
        return None

    async def health(self, request: Request):
        if self.engine.error is not None:
            return error(503, f"the engine failed: {self.engine.error}", type_="server_error")
        return JSONResponse({"status": "ok", **self.engine.load()})

    async def models(self, request: Request):
        if (bad := self._auth(request)) is not None:
            return bad
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                                         "owned_by": "sparkq"}]})

    async def _body(self, request: Request, allowed: set) -> dict:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise BadRequest(f"the request body is over {MAX_BODY >> 20} MiB", status=413)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("'model' (a string) is required", "model")
        if model != self.name:
            raise BadRequest(f"the model '{model}' does not exist; this server serves '{self.name}' (GET /v1/models)",
                             "model", status=404, code="model_not_found")
        unsupported(body, allowed)
        return body

    def _sampling(self, body: dict, max_field: str) -> dict:
        mt = body.get(max_field)
        if mt is None:  # chat: max_completion_tokens, else the older max_tokens
            mt, max_field = body.get("max_tokens"), "max_tokens"
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
            raise BadRequest(f"'{max_field}' must be an integer >= 1", max_field)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("'seed' must be an integer", "seed")
        top_p = number(body, "top_p", 0.0, 1.0, self.defaults["top_p"])
        if top_p <= 0:
            raise BadRequest("'top_p' must be in (0, 1]", "top_p")
        so = body.get("stream_options")
        if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}):
            raise BadRequest("'stream_options' supports only include_usage", "stream_options")
        for f in ("stream", "ignore_eos"):
            if body.get(f) not in (None, True, False):
                raise BadRequest(f"'{f}' must be a boolean", f)
        return {"max_tokens": mt, "temperature": float(number(body, "temperature", 0.0, 2.0, self.defaults["temperature"])),
                "top_p": float(top_p), "seed": seed, "stop": stop, "ignore_eos": bool(body.get("ignore_eos"))}

    async def chat(self, request: Request):
        return await self._handle(request, chat=True)

    async def completions(self, request: Request):
        return await self._handle(request, chat=False)

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        tok = self.engine.tok
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("'messages' must be a non-empty list", "messages")
            return tok.encode_chat([message_text(m, i) for i, m in enumerate(msgs)])
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return tok.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            vocab = self.engine.session.embed_rows
            if min(p) < 0 or max(p) >= vocab:
                raise BadRequest(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
            return list(p)
        raise BadRequest("'prompt' must be a string, a list of token ids, or a list of one of them "
                         "(one prompt per request)", "prompt")

    async def _handle(self, request: Request, chat: bool):
        if (bad := self._auth(request)) is not None:
            return bad
        try:
            body = await self._body(request, CHAT if chat else COMPLETION)
            kw = self._sampling(body, "max_completion_tokens" if chat else "max_tokens")
            ids = self._prompt_ids(body, chat)
            kw["max_tokens"] = self.engine.check(len(ids), kw["max_tokens"])
        except BadRequest as e:
            return error(e.status, e.message, e.param, e.code, e.type)
        except RuntimeUserError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            return error(400, str(e), "messages" if chat else "prompt", code)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req = GenRequest(ids, kw["max_tokens"], lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev),
                         temperature=kw["temperature"], top_p=kw["top_p"], seed=kw["seed"], stop=kw["stop"],
                         ignore_eos=kw["ignore_eos"])
        try:
            self.engine.submit(req)
        except QueueFull as e:
            return error(429, f"the server is busy: {e}; retry later", code="queue_full", type_="rate_limit_exceeded")
        except RuntimeError as e:
            return error(503, str(e), type_="server_error")
        except RuntimeUserError as e:
            return error(400, str(e), "messages" if chat else "prompt", "context_length_exceeded")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "created": int(time.time()), "model": self.name}
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return EventStream(self._chunks(req, q, meta, chat, usage), lambda: self._gone(req, q))
        return Collected(self._collect(req, q, meta, chat), lambda: self._gone(req, q))

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

    async def _collect(self, req, q, meta, chat):
        text = []
        while True:
            ev = await q.get()
            if "gone" in ev:
                return None
            if "error" in ev:
                return error(503, ev["error"], type_="server_error")
            if "delta" in ev:
                text.append(ev["delta"])
                continue
            out = "".join(text)
            choice = {"index": 0, "finish_reason": ev["finish"], "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": out}} if chat else {"text": out})
            return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                                 "usage": self._usage(ev)})

    async def _chunks(self, req, q, meta, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish=None, role=False):
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
                c = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
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
            if "delta" in ev:
                yield chunk(ev["delta"])
                continue
            yield chunk(None, ev["finish"])
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


def serve(model_path: str, *, host: str, port: int, parallel: int, api_key: str | None, kv_budget_mib: float,
          max_model_len: int | None, threads: int | None, model_name: str | None, max_queue: int, echo=print,
          kv_dtype: str = DEFAULT_KV_DTYPE, prefix_cache: bool = True) -> None:
    import socket

    import uvicorn

    from ..lite import load

    # bind first: a taken port is a one-line error before the model loads
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeUserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    check_kv_dtype(kv_dtype)  # before binding: a bad flag is a one-line error either way
    m = load(model_path, max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads, slots=parallel,
             kv_dtype=kv_dtype)
    if m.tokenizer is None:
        raise RuntimeUserError(f"{model_path}: no tokenizer.json; the server needs the model's tokenizer")
    engine = Engine(m, max_queue=max_queue, prefix_cache=prefix_cache)
    name = model_name or (m.info.extra.get("hub") or {}).get("repo") or str(model_path).rstrip("/").split("/")[-1]
    app = App(engine, name, api_key)
    echo(f"sparkq serve: {name} on http://{host}:{port}/v1 ({parallel} slots x {engine.slot_cap} tokens, {kv_dtype} KV, "
         f"{m.session.threads} threads{', prefix cache off' if not prefix_cache else ''}"
         f"{', API key required' if api_key else ''})")
    try:  # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal
        uvicorn.Server(uvicorn.Config(app.asgi, host=host, port=port, log_level="warning", access_log=False)).run(
            sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
    echo("sparkq serve: stopped")
