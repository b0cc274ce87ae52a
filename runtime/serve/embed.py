"""``POST /v1/embeddings`` (OpenAI's shape) and ``POST /v1/rerank`` (Cohere's / Jina's, as llama-server
serves it; also ``/rerank``) over the serving engine: the pooling and scores are runtime/embedding.py's.

Every input runs through the engine's own submission mechanism (``Engine.submit_many``): an
``EmbedRequest`` with max_tokens 0 takes a KV slot like any prompt, is prefilled there slice by slice
between the running streams' decode steps (the engine thread is the only one that calls the C core,
so nothing races the generation's slots or the core's buffers), and leaves the slot when its prompt
is in. Its hidden states come from a tap on the Session (the hook the multi-token-prediction drafter
uses, chained): called on the engine thread with each prefilled slice's final-normed states, it keeps
those of the slot's EmbedRequest (the last row; every row for mean pooling) and, for a judge, the
exact "no" / "yes" logits of the last row. A last-token input may reuse a prefix the prefix cache
holds (rerank prompts share the judging prefix, instruction and query); a mean-pooled one is
prefilled whole (it asks for its prompt log-probabilities, which turns the reuse off, at the cost of
the head over every row). Inputs go in waves of --parallel, so waiting chat requests keep the queue.
"""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..errors import RuntimeUserError
from ..embedding import Judge, cosine, encode, pool, read_pooling, shaped, yes_prob
from .engine import QueueFull
from .protocol import INFORMATIONAL, BadRequest, error
from .request import Request as GenRequest

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request
EMBEDDINGS = {"model", "input", "dimensions", "encoding_format", "user"}
RERANK = {"model", "query", "documents", "top_n", "return_documents", "instruction"} | set(INFORMATIONAL)
WHOLE = ("mean", "cls")  # poolings that need every row: prefilled whole
WAIT_FOR_ROOM = 30.0  # seconds a request's later wave waits for queue room before 429


@dataclass
class EmbedRequest(GenRequest):
    mode: str = "lasttoken"  # the pooling; "judge": the "no" / "yes" logits of the last row
    rows: list = field(default_factory=list)  # the tapped hidden states (mean: every row)
    out: object = None  # the pooled state, or (no, yes) logits


class EngineEmbedder:
    """Embedding jobs through an Engine (see the module doc)."""

    def __init__(self, engine):
        self.engine, self.session, self.tok = engine, engine.session, engine.tok
        self.pooling = read_pooling(engine.model.info.source)
        self.slot_elems = engine.model.slot_elems
        self.hidden = engine.model.spec.hidden
        self._judge = None
        self.prev = self.session.tap  # (a drafter's) chained
        self.session.tap = self._tap  # installed before the first EmbedRequest is submitted

    def judge(self) -> Judge:
        if self._judge is None:
            self._judge = Judge(self.tok)
        return self._judge

    def _tap(self, kvoff: int, pos0: int, rows: np.ndarray) -> None:
        """(the engine thread, inside Session.prefill / step_many) keep an EmbedRequest's states"""
        if self.prev is not None:
            self.prev(kvoff, pos0, rows)
        slot = kvoff // self.slot_elems
        r = next((r for r in self.engine.running if r.slot == slot and isinstance(r, EmbedRequest)), None)
        if r is None or r.done or r.cancelled:
            return
        if r.mode in WHOLE:
            r.rows.append(rows.copy())
        if pos0 + rows.shape[0] == len(r.ids):  # the prompt's last slice
            if r.mode in WHOLE:
                r.out = pool(np.concatenate(r.rows), r.mode)
            elif r.mode == "judge":
                r.out = tuple(self.session.head_exact(rows[-1], [self._judge.no, self._judge.yes]))
            else:
                r.out = pool(rows, r.mode)
            r.rows = []

    async def run(self, jobs: list[tuple[list[int], str]]) -> list:
        """(the event loop) each (ids, mode)'s result: a pooled state fp32 [hidden] or (no, yes) logits"""
        loop = asyncio.get_running_loop()
        out, wave = [None] * len(jobs), max(1, self.engine.parallel)
        for a in range(0, len(jobs), wave):
            futs, reqs = [], []
            for ids, mode in jobs[a:a + wave]:
                fut = loop.create_future()

                def emit(ev, fut=fut):
                    if "finish" in ev or "error" in ev:
                        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(ev))
                reqs.append(EmbedRequest(list(ids), 0, emit, mode=mode,
                                         echo_logprobs=0 if mode in WHOLE else None))  # (no prefix reuse)
                futs.append(fut)
            deadline = time.monotonic() + WAIT_FOR_ROOM
            while True:
                try:
                    self.engine.submit_many(reqs)
                    break
                except QueueFull:
                    if a == 0 or time.monotonic() > deadline:  # a later wave waits for room a while
                        raise
                    await asyncio.sleep(0.05)
            try:
                evs = await asyncio.gather(*futs)
            finally:
                for r in reqs:
                    if not r.done:
                        self.engine.cancel(r)
            for k, (r, ev) in enumerate(zip(reqs, evs)):
                if "error" in ev or r.out is None:
                    raise RuntimeError(ev.get("error") or "the engine returned no hidden state")
                out[a + k] = r.out
        return out


