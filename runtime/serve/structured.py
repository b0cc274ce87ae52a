"""Grammar-constrained decoding for ``response_format`` (json_object, json_schema) and forced tool
calls, on llguidance: a per-sequence token mask applied before sampling.

Why llguidance: it computes the mask lazily per step from the tokenizer's token trie (no index to
build per schema: outlines-core compiles a schema into a token automaton first, seconds for a large
vocabulary), compiles JSON schemas itself (with a one-line error for what it cannot), ships a
~10 MB wheel with no torch (xgrammar's Python package depends on torch), and reads the model's own
tokenizer.json. Measured per-token mask cost: docs/serving.md "Structured output".
"""
from __future__ import annotations

import json

import numpy as np

from .protocol import BadRequest

# JSON as json.dumps writes it ("a": 1, "b": 2): no free whitespace, which a small model at a high
# temperature can otherwise repeat until max_tokens (a schema's own "x-guidance" overrides it)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """The model's tokenizer as llguidance sees it (built once: ~0.2 s for a 49k vocabulary) and
    the grammars of requests."""

    def __init__(self, tokenizer, n_vocab: int):
        import llguidance

        self.ll = llguidance
        eos = sorted(tokenizer.stop_ids)
        self.tok = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=n_vocab, eos_token=eos[0] if eos else None)
        self.vocab = n_vocab

    def json_schema(self, schema: dict, param: str) -> str:
        """The grammar of JSON text matching ``schema`` (a 400 naming ``param`` if it cannot compile)."""
        try:
            g = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"{param}: not a JSON schema ({e})", param) from None
        return self._checked(g, param)

    def lark(self, text: str, param: str) -> str:
        return self._checked(self.ll.LLMatcher.grammar_from_lark(text), param)

    def _checked(self, g: str, param: str) -> str:
        err = self.ll.LLMatcher.validate_grammar(g, self.tok)
        if err:
            raise BadRequest(f"{param}: the schema cannot be enforced ({err.splitlines()[0]})", param)
        return g

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(self, grammar)


class Constraint:
    """One sequence's matcher: ``mask()`` the allowed next tokens (bool [vocab]), ``consume(t)``."""

    def __init__(self, grammars: Grammars, grammar: str):
        self.m = grammars.ll.LLMatcher(grammars.tok, grammar, log_level=0)
        self.vocab = grammars.vocab
        self.bits = np.zeros((grammars.vocab + 31) // 32, np.int32)

    def mask(self) -> np.ndarray:
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.vocab].astype(bool)

    def consume(self, token: int) -> None:
        self.m.consume_token(int(token))

    @property
    def done(self) -> bool:
        """the grammar is complete (only the end of the reply may follow) or cannot go on"""
        return self.m.is_stopped() or self.m.is_error()


def response_format_schema(rf) -> tuple[dict, str] | None:
    """response_format -> (its JSON schema, the field to name in errors), None for plain text."""
    if rf is None or rf == {"type": "text"}:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                         "response_format")
    if rf["type"] == "json_object":
        return {"type": "object"}, "response_format"
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise BadRequest("'response_format.json_schema' must be an object with a 'schema' object",
                         "response_format.json_schema")
    if not isinstance(js.get("strict"), (bool, type(None))):
        raise BadRequest("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict")
    return js.get("schema", {}), "response_format.json_schema.schema"


def schema_text(schema: dict) -> str:
    return json.dumps(schema, ensure_ascii=False)
