"""Embeddings and rerank scores from decoder LMs (``sparkq embed``, ``POST /v1/embeddings`` and
``/v1/rerank``: serve/embed.py), torch-free.

The C core's prompt path (``Session.prefill(ids, pos, last_only=False)``) returns the final-normed
hidden states fp32 [T, hidden]; an embedding is their pooling, as the checkpoint's
sentence-transformers files say (spark-convert carries them into the artifact: ``modules.json``,
the Pooling module's ``1_Pooling/config.json``, ``config_sentence_transformers.json``):
``pooling_mode_lasttoken`` (Qwen3-Embedding, e5-mistral: the last token's state), ``pooling_mode_mean_tokens``
(the mean over every token) or ``pooling_mode_cls_token`` (the first), then L2-normalized where
modules.json lists a Normalize module. An artifact without those files pools the last token and
normalizes. Text is tokenized as sentence-transformers does (the tokenizer's post-processor: Qwen3-Embedding's
appends <|endoftext|>); a query's instruction prefix ("Instruct: ...\\nQuery:") is the client's text.

A rerank score is, for an embedding model (sentence-transformers pooling files present), the cosine
of the query's and the document's embeddings; for any other model (a Qwen3-Reranker-style causal LM)
P(yes) = softmax([logit("no"), logit("yes")])[1] at the last position of Qwen3-Reranker's judging
prompt (its model card's prefix, "<Instruct>: ...\\n<Query>: ...\\n<Document>: ..." and suffix, each
tokenized alone and concatenated as the card does), the two logits exact (``Session.head_exact``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import RuntimeUserError

ST_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json")
POOL_MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
JUDGE_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
JUDGE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _json(p: Path):
    try:
        return json.loads(p.read_text()) if p.is_file() else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise RuntimeUserError(f"{p}: not valid JSON; re-convert or fix the file") from None


@dataclass(frozen=True)
class Pooling:
    """How hidden states become an embedding: ``mode`` lasttoken | mean | cls, ``normalize`` (L2),
    ``embedding_model``: the checkpoint said so (sentence-transformers files), ``prompts``: its named
    prompts (config_sentence_transformers.json; informational: the client sends the prefix)."""
    mode: str = "lasttoken"
    normalize: bool = True
    embedding_model: bool = False
    prompts: dict = field(default_factory=dict)


def read_pooling(path) -> Pooling:
    """The pooling of a model directory (artifact or checkpoint) from its sentence-transformers files;
    the default (last token, normalized, not an embedding model) without them."""
    path = Path(path)
    modules = _json(path / "modules.json")
    if not isinstance(modules, list):
        return Pooling()
    types = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules if isinstance(m, dict)]
    pool_dir = next((p for t, p in types if t.endswith("Pooling")), None)
    if pool_dir is None:
        return Pooling()
    cfg = _json(path / pool_dir / "config.json")
    if not isinstance(cfg, dict):
        raise RuntimeUserError(f"{path}: modules.json names a Pooling module, but {pool_dir}/config.json is missing; "
                               "re-convert with the checkpoint's sentence-transformers files")
    modes = [m for k, m in POOL_MODES.items() if cfg.get(k)]
    other = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in POOL_MODES]
    if other or len(modes) != 1:
        raise RuntimeUserError(f"{path}/{pool_dir}/config.json: pooling {', '.join(other) or modes or 'none'} is not "
                               "supported (one of lasttoken, mean_tokens, cls_token)")
    st = _json(path / "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") if isinstance(st.get("prompts"), dict) else {}
    return Pooling(modes[0], any(t.endswith("Normalize") for t, _ in types), True, dict(prompts))


def encode(tok, text: str) -> list[int]:
    """text -> ids as sentence-transformers tokenizes it (the tokenizer's special tokens added)"""
    return tok.tok.encode(text, add_special_tokens=True).ids


def pool(xn: np.ndarray, mode: str) -> np.ndarray:
    """hidden states [T, hidden] (of a whole input; lasttoken: at least its last row) -> [hidden] fp32"""
    if mode == "mean":
        return xn.astype(np.float64).mean(0).astype(np.float32)
    return np.array(xn[0 if mode == "cls" else -1], np.float32)


def unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return (v / n).astype(np.float32) if n > 0 else v.astype(np.float32)


def shaped(v: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """an embedding as returned: Matryoshka-truncated to ``dimensions`` (then re-normalized), or
    normalized where the model normalizes"""
    if dimensions is not None and dimensions < v.size:
        return unit(v[:dimensions])
    return unit(v) if normalize else v


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(unit(a).astype(np.float64), unit(b).astype(np.float64)))


def yes_prob(no_logit: float, yes_logit: float) -> float:
    """softmax([no, yes])[1], stable"""
    return 1.0 / (1.0 + math.exp(float(no_logit) - float(yes_logit)))


class Judge:
    """Qwen3-Reranker's judging prompt over a tokenizer and the ids of its "yes" / "no" tokens."""

    def __init__(self, tok):
        self.tok = tok

        def one(s):
            i = tok.tok.token_to_id(s)
            if i is None:
                ids = tok.tok.encode(s, add_special_tokens=False).ids
                i = ids[0] if len(ids) == 1 else None
            if i is None:
                raise RuntimeUserError(f"this model's tokenizer has no single '{s}' token, so it cannot judge relevance "
                                       "as a Qwen3-Reranker does; rerank with an embedding model instead")
            return int(i)
        self.no, self.yes = one("no"), one("yes")
        self._pre, self._suf = self._ids(JUDGE_PREFIX), self._ids(JUDGE_SUFFIX)

    def _ids(self, s: str) -> list[int]:
        return self.tok.tok.encode(s, add_special_tokens=False).ids

    def ids(self, query: str, doc: str, instruction: str | None = None) -> list[int]:
        body = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
        return self._pre + self._ids(body) + self._suf


def session_of(m):
    """the C-core Session of a loaded model: the lite runtime's, or the torch runtime's fast path"""
    s = getattr(m, "session", None) or getattr(getattr(m, "model", None), "fast", None)
    if s is None:
        raise RuntimeUserError("embeddings need the C core (a rows32 artifact, or a bf16 checkpoint the C core runs)")
    return s


class Embedder:
    """Embeddings and rerank scores of one loaded model, one input at a time in KV slot 0 (the CLI,
    scripts, tests; the server runs the same computation through its engine: serve/embed.py)."""

    def __init__(self, model, path=None, pooling: Pooling | None = None, chunk: int | None = None):
        from .serve.engine import PREFILL_SLICE

        self.model, self.session, self.tok = model, session_of(model), model.tokenizer
        # the server's prompt slices: where the prompt GEMM's bits depend on the slice length (AVX512-BF16),
        # the same vectors as /v1/embeddings
        self.chunk = chunk or PREFILL_SLICE
        if self.tok is None:
            raise RuntimeUserError("embeddings need the model's tokenizer (tokenizer.json)")
        self.pooling = pooling or read_pooling(path or model.info.source)
        self.cap = min(self.session.cap, model.info.max_model_len)
        self._judge = None

    def check(self, n: int, what: str = "the input") -> None:
        if n < 1:
            raise RuntimeUserError(f"{what} is empty: give at least one token of text")
        if n > self.cap:
            raise RuntimeUserError(f"{what} is {n} tokens; this model's context here is {self.cap} tokens "
                                   "(raise --kv-budget-mib / --max-model-len)")

    def hidden(self, ids: list[int]) -> np.ndarray:
        self.check(len(ids))
        return self.session.prefill(ids, 0, last_only=self.pooling.mode == "lasttoken", chunk=self.chunk)

    def embed_ids(self, ids: list[int], dimensions: int | None = None) -> np.ndarray:
        return shaped(pool(self.hidden(ids), self.pooling.mode), dimensions, self.pooling.normalize)

    def embed(self, texts: list[str], dimensions: int | None = None) -> list[np.ndarray]:
        return [self.embed_ids(encode(self.tok, t), dimensions) for t in texts]

    def judge(self) -> Judge:
        if self._judge is None:
            self._judge = Judge(self.tok)
        return self._judge

    def judge_ids(self, ids: list[int]) -> float:
        j = self.judge()
        no, yes = self.session.head_exact(self.hidden(ids)[-1], [j.no, j.yes])
        return yes_prob(no, yes)

    def rerank(self, query: str, docs: list[str], instruction: str | None = None) -> list[float]:
        """a relevance score per document: cosine (an embedding model) or P(yes) (a judge)"""
        if self.pooling.embedding_model:
            q = self.embed_ids(encode(self.tok, query))
            return [cosine(q, d) for d in self.embed(docs)]
        return [self.judge_ids(self.judge().ids(query, d, instruction)) for d in docs]