def _ids_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class EmbedAPI:
    """The App's embeddings and rerank routes (a mixin: ``self.engine``, ``self._auth``, ``self._body``,
    ``self.metrics``, ``self.name``)."""
    _embedder = None

    def embed_routes(self) -> list:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/rerank", self.rerank, methods=["POST"]), Route("/rerank", self.rerank, methods=["POST"])]

    def embedder(self) -> EngineEmbedder:
        if self._embedder is None:
            self._embedder = EngineEmbedder(self.engine)
        return self._embedder

    def _fits(self, ids: list[int], what: str, param: str) -> list[int]:
        cap = self.engine.slot_cap
        if not ids:
            raise BadRequest(f"{what} is empty: give at least one token of text", param)
        if len(ids) >= cap:
            raise BadRequest(f"{what} is {len(ids)} tokens; this server takes at most {cap - 1} tokens per input (its "
                             f"context is {cap} tokens per sequence): shorten it, or restart with a larger "
                             "--kv-budget-mib or a smaller --parallel", param, code="context_length_exceeded")
        vocab = self.engine.session.embed_rows
        if min(ids) < 0 or max(ids) >= vocab:
            raise BadRequest(f"{what}: token ids must be in 0..{vocab - 1}", param)
        return ids

    async def _answer(self, request: Request, endpoint: str, fn):
        if (bad := self._auth(request)) is not None:
            resp = bad
        else:
            try:
                resp = await fn(request)
            except BadRequest as e:
                resp = error(e.status, e.message, e.param, e.code, e.type)
            except QueueFull as e:
                resp = error(429, f"the server is busy: {e}; retry later", code="queue_full", type_="rate_limit_exceeded")
            except RuntimeError as e:
                resp = error(503, str(e), type_="server_error")
        self.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    async def embeddings(self, request: Request):
        return await self._answer(request, "embeddings", self._embeddings)

    async def rerank(self, request: Request):
        return await self._answer(request, "rerank", self._rerank)

    async def _embeddings(self, request: Request):
        body = await self._body(request, EMBEDDINGS, need_model=False)
        x = body.get("input")
        if isinstance(x, str) or _ids_list(x):
            x = [x]
        if not (isinstance(x, list) and x and all(isinstance(s, str) or _ids_list(s) for s in x)):
            raise BadRequest("'input' must be a non-empty string, a list of them, a list of token ids or a list of "
                             "such lists", "input")
        if any(s == "" for s in x):
            raise BadRequest(f"'input'[{x.index('')}] is an empty string: give at least one character", "input")
        if len(x) > MAX_INPUTS:
            raise BadRequest(f"'input' holds {len(x)} inputs; at most {MAX_INPUTS} per request", "input")
        dims = body.get("dimensions")
        hidden = self.engine.model.spec.hidden
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= hidden):
            raise BadRequest(f"'dimensions' must be an integer in 1..{hidden}", "dimensions")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        emb = self.embedder()
        ids = [self._fits(encode(self.engine.tok, s) if isinstance(s, str) else list(s),
                          f"input[{i}]" if len(x) > 1 else "the input", "input") for i, s in enumerate(x)]
        vecs = await emb.run([(i, emb.pooling.mode) for i in ids])
        data = []
        for i, v in enumerate(vecs):
            v = shaped(v, dims, emb.pooling.normalize).astype("<f4")
            data.append({"object": "embedding", "index": i,
                         "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()})
        n = sum(map(len, ids))
        return JSONResponse({"object": "list", "data": data, "model": self.name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def _rerank(self, request: Request):
        body = await self._body(request, RERANK, need_model=False)
        q, docs = body.get("query"), body.get("documents")
        if not isinstance(q, str) or not q:
            raise BadRequest("'query' must be a non-empty string", "query")
        if isinstance(docs, list):  # Cohere's / Jina's {"text": ...} documents too
            docs = [d.get("text") if isinstance(d, dict) else d for d in docs]
        if not (isinstance(docs, list) and docs and all(isinstance(d, str) for d in docs)) or len(docs) > MAX_INPUTS:
            raise BadRequest(f"'documents' must be a non-empty list of at most {MAX_INPUTS} strings", "documents")
        top_n = body.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise BadRequest("'top_n' must be an integer >= 1", "top_n")
        instr = body.get("instruction")
        if instr is not None and not isinstance(instr, str):
            raise BadRequest("'instruction' must be a string", "instruction")
        if not isinstance(body.get("return_documents", False), bool):
            raise BadRequest("'return_documents' must be a boolean", "return_documents")
        emb, tok = self.embedder(), self.engine.tok
        if emb.pooling.embedding_model:  # cosine of the embeddings
            ids = [self._fits(encode(tok, q), "the query", "query")]
            ids += [self._fits(encode(tok, d), f"documents[{i}]", "documents") for i, d in enumerate(docs)]
            vecs = await emb.run([(i, emb.pooling.mode) for i in ids])
            scores = [cosine(vecs[0], v) for v in vecs[1:]]
        else:  # a judge: P(yes) of Qwen3-Reranker's prompt
            try:
                judge = emb.judge()
            except RuntimeUserError as e:
                raise BadRequest(str(e), "model") from None
            ids = [self._fits(judge.ids(q, d, instr), f"documents[{i}] (in the judging prompt)", "documents")
                   for i, d in enumerate(docs)]
            scores = [yes_prob(*o) for o in await emb.run([(i, "judge") for i in ids])]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n or len(docs)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if body.get("return_documents") else {})} for i in order]
        n = sum(map(len, ids))
        return JSONResponse({"id": "rerank-" + uuid.uuid4().hex[:24], "object": "list", "model": self.name,
                             "results": results, "usage": {"prompt_tokens": n, "total_tokens": n}})
