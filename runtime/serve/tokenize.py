"""The tokenizer over HTTP, in the shape vLLM serves it (lm-eval's remote tokenizer reads it, so an
evaluation needs no local copy of the tokenizer) with llama-server's field names accepted too:
``POST /tokenize`` {"prompt" | "content": text, or "messages": chat; "add_special_tokens"} ->
{"tokens", "count", "max_model_len"}; ``POST /detokenize`` {"tokens"} -> {"prompt", "content"};
``GET /tokenizer_info`` the special tokens, the chat template and the context length."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..errors import RuntimeUserError
from .protocol import BadRequest, error, message_text

TOKENIZE = {"model", "prompt", "content", "messages", "add_special_tokens", "add_special", "add_generation_prompt",
            "chat_template_kwargs"}


class Tokenize:
    """The App's tokenizer routes (a mixin: ``self.engine``, ``self._auth``, ``self._body``)."""

    async def tokenizer_info(self, request: Request):
        if (bad := self._auth(request)) is not None:
            return bad
        tok = self.engine.tok
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token,
                             "bos_token": tok.bos_token, "pad_token": tok.pad_token, "add_bos_token": tok.add_bos,
                             "chat_template": tok.chat_template, "model_max_length": self.engine.slot_cap})

    async def tokenize(self, request: Request):
        if (bad := self._auth(request)) is not None:
            return bad
        try:
            body = await self._body(request, TOKENIZE, need_model=False)
            tok = self.engine.tok
            special = body.get("add_special_tokens", body.get("add_special", True))
            if not isinstance(special, bool):
                raise BadRequest("'add_special_tokens' must be a boolean", "add_special_tokens")
            text = body.get("prompt", body.get("content"))
            if body.get("messages") is not None:
                msgs = body["messages"]
                if text is not None or not isinstance(msgs, list) or not msgs:
                    raise BadRequest("send either 'prompt' (text) or 'messages' (a non-empty list)", "messages")
                gen = body.get("add_generation_prompt", True)
                kw = body.get("chat_template_kwargs") or {}
                if not isinstance(gen, bool) or not isinstance(kw, dict):
                    raise BadRequest("'add_generation_prompt' must be a boolean, 'chat_template_kwargs' an object")
                try:
                    ids = tok.encode_chat([message_text(m, i) for i, m in enumerate(msgs)], add_generation_prompt=gen,
                                          **kw)
                except RuntimeUserError as e:
                    raise BadRequest(str(e), "messages") from None
            elif isinstance(text, str):
                ids = tok.encode(text) if special else tok.tok.encode(text, add_special_tokens=False).ids
            else:
                raise BadRequest("'prompt' (a string) or 'messages' is required", "prompt")
        except BadRequest as e:
            return error(e.status, e.message, e.param, e.code, e.type)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.slot_cap})

    async def detokenize(self, request: Request):
        if (bad := self._auth(request)) is not None:
            return bad
        try:
            body = await self._body(request, {"model", "tokens"}, need_model=False)
            ids, vocab = body.get("tokens"), self.engine.session.embed_rows
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                    for t in ids):
                raise BadRequest(f"'tokens' must be a list of token ids in 0..{vocab - 1}", "tokens")
        except BadRequest as e:
            return error(e.status, e.message, e.param, e.code, e.type)
        text = self.engine.tok.decode(ids)
        return JSONResponse({"prompt": text, "content": text})
