"""GGUF input: tensors dequantized one at a time, mapped back to Hugging Face names.

llama.cpp's converter permutes the rows of q/k projections (interleaved RoPE halves);
we undo it so the result is the standard HF (rotate-half) layout. The config, the
tokenizer (``tokenizer.json`` built with the ``tokenizers`` library) and the chat
template are recovered from the GGUF metadata.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from .errors import ConvertError
from .source import Source

LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SUPPORTED_ARCH = {"llama": "LlamaForCausalLM"}


def hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in LAYER_MAP:
        return f"model.layers.{m.group(1)}.{LAYER_MAP[m.group(2)]}.{suffix}"
    if base in GLOBAL_MAP:
        return f"{GLOBAL_MAP[base]}.{suffix}"
    return None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rows grouped per head as [2, d/2] -> [d/2, 2])."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(Source):
    def __init__(self, path: Path):
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # the gguf package raises assorted errors on bad files
            raise ConvertError(f"{path}: not a readable GGUF file ({e.__class__.__name__}: {str(e)[:120]})") from None
        f = self.reader.fields
        arch = self._field("general.architecture")
        if arch not in SUPPORTED_ARCH:
            raise ConvertError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCH)})")
        a = arch
        self.tensors = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                if t.name in ("rope_freqs.weight",):
                    continue
                raise ConvertError(f"{path}: GGUF tensor {t.name!r} has no Hugging Face equivalent known to sparkq")
            self.tensors[name] = t
        heads = int(self._field(f"{a}.attention.head_count"))
        kv = int(self._field(f"{a}.attention.head_count_kv", heads))
        hidden = int(self._field(f"{a}.embedding_length"))
        tied = "lm_head.weight" not in self.tensors
        vocab = len(f["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in f else int(self._field(f"{a}.vocab_size"))
        config = {
            "architectures": [SUPPORTED_ARCH[arch]],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self._field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": int(self._field(f"{a}.rope.dimension_count", hidden // heads)),
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field(f"{a}.context_length", 2048)),
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id", None),
            "pad_token_id": self._field("tokenizer.ggml.padding_token_id", None),
            "torch_dtype": "bfloat16",
        }
        self.heads, self.kv_heads = heads, kv
        shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in self.tensors.items()}
        super().__init__(config=config, shapes=shapes,
                         origin={"kind": "gguf", "id": path.name, "name": self._field("general.name", None),
                                 **({"license": lic} if (lic := self._field("general.license", None)) else {})},
                         directory=None, extra_files=self._tokenizer_files(config))
        self._cache: tuple[str, torch.Tensor] | None = None
        self.path = path

    def _field(self, key: str, default=...):
        fld = self.reader.fields.get(key)
        if fld is None:
            if default is ...:
                raise ConvertError(f"GGUF metadata lacks {key!r}; the file is incomplete or not a supported model")
            return default
        v = fld.contents()
        return v

    def nbytes(self, name: str) -> int:
        return int(self.tensors[name].n_bytes)

    def _dequant(self, name: str) -> torch.Tensor:
        from gguf import quants

        if self._cache and self._cache[0] == name:
            return self._cache[1]
        t = self.tensors[name]
        arr = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        arr = arr.reshape(self.shapes[name])
        if name.endswith("self_attn.q_proj.weight"):
            arr = unpermute(arr, self.heads)
        elif name.endswith("self_attn.k_proj.weight"):
            arr = unpermute(arr, self.kv_heads)
        # rounded through bf16, so converting the GGUF directly gives the same artifact as
        # converting its `sparkq import-gguf` checkpoint (the fidelity reference)
        out = torch.from_numpy(np.require(arr, np.float32, ["C", "W"])).to(torch.bfloat16)
        self._cache = (name, out)  # one tensor at a time
        return out

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        return self._dequant(name)[r0:r1].to(torch.float32)

    # ------------------------------------------------------------------ tokenizer
    def _tokenizer_files(self, config: dict) -> dict[str, bytes]:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        model = self._field("tokenizer.ggml.model", None)
        if model != "gpt2":
            raise ConvertError(f"GGUF tokenizer model {model!r} is not supported yet (supported: gpt2 byte-level BPE)")
        tokens = self._field("tokenizer.ggml.tokens")
        merges = self._field("tokenizer.ggml.merges")
        types = self._field("tokenizer.ggml.token_type", [1] * len(tokens))
        pre = self._field("tokenizer.ggml.pre", "default")
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                   fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":  # SmolLM: every digit its own pre-token, then GPT-2 byte-level
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("gpt2", "gpt-2", "default"):
            tok.pre_tokenizer = byte_level
        elif pre in ("llama-bpe", "llama3", "qwen2"):
            pat = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" if pre == "qwen2" else
                   r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}") + \
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(pat), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            raise ConvertError(f"GGUF pre-tokenizer {pre!r} is not supported yet (supported: smollm, gpt2, llama-bpe, qwen2)")
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty == 3]
        tok.add_special_tokens(special)

        def tok_str(key):
            i = config.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        tcfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok_str("bos_token_id"),
            "eos_token": tok_str("eos_token_id"),
            "pad_token": tok_str("pad_token_id"),
            "unk_token": tokens[self._field("tokenizer.ggml.unknown_token_id", 0)] if "tokenizer.ggml.unknown_token_id" in self.reader.fields else None,
            "add_bos_token": bool(self._field("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(self._field("tokenizer.ggml.add_eos_token", False)),
            "model_max_length": config["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
        }
        ct = self._field("tokenizer.chat_template", None)
        if ct:
            tcfg["chat_template"] = ct
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        return {
            "tokenizer.json": tok.to_str().encode(),
            "tokenizer_config.json": json.dumps(tcfg, indent=2).encode(),
            "generation_config.json": json.dumps(gen, indent=2).encode(),
        }
