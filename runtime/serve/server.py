"""``sparkq serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

Starlette (routing, requests, JSON responses) on uvicorn: a small, well-kept ASGI pair with no
validation framework to pull in (FastAPI would add pydantic for a handful of fields, checked
here by hand so every refusal names its field). The model runs on the torch-free runtime; the
engine (engine.py) runs on its own thread, and each request's events cross to the event loop
through an asyncio queue.

Endpoints: GET /health, GET /v1/models[/{id}], POST /v1/chat/completions, POST /v1/completions, POST /v1/responses
(oairesponses.py), POST /v1/messages[/count_tokens] (Anthropic's, anthropic.py), POST /v1/embeddings, /v1/rerank
(embed.py), POST /tokenize, /detokenize, GET /tokenizer_info (tokenize.py), GET /metrics (metrics.py), GET / (the
chat page, static/index.html); streaming as server-sent events ending in ``data: [DONE]`` (responses.py). Requests carry every sampling control
(sampling.py), ``response_format`` json_object / json_schema and ``tools`` (structured.py, tools.py), logprobs and
``chat_template_kwargs``; reasoning models' <think> comes back as ``reasoning_content``. A response holds n
choices per prompt (completions: a batch of prompts), each its own engine request; echo returns the prompt with
its log-probabilities. Errors use OpenAI's shape (the Messages API: Anthropic's) {"error": {"message", "type",
"param", "code"}}: 400 malformed or unsupported, 401 bad key, 404 unknown model or route, 413 body too large, 429
queue full, 503 engine failed. A client that disconnects frees its slot before the next decode step.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import signal
import threading
import time
import uuid
from dataclasses import replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from ..common import DEFAULT_KV_DTYPE, check_kv_dtype
from ..errors import RuntimeUserError
from ..sampling import SamplingParams
from .engine import Engine, QueueFull
from .request import Request as GenRequest
from . import tools as tools_mod
from .reasoning import ReasoningSplitter, opened_in_prompt
from .responses import Collected, EventStream, Responses
from .structured import response_format_schema
from .tokenize import Tokenize
from .oairesponses import ResponsesAPI
from .anthropic import MessagesAPI
from .embed import EmbedAPI
from .protocol import (CHAT, COMPLETION, MAX_BODY, MAX_STOP, BadRequest, error, message_text, number, thinking_kwargs,
                       unsupported)
from .protocol import error as error_response


class App(Responses, Tokenize, ResponsesAPI, MessagesAPI, EmbedAPI):
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None, cors_origins=()):
        self.engine, self.name, self.api_key = engine, model_name, api_key
        from .metrics import Metrics
        self.metrics = engine.metrics = Metrics(engine)
        self._grammars = None
        self.created = int(time.time())
        gen = getattr(engine.tok, "generation_config", None) or {}
        # requests that leave sampling unset get generation_config.json's choice (greedy without do_sample)
        # and its top_k / repetition_penalty (Qwen3's top_k 20), which OpenAI's clients never send
        if gen.get("do_sample"):
            self.defaults = {"temperature": float(gen.get("temperature", 1.0)), "top_p": float(gen.get("top_p", 1.0))}
        elif gen:
            self.defaults = {"temperature": 0.0, "top_p": 1.0}
        else:
            self.defaults = {"temperature": 1.0, "top_p": 1.0}  # OpenAI's defaults
        self.defaults.update(top_k=int(gen.get("top_k") or 0) if gen.get("do_sample") else 0,
                             repetition_penalty=float(gen.get("repetition_penalty") or 1.0))
        routes = [Route("/health", self.health, methods=["GET"]), Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]), Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/responses", self.responses, methods=["POST"]),
                  Route("/v1/messages", self.messages, methods=["POST"]), Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]), Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]), *self.embed_routes(),
                  Route("/metrics", self.metrics_page, methods=["GET"]), Route("/", self.page, methods=["GET"])]
        middleware = []
        if cors_origins:  # a web app on another origin may call the API (--cors-origin)
            from starlette.middleware import Middleware
            from starlette.middleware.cors import CORSMiddleware
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                         allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"]))
        self.asgi = Starlette(routes=routes, middleware=middleware,
                              exception_handlers={HTTPException: self._http_error, Exception: self._crash})

    async def _http_error(self, request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return self.shaped(request, error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))

    async def _crash(self, request, exc):
        return self.shaped(request, error(500, f"internal error: {exc.__class__.__name__}: {exc}", type_="server_error"))

    def _auth(self, request: Request) -> JSONResponse | None:
        if not self.api_key:
            return None
        h = request.headers.get("authorization", "")
        key = h[7:] if h.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.encode(), self.api_key.encode()):
            return error(401, "invalid or missing API key: send Authorization: Bearer KEY or x-api-key: KEY", code="invalid_api_key")
        return None

    def grammars(self):
        """the grammar compiler over the model's tokenizer (built on the first structured request)"""
        if self._grammars is None:
            from .structured import Grammars
            self._grammars = Grammars(self.engine.tok, self.engine.session.vocab)
        return self._grammars

    async def metrics_page(self, request: Request):
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def page(self, request: Request):
        """The chat page (static/index.html, shipped in the wheel): it streams from /v1/chat/completions."""
        from importlib.resources import files
        return HTMLResponse((files("sparkq.runtime.serve") / "static" / "index.html").read_text())

    async def health(self, request: Request):
        if self.engine.error is not None:
            return error(503, f"the engine failed: {self.engine.error}", type_="server_error")
        return JSONResponse({"status": "ok", **self.engine.load()})

    async def models(self, request: Request):
        if (bad := self._auth(request)) is not None:
            return bad
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                                         "owned_by": "sparkq"}]})

    async def model(self, request: Request):
        if (bad := self._auth(request)) is not None:
            return bad
        if request.path_params["model_id"] != self.name:
            return error(404, f"the model '{request.path_params['model_id']}' does not exist; this server serves "
                              f"'{self.name}'", "model", "model_not_found")
        return JSONResponse({"id": self.name, "object": "model", "created": self.created, "owned_by": "sparkq"})

    async def _body(self, request: Request, allowed: set, need_model: bool = True) -> dict:
        """the JSON object of a request, its model this server's (optional where not need_model),
        every field one of ``allowed``"""
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
        model = body.get("model", None if need_model else self.name)
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
        least = 0 if body.get("echo") else 1  # echo: 0 returns the prompt alone (with its logprobs)
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < least):
            raise BadRequest(f"'{max_field}' must be an integer >= {least}", max_field)
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
        if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage", "include_obfuscation"}):
            raise BadRequest("'stream_options' supports include_usage (and include_obfuscation, without effect)",
                             "stream_options")
        for f in ("stream", "ignore_eos"):
            if not isinstance(body.get(f), (bool, type(None))):
                raise BadRequest(f"'{f}' must be a boolean", f)
        bias = body.get("logit_bias") or {}
        if not isinstance(bias, dict):
            raise BadRequest("'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
        try:
            bias = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise BadRequest("'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias") from None
        try:
            sampling = SamplingParams(
                float(number(body, "temperature", 0.0, 2.0, self.defaults["temperature"])), float(top_p),
                int(number(body, "top_k", 0, 1 << 20, self.defaults["top_k"], integer=True)),
                float(number(body, "min_p", 0.0, 1.0, 0.0)), float(number(body, "presence_penalty", -2.0, 2.0, 0.0)),
                float(number(body, "frequency_penalty", -2.0, 2.0, 0.0)),
                float(number(body, "repetition_penalty", 0.01, 10.0, self.defaults["repetition_penalty"])), bias,
                seed).check(self.engine.session.vocab)
        except RuntimeUserError as e:
            raise BadRequest(str(e), "logit_bias" if "logit_bias" in str(e) else None) from None
        lp = body.get("logprobs")
        if lp not in (None, True, False) and not (not isinstance(lp, bool) and isinstance(lp, int) and 0 <= lp <= 20):
            raise BadRequest("'logprobs' must be a boolean (chat) or an integer in 0..20 (completions)", "logprobs")
        top = number(body, "top_logprobs", 0, 20, None, integer=True)
        if top is not None and lp is not True:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if lp is True else (lp if isinstance(lp, int) and not isinstance(lp, bool) else None)
        return {"max_tokens": mt, "sampling": sampling, "stop": stop, "ignore_eos": bool(body.get("ignore_eos")),
                "logprobs": logprobs}

    async def chat(self, request: Request):
        return await self._handle(request, chat=True)

    async def completions(self, request: Request):
        return await self._handle(request, chat=False)

    def _prompts(self, body: dict, chat: bool) -> list[tuple[list[int], tuple | None, str | None]]:
        """The request's prompts (chat: one; completions: one or a batch), each as its token ids,
        for a chat reply that may call tools (format, native, tools), and its text (echo)."""
        tok = self.engine.tok
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("'messages' must be a non-empty list", "messages")
            msgs = [message_text(m, i) for i, m in enumerate(msgs)]
            kwargs = thinking_kwargs(body.get("reasoning_effort"), dict(body.get("chat_template_kwargs") or {}),
                                     tok.chat_template)
            tools = body.get("tools") if body.get("tool_choice") != "none" else None
            if body.get("tools") is not None:
                tools_mod.check_tools(body["tools"])
            fmt, native = tools_mod.detect(tok.chat_template, tools)
            if native:  # the template renders tools, calls and results itself
                if tools:
                    kwargs["tools"] = tools
            elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):  # the generic prompt
                msgs = tools_mod.generic_messages(msgs, tools, fmt)
            return [(tok.encode_chat(msgs, **kwargs), (fmt, native, tools) if tools else None, None)]
        p = body.get("prompt")

        def ids_list(x) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(p, str) or ids_list(p):
            p = [p]
        if not (isinstance(p, list) and p and all(isinstance(x, str) or ids_list(x) for x in p)):
            raise BadRequest("'prompt' must be a string, a list of token ids, or a list of either (a batch)", "prompt")
        out = []
        for x in p:
            if isinstance(x, str):
                out.append((tok.encode(x), None, x))
                continue
            vocab = self.engine.session.embed_rows
            if min(x) < 0 or max(x) >= vocab:
                raise BadRequest(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
            out.append((list(x), None, tok.decode(x)))
        return out

    async def _handle(self, request: Request, chat: bool):
        resp = await self._respond(request, chat)
        self.metrics.requests.labels("chat" if chat else "completions", str(getattr(resp, "status_code", 200))).inc()
        return resp

    async def _respond(self, request: Request, chat: bool):
        if (bad := self._auth(request)) is not None:
            return bad
        try:
            body = await self._body(request, CHAT if chat else COMPLETION)
        except BadRequest as e:
            return error(e.status, e.message, e.param, e.code, e.type)
        started = self._start(body, chat)
        if not isinstance(started, tuple):
            return started  # an error
        reqs, n, q, meta = started
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return EventStream(self._chunks(reqs, n, q, meta, chat, usage), lambda: self._gone(reqs, q))
        return Collected(self._collect(reqs, n, q, meta, chat), lambda: self._gone(reqs, q))

    def _start(self, body: dict, chat: bool, names: dict | None = None):
        """A request body's sequences checked and queued: (engine requests, n, their event queue,
        the response's id fields), or an error response (``names``: the fields as the client's API
        calls them, for the messages: the Responses API's)."""
        def error(status, message, param=None, code=None, type_="invalid_request_error"):
            for a, b in (names or {}).items():
                message, param = message.replace(a, b), param and param.replace(a, b)
            return error_response(status, message, param, code, type_)
        try:
            kw = self._sampling(body, "max_completion_tokens" if chat else "max_tokens")
            rf = response_format_schema(body.get("response_format"))
            grammar = self.grammars().json_schema(*rf) if rf else None
            prompts = self._prompts(body, chat)  # [(ids, tool: (format, native template, tools) or None, text)]
            n, echo = body.get("n") or 1, bool(body.get("echo"))
            cap = self.engine.parallel + self.engine.max_queue
            if n * len(prompts) > cap:
                raise BadRequest(f"this request asks for {n * len(prompts)} sequences (n x prompts); this server holds "
                                 f"at most {cap} at once (--parallel + --max-queue): send fewer", "n")
            tool = prompts[0][1]
            forced = tools_mod.chosen(tool[2], body.get("tool_choice")) if tool else None
            if forced:  # "required" or a named function: a grammar of tool calls only
                if grammar:
                    raise BadRequest("'response_format' and a tool_choice that forces a call exclude each other",
                                     "tool_choice")
                grammar = self.grammars().lark(tool[0].forced(forced, body.get("parallel_tool_calls", True) is not False),
                                               "tools")
            limits = [self.engine.check(len(ids), kw["max_tokens"], zero=echo) for ids, _, _ in prompts]
        except BadRequest as e:
            return error(e.status, e.message, e.param, e.code, e.type)
        except RuntimeUserError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            return error(400, str(e), "messages" if chat else "prompt", code)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()  # (choice index, event) of every choice
        reqs, seed = [], kw["sampling"].seed
        for (ids, tool, text), mt in zip(prompts, limits):
            for j in range(n):  # choice j samples as a request with seed + j would
                i = len(reqs)
                req = GenRequest(ids, mt, lambda ev, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, ev)),
                                 stop=kw["stop"], ignore_eos=kw["ignore_eos"],
                                 sampling=replace(kw["sampling"], seed=seed + j) if j and seed is not None else kw["sampling"],
                                 logprobs=kw["logprobs"], constraint=grammar and self.grammars().constraint(grammar),
                                 echo_logprobs=kw["logprobs"] if echo and kw["logprobs"] is not None else None)
                req.tool = tool and {"format": tool[0], "parallel": body.get("parallel_tool_calls", True) is not False}
                # chat replies of reasoning models: <think>...</think> as reasoning_content (reasoning.py)
                req.split = ReasoningSplitter(opened_in_prompt(self.engine.tok.decode(ids[-8:]))) if chat else None
                req.index, req.echo = i, text if echo else None
                reqs.append(req)
        try:
            self.engine.submit_many(reqs)
        except QueueFull as e:
            return error(429, f"the server is busy: {e}; retry later", code="queue_full", type_="rate_limit_exceeded")
        except RuntimeError as e:
            return error(503, str(e), type_="server_error")
        except RuntimeUserError as e:
            return error(400, str(e), "messages" if chat else "prompt", "context_length_exceeded")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "created": int(time.time()), "model": self.name}
        if prompts[0][1] and not prompts[0][1][1]:
            meta["system_fingerprint"] = tools_mod.GENERIC_FINGERPRINT  # the template knows no tools
        return reqs, n, q, meta


