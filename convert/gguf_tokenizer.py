"""A GGUF's tokenizer as Hugging Face files (``tokenizer.json`` built with the ``tokenizers``
library, ``tokenizer_config.json`` with the chat template, ``generation_config.json``).

Two vocabularies occur in the families sparkq runs: byte-level BPE (``tokenizer.ggml.model =
gpt2``: Llama 3, SmolLM, Qwen2/2.5/3; the file lists the merges and names its pre-tokenizer) and
SentencePiece BPE (``llama``: Llama 2, Mistral, Gemma; tokens with scores and ``<0xNN>`` byte
tokens, usually no merges). The pipelines are the ones transformers builds from the same file
(its GGUF loader is the oracle in tests/test_gguf.py): the same vocabulary, the same merges
(recovered from the vocabulary where the file has none), the same normalizer, pre-tokenizer and
decoder, the control tokens as special tokens.
"""
from __future__ import annotations

import json

from .errors import ConvertError

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: letters with their combining marks (\p{M}) in one pre-token
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "qwen35": _QWEN35_SPLIT,
              "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "lfm2": _LLAMA3_SPLIT}  # (llama.cpp: lfm2 is its Llama-3 split)
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (gguf.TokenType)
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Tokens as the byte-level alphabet spells them (a file may store a control token raw)."""
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = _bytes_to_unicode()
    return {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def recover_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a token into two tokens,
    best-scored result first (ties: shorter left, then shorter right part first-listed)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def build_tokenizer(field, arch: str):
    """The ``tokenizers.Tokenizer`` of a GGUF; ``field(key, default)`` reads its metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = field("tokenizer.ggml.model", None)
    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type", [1] * len(tokens)))
    if kind == "gpt2":
        pre = field("tokenizer.ggml.pre", "default")
        merges = field("tokenizer.ggml.merges", None)
        vocab = _byte_level_vocab(tokens)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges or []],
                                   fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in PRE_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre == "smollm":  # SmolLM: every digit its own pre-token, then GPT-2 byte-level
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("gpt2", "gpt-2", "default"):
            tok.pre_tokenizer = byte_level
        else:
            raise ConvertError(f"GGUF pre-tokenizer {pre!r} is not supported yet (supported: smollm, gpt2, "
                               f"{', '.join(PRE_SPLITS)})")
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        gemma = arch in GEMMA_ARCHS
        if gemma:  # a token of spaces is stored as spaces, looked up as U+2581 runs
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = field("tokenizer.ggml.merges", None)
        if merges:
            merges = [tuple(m.split(" ", 1)) for m in merges]
        elif gemma:  # Gemma's scores do not follow its merge order; its token order does
            merges = recover_merges(vocab, {t: -i for i, t in enumerate(tokens)})
        else:
            merges = recover_merges(vocab, dict(zip(tokens, field("tokenizer.ggml.scores"))))
        unk = field("tokenizer.ggml.unknown_token_id", None)
        bpe = dict(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
        if gemma:
            tok = Tokenizer(models.BPE(**bpe, unk_token=tokens[unk] if unk is not None else "<unk>"))
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        else:
            prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
            tok = Tokenizer(models.BPE(**bpe))
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                         split=False)
            steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    else:
        raise ConvertError(f"GGUF tokenizer model {kind!r} is not supported yet (supported: gpt2 byte-level BPE, "
                           "llama SentencePiece BPE)")
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == TOKEN_CONTROL])
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == TOKEN_USER_DEFINED]
    if user:
        tok.add_tokens(user)
    return tok, tokens


def tokenizer_files(field, arch: str, config: dict) -> dict[str, bytes]:
    tok, tokens = build_tokenizer(field, arch)

    def tok_str(key):
        i = config.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    unk = field("tokenizer.ggml.unknown_token_id", None)
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok_str("bos_token_id"),
        "eos_token": tok_str("eos_token_id"),
        "pad_token": tok_str("pad_token_id"),
        "unk_token": tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    ct = field("tokenizer.chat_template", None)
    if ct:
        tcfg["chat_template"] = ct
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    return {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": json.dumps(tcfg, indent=2).encode(),
        "generation_config.json": json.dumps(gen, indent=2).encode(),
    }
