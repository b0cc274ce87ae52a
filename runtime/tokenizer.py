"""Tokenizer (``tokenizers`` library, from tokenizer.json) and chat-template rendering."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import RuntimeUserError


def _load_json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text()) if p.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RuntimeUserError(f"{p}: not valid JSON; re-download or re-convert") from None
    if not isinstance(d, dict):
        raise RuntimeUserError(f"{p}: expected a JSON object; re-download or re-convert")
    return d


class ChatTokenizer:
    def __init__(self, tok, tcfg: dict, gen: dict, config: dict, chat_template: str | None):
        # the template's switches (chat_template_kwargs), e.g. {"enable_thinking": False} (SmolLM3, Qwen3)
        self.template_kwargs: dict = {}
        self.tok = tok
        self.tcfg = tcfg
        self.generation_config = gen
        self.chat_template = chat_template
        self.add_bos = tcfg.get("add_bos_token") is True
        self.bos_token = self._tok_str(tcfg.get("bos_token"))
        self.eos_token = self._tok_str(tcfg.get("eos_token"))
        self.pad_token = self._tok_str(tcfg.get("pad_token"))
        self.bos_id = self._id_of(self.bos_token, config.get("bos_token_id"))
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        ids = {i for i in (eos if isinstance(eos, list) else [eos]) if type(i) is int}
        if self.eos_token is not None and tok.token_to_id(self.eos_token) is not None:
            ids.add(tok.token_to_id(self.eos_token))
        self.stop_ids = {int(i) for i in ids}

    @staticmethod
    def _tok_str(v):
        v = v.get("content") if isinstance(v, dict) else v
        return v if isinstance(v, str) else None

    def _id_of(self, s, fallback):
        i = self.tok.token_to_id(s) if s else None
        return i if i is not None else (fallback if type(fallback) is int else None)

    @classmethod
    def from_dir(cls, path: Path, config: dict) -> "ChatTokenizer":
        from tokenizers import Tokenizer

        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise RuntimeUserError(f"{path}: no tokenizer.json; the checkpoint or artifact lacks a tokenizer")
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise RuntimeUserError(f"{tj}: cannot be read by the tokenizers library ({str(e)[:100]})") from None
        tcfg = _load_json(path / "tokenizer_config.json")
        gen = _load_json(path / "generation_config.json")
        tmpl = tcfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            tmpl = (path / "chat_template.jinja").read_text()
        if isinstance(tmpl, list):  # named templates: take "default"
            tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(tmpl, str):
            tmpl = None
        return cls(tok, tcfg, gen, config, tmpl)

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The chat template over messages; ``template_kwargs`` (a request's chat_template_kwargs) on
        top of the tokenizer's own switches."""
        if not self.chat_template:
            raise RuntimeUserError("this model has no chat template; run without --chat")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise RuntimeUserError(f"chat template: {msg}")

        class Undefined(jinja2.Undefined):
            """As transformers' (jinja2's default): a template may test or loop over variables only some
            callers pass (SmolLM3's xml_tools); printing one is an error, not an empty string"""
            __str__ = jinja2.Undefined._fail_with_undefined_error

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=Undefined,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
        try:
            # the variables transformers' apply_chat_template provides (tools and documents unset unless passed)
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                **{"tools": None, "documents": None, **{k: v for k, v in {**self.template_kwargs, **template_kwargs}.items()
                                                        if k != "messages"}})
        except jinja2.UndefinedError as e:
            raise RuntimeUserError(f"chat template uses a variable sparkq does not provide ({e}); "
                                   "fix the template or run without --chat") from None
        except jinja2.TemplateError as e:
            raise RuntimeUserError(f"chat template failed to render ({e.__class__.__name__}: {e}); run without --chat") from None

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        text = self.render_chat(messages, **template_kwargs)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.bos_token and text.startswith(self.bos_token):
            return ids
        return self.encode(text) if self.add_bos else ids