def listen_socket(host: str, port: int):
    """The server's socket, bound. IPPROTO_TCP is named because asyncio sets TCP_NODELAY only on
    sockets that say so: without it a response's headers and body (two writes) waited for the
    client's delayed ACK, ~40 ms per request on a kept-alive connection (one-token completions of
    the example, `python tools/serveprobe.py keepalive URL MODEL`: median 52.0 -> 7.7 ms, AMD Zen 5)."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeUserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    return sock


def serve(model_path: str, *, host: str, port: int, parallel: int, api_key: str | None, kv_budget_mib: float,
          max_model_len: int | None, threads: int | None, model_name: str | None, max_queue: int, echo=print,
          kv_dtype: str = DEFAULT_KV_DTYPE, prefix_cache: bool = True, cors_origins=(), batch_tiles: bool = False,
          draft: str | None = None, draft_tokens: int = 8, prompt_cache: dict | None = None) -> None:
    import uvicorn
    from ..lite import load

    sock = listen_socket(host, port)  # bind first: a taken port is a one-line error before the model loads
    check_kv_dtype(kv_dtype)  # before binding: a bad flag is a one-line error either way
    m = load(model_path, max_model_len=max_model_len, kv_budget_mib=kv_budget_mib, threads=threads, slots=parallel,
             kv_dtype=kv_dtype)
    if m.tokenizer is None:
        raise RuntimeUserError(f"{model_path}: no tokenizer.json; the server needs the model's tokenizer")
    from ..core.session import BATCH_TILES_MIN_M
    drafter = None
    if draft is not None:  # speculative decoding: n-gram lookup, or a draft model with a slot per sequence
        from ..speculate import drafter as make_drafter
        drafter = make_drafter(draft, m, slots=parallel, threads=threads, kv_dtype=kv_dtype)
    engine = Engine(m, max_queue=max_queue, prefix_cache=prefix_cache, batch_tiles=BATCH_TILES_MIN_M if batch_tiles else 0,
                    draft=drafter, draft_tokens=draft_tokens, disk=prompt_cache)
    name = model_name or (m.info.extra.get("hub") or {}).get("repo") or str(model_path).rstrip("/").split("/")[-1]
    app = App(engine, name, api_key, cors_origins)
    echo(f"sparkq serve: {name} on http://{host}:{port}/v1 ({parallel} slots x {engine.slot_cap} tokens, {kv_dtype} KV, "
         f"{m.session.threads} threads{', prefix cache off' if not prefix_cache else ''}"
         f"{f', prompt cache in {engine.disk.dir} ({len(engine.disk.entries)} files)' if engine.disk else ''}"
         f"{f', steps of {BATCH_TILES_MIN_M}+ sequences on AMX tiles' if batch_tiles else ''}"
         f"{f', draft {draft} (up to {draft_tokens} tokens a pass)' if draft else ''}"
         f"{', API key required' if api_key else ''})")
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: as KeyboardInterrupt (engine.close() runs)
    signal.signal(signal.SIGTERM, signal.default_int_handler) if threading.current_thread() is threading.main_thread() else None
    try:
        uvicorn.Server(uvicorn.Config(app.asgi, host=host, port=port, log_level="warning", access_log=False)).run(
            sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
    echo("sparkq serve: stopped")
