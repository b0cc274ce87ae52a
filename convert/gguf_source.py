"""GGUF input: tensors dequantized one at a time, mapped back to Hugging Face names.

Every family sparkq runs: llama, mistral, qwen2, qwen3, gemma3, ..., qwen35 (Qwen3.5's Gated
DeltaNet hybrid), lfm2 (LFM2's short-conv hybrid), granitehybrid (Granite 4.0-H's Mamba-2 hybrid),
nemotron_h and falcon-h1 (gguf_hybrids.py: Granite's split shared MLP stacked, -exp(A_log) and the
reshaped Mamba parameters undone, Nemotron-H's blocks read back, Falcon-H1's folded multipliers
set to 1), in the tensor layout llama.cpp's converter writes. Where that converter changed
tensors, the change is undone so the result is the standard HF checkpoint: llama's q/k rows are
permuted (interleaved RoPE halves); Gemma's and Qwen3.5's norm weights are stored as ``1 + w``;
Qwen3.5's DeltaNet stores ``-exp(A_log)``, a squeezed conv weight and its value heads tiled
(``h' = j * k_heads + g``) rather than grouped by key head (``h = g * ratio + j``), undone per
tensor by a row (or column) map read in runs; its multi-token-prediction block is dropped. The
config is rebuilt from the GGUF metadata (with llama.cpp's own defaults where it stores none:
Gemma 3's local RoPE base and sliding-window pattern), the tokenizer and chat template by
gguf_tokenizer.py. Any tensor type the ``gguf`` package dequantizes is read.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import torch
from sparkq.formats import constants as C
from sparkq.formats.tensorfile import TensorFileWriter
from tqdm import tqdm

from .errors import ConvertError
from . import gguf_hybrids as hy
from .gguf_qwen35 import qwen35_config, qwen35_maps
from .gguf_tokenizer import tokenizer_files
from .output import atomic_dir, carry_files
from .source import Source

_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
LAYER_MAPS = {  # GGUF block tensor -> HF module under model.layers.N, per architecture
    "llama": {**_COMMON, "ffn_norm": "post_attention_layernorm"},
    # Phi-3: q, k, v and gate, up stay fused (attn_qkv, ffn_up holding [gate; up]), as in the checkpoint
    "phi3": {**_COMMON, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj",
             "ffn_norm": "post_attention_layernorm"},
    # OLMo 2: no pre-norms; the post-attention / post-MLP norms, full-width q/k norms
    "olmo2": {**_COMMON, "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "gemma3": {**_COMMON, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # Qwen3.5 (llama.cpp's Qwen3_5TextModel): post_attention_norm is the pre-MLP norm; the Gated
    # DeltaNet's tensors under ssm_* / attn_qkv / attn_gate (ssm_a and ssm_dt.bias: LAYER_WHOLE)
    "qwen35": {**_COMMON, "post_attention_norm": "post_attention_layernorm",
               "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
               "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
               "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"},
    **hy.LAYER_MAPS,
}
# GGUF block tensors named whole (no .weight suffix to carry over) -> HF parameter under model.layers.N
LAYER_WHOLE = {"qwen35": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}, **hy.LAYER_WHOLE}
GLOBAL_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF architecture -> (HF architecture, model_type, layer map, q/k permuted by llama.cpp, norms stored as 1 + w)
ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", "llama", True, False),
    "mistral": ("MistralForCausalLM", "mistral", "llama", False, False),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", "llama", False, False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", "llama", False, False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", "gemma3", False, True),
    "phi3": ("Phi3ForCausalLM", "phi3", "phi3", False, False),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", "llama", True, False),
    "granite": ("GraniteForCausalLM", "granite", "llama", True, False),  # (Granite 4.0 dense too, split MLP)
    "olmo2": ("Olmo2ForCausalLM", "olmo2", "olmo2", False, False),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text", "qwen35", False, True),  # (the DeltaNet's ssm_norm: no 1 + w)
    **hy.ARCHS,
}
# GGUF architectures llama.cpp writes with mixture-of-experts MLPs only: refused by name (its
# qwen3next converter has no dense MLP tensors; a dense Qwen3-Next cannot be written by it)
MOE_ARCHS = {"qwen3next": "Qwen3-Next", "qwen35moe": "Qwen3.5-MoE"}
# tensors read as fp32, never rounded through bf16: the DeltaNet's own parameters, fp32 in the
# artifact (formats/spec.py vector_dtype) and in Qwen3.5's checkpoints (A_log, norm)
FP32_PARAMS = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight", "linear_attn.norm.weight",
               *hy.FP32_PARAMS)
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # LongRoPE's, read into the config
SMOLLM3_NOPE_STEP = 4  # llama.cpp: every 4th SmolLM3 layer has no RoPE (not stored in the file)
GEMMA3_SWA_PATTERN = 6  # llama.cpp: every 6th layer full attention (not stored in the file)
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for Gemma 3 (not stored)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    whole = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    pre = hy.LAYER_PREFIX.get(arch, "model.layers")  # (Nemotron-H's backbone.layers)
    if whole and whole.group(2) in LAYER_WHOLE.get(arch, {}):
        return f"{pre}.{whole.group(1)}.{LAYER_WHOLE[arch][whole.group(2)]}"
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)", base)  # (lfm2: shortconv.in_proj)
    layer_map = LAYER_MAPS[ARCHS[arch][2]]
    if m and m.group(2) in layer_map:
        return f"{pre}.{m.group(1)}.{layer_map[m.group(2)]}.{suffix}"
    if base in (glob := {**GLOBAL_MAP, **hy.GLOBAL_MAPS.get(arch, {})}):
        return f"{glob[base]}.{suffix}"
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
        arch = self._field("general.architecture")
        hy.refuse_moe(path, arch, self._field, [t.name for t in self.reader.tensors])  # (nemotron_h_moe too)
        if arch in MOE_ARCHS:
            raise ConvertError(f"{path}: GGUF architecture {arch!r} ({MOE_ARCHS[arch]}) has mixture-of-experts MLPs "
                               "(ffn_*_exps tensors), which sparkq does not run; sparkq runs dense MLPs (qwen35: Qwen3.5)")
        if arch not in ARCHS:
            raise ConvertError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")
        self.arch = arch
        _, _, _, self.permuted, self.norm_shift = ARCHS[arch]
        self.tensors, self.rope_factors = {}, {}
        # llama.cpp counts a multi-token-prediction block (Qwen3.5's) as the last block(s): dropped
        self.layers = int(self._field(f"{arch}.block_count")) - int(self._field(f"{arch}.nextn_predict_layers", 0))
        for t in self.reader.tensors:
            if (m := re.match(r"blk\.(\d+)\.", t.name)) and int(m.group(1)) >= self.layers:
                continue
            name = hf_name(t.name, arch)
            if name is None:
                if t.name in ("rope_freqs.weight",):  # llama3 RoPE factors: rebuilt from rope_scaling
                    continue
                if t.name in ROPE_FACTOR_TENSORS:
                    self.rope_factors[t.name.split(".")[0]] = [float(v) for v in np.asarray(t.data, np.float32).ravel()]
                    continue
                raise ConvertError(f"{path}: GGUF tensor {t.name!r} has no Hugging Face equivalent known to sparkq")
            self.tensors[name] = t
        self.tensors = hy.stack_mlp(self.tensors)  # (Granite's shared MLP: ffn_gate and ffn_up as one)
        config = self._config()
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in self.tensors.items()}
        self.row_map, self.col_map = {}, {}
        if arch == "qwen35":
            for n in shapes:
                if n.endswith("linear_attn.conv1d.weight") and len(shapes[n]) == 2:  # squeezed by llama.cpp
                    shapes[n] = (shapes[n][0], 1, shapes[n][1])
            self.row_map, self.col_map = qwen35_maps(config, shapes)
        hy.hf_shapes(shapes)
        super().__init__(config=config, shapes=shapes,
                         origin={"kind": "gguf", "id": path.name, "name": self._field("general.name", None),
                                 **({"license": lic} if (lic := self._field("general.license", None)) else {})},
                         directory=None, extra_files=tokenizer_files(self._field, arch, config))
        self._cache: tuple[str, torch.Tensor] | None = None
        self.path = path
        # tensor bytes are read with pread, not through the reader's mapping: mapped pages would
        # count in the converter's RSS (the whole 1.1 GB file of a 1.5B model by the end)
        self._fd = os.open(path, os.O_RDONLY)
        # the metadata is read: drop the reader, whose fields hold a numpy view per string of the
        # vocabulary and merges (Qwen2.5-Coder-1.5B's 152k: +500 MiB anonymous memory, measured with
        # /proc/self/status RssAnon before and after GGUFReader()); the tensors keep their own records
        self.reader = None

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def _raw(self, t, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of tensor t's stored bytes, shaped as the reader's view of them."""
        rows = t.data.shape[0] if t.data.ndim > 1 else 1
        row_bytes = int(t.n_bytes) // rows
        buf = os.pread(self._fd, (r1 - r0) * row_bytes, int(t.data_offset) + r0 * row_bytes)
        return np.frombuffer(buf, dtype=t.data.dtype).reshape((r1 - r0, *t.data.shape[1:]) if t.data.ndim > 1 else -1)

    def _config(self) -> dict:
        """The HF config.json of the model, from the GGUF metadata."""
        a, f = self.arch, self.reader.fields
        hf_arch, model_type = ARCHS[a][:2]
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        head_dim = int(self._field(f"{a}.attention.key_length", 0)  # (Phi-3's rope dimension is its partial rotary's)
                       or (a != "phi3" and self._field(f"{a}.rope.dimension_count", 0)) or hidden // heads)
        layers = self.layers
        vocab = len(f["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in f else int(self._field(f"{a}.vocab_size"))
        config = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden,
            # (nemotron_h: a width per block, 0 for the mixer blocks)
            "intermediate_size": max(ff) if isinstance(ff := self._field(f"{a}.feed_forward_length"), list) else int(ff),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            # (lfm2 / granitehybrid: a count per layer, 0 for the recurrent layers)
            "num_key_value_heads": max(kv) if isinstance(kv := self._field(f"{a}.attention.head_count_kv", heads),
                                       list) else int(kv),
            "head_dim": head_dim,
            # (a float32 in the file: its shortest decimal, the checkpoint's 1e-05 rather than 9.9999997e-06)
            "rms_norm_eps": float(str(np.float32(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)))),
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field(f"{a}.context_length", 2048)),
            "vocab_size": vocab,
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "hidden_act": "silu",
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id", None),
            "pad_token_id": self._field("tokenizer.ggml.padding_token_id", None),
            "torch_dtype": "bfloat16",
        }
        kind = self._field(f"{a}.rope.scaling.type", None)
        if kind in ("linear", "yarn"):
            config["rope_scaling"] = {"rope_type": kind, "factor": float(self._field(f"{a}.rope.scaling.factor"))}
            if kind == "yarn":
                config["rope_scaling"]["original_max_position_embeddings"] = int(
                    self._field(f"{a}.rope.scaling.original_context_length", config["max_position_embeddings"]))
        window = self._field(f"{a}.attention.sliding_window", None)
        if a == "phi3":
            rot = int(self._field(f"{a}.rope.dimension_count", head_dim))
            config.update(partial_rotary_factor=rot / head_dim, sliding_window=int(window) if window else None)
            if self.rope_factors:
                orig = int(self._field(f"{a}.rope.scaling.original_context_length", config["max_position_embeddings"]))
                config["original_max_position_embeddings"] = orig
                config["rope_scaling"] = {"rope_type": "longrope", "long_factor": self.rope_factors["rope_factors_long"],
                                          "short_factor": self.rope_factors["rope_factors_short"],
                                          "original_max_position_embeddings": orig}
                if (att := self._field(f"{a}.rope.scaling.attn_factor", None)) is not None:
                    config["rope_scaling"]["attention_factor"] = float(att)
        elif a == "smollm3":
            config["no_rope_layers"] = [int((i + 1) % SMOLLM3_NOPE_STEP != 0) for i in range(layers)]
        elif a == "granite":
            for key, hf in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                            ("attention.scale", "attention_multiplier"), ("logit_scale", "logits_scaling")):
                if (v := self._field(f"{a}.{key}", None)) is not None:
                    config[hf] = float(v)
        elif a == "qwen35":
            qwen35_config(self._field, a, config, self.tensors)
        elif a in hy.ARCHS:
            hy.hybrid_config(self._field, a, config, self.tensors)
        if a in ("llama", "mistral"):
            config.update(attention_bias=False, mlp_bias=False)
            if a == "mistral":
                config["sliding_window"] = int(window) if window else None
        elif a == "qwen2":
            config.update(use_sliding_window=False, sliding_window=None)
        elif a == "qwen3":
            config.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
        elif a == "gemma3":
            swa = [(i + 1) % GEMMA3_SWA_PATTERN != 0 for i in range(layers)]
            config.update(
                hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
                sliding_window=int(window) if window else None,
                layer_types=["sliding_attention" if s else "full_attention" for s in swa],
                rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE,
                # llama.cpp scales queries by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for the
                # 62-layer 27B model, as its config's query_pre_attn_scalar says
                query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
                final_logit_softcapping=None, attn_logit_softcapping=None)
        return config

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

    def drop_cache(self) -> None:
        """Forget the one whole tensor kept dequantized (llama's q/k, norms): its bytes go back."""
        self._cache = None

    def _dequant(self, name: str) -> torch.Tensor:
        if self._cache and self._cache[0] == name:
            return self._cache[1]
        t = self.tensors[name]
        rows = t.data.shape[0] if t.data.ndim > 1 else 1
        arr = self._deq(t, 0, rows).astype(np.float32, copy=False)
        arr = arr.reshape(self.shapes[name])
        if name in self.row_map:
            arr = arr[self.row_map[name]]
        if name in self.col_map:
            arr = arr[:, self.col_map[name]]
        if name.endswith(hy.NEG_EXP):
            arr = np.log(-arr)  # ssm_a = -exp(A_log)
        if self.permuted and name.endswith(hy.Q_PROJ):
            arr = unpermute(arr, self.heads)
        elif self.permuted and name.endswith(hy.K_PROJ):
            arr = unpermute(arr, self.kv_heads)
        if self._shifted(name):
            arr = arr - 1.0
        # rounded through bf16, so converting the GGUF directly gives the same artifact as
        # converting its `sparkq import-gguf` checkpoint (the fidelity reference); fp32 parameters
        # stay fp32 (both keep them so)
        out = torch.from_numpy(np.require(arr, np.float32, ["C", "W"]))
        out = out if self.fp32(name) else out.to(torch.bfloat16)
        self._cache = (name, out)  # one tensor at a time
        return out

    def _shifted(self, name: str) -> bool:
        """A norm llama.cpp stored as 1 + w (Qwen3.5's DeltaNet norm excepted)."""
        return self.norm_shift and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")

    def fp32(self, name: str) -> bool:
        """A tensor read (and imported) as fp32: the DeltaNet's and Mamba-2's parameters."""
        return name.endswith(FP32_PARAMS)

    def _deq(self, t, a: int, b: int) -> np.ndarray:
        """Rows [a, b) of tensor t dequantized (a Stacked pair part by part)."""
        from gguf import quants

        if isinstance(t, hy.Stacked):
            return np.concatenate([self._deq(p, a0, b0) for p, a0, b0 in t.spans(a, b)])
        return quants.dequantize(self._raw(t, a, b), t.tensor_type)

    def _rows(self, t, idx: np.ndarray) -> np.ndarray:
        """The dequantized GGUF rows idx of tensor t, [len(idx), row], each run of consecutive rows
        read at once."""
        parts = []
        for run in np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1):
            a, b = int(run[0]), int(run[-1]) + 1
            arr = self._deq(t, a, b)
            parts.append(arr.astype(np.float32, copy=False).reshape(b - a, -1))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) in fp32 (bf16-rounded, but for the fp32 parameters). Only those rows are
        dequantized (every GGUF type stores a row's blocks together), except llama's q/k, whose
        permutation spans a head; Qwen3.5's value-reordered rows are read in runs of a head each."""
        t = self.tensors[name]
        whole = len(self.shapes[name]) == 1 or self._shifted(name) or \
            self.permuted and name.endswith(hy.Q_PROJ + hy.K_PROJ)
        if whole:
            return self._dequant(name)[r0:r1].to(torch.float32)
        if r1 <= r0:
            return torch.empty(0, *self.shapes[name][1:])
        idx = self.row_map[name][r0:r1] if name in self.row_map else np.arange(r0, r1)
        arr = self._rows(t, idx)
        if name in self.col_map:
            arr = arr[:, self.col_map[name]]
        out = torch.from_numpy(np.require(arr.reshape(r1 - r0, *self.shapes[name][1:]), np.float32, ["C", "W"]))
        return out if self.fp32(name) else out.to(torch.bfloat16).to(torch.float32)


def import_gguf(src: str, out: str, force: bool = False, progress: bool = True) -> dict:
    """Write the standard bf16 HF checkpoint equivalent to a GGUF file (``sparkq import-gguf``)."""
    p = Path(src)
    if not p.is_file():
        raise ConvertError(f"{src}: no such GGUF file")
    t0 = time.perf_counter()
    source = GGUFSource(p)
    names = sorted(source.shapes)
    # (the DeltaNet's parameters fp32, as Qwen3.5's checkpoints have A_log and the norm)
    f32 = {n for n in names if source.fp32(n)}
    entries = [(n, C.DTYPE_F32 if n in f32 else C.DTYPE_BF16, source.shapes[n]) for n in names]
    with atomic_dir(out, force) as tmp:
        w = TensorFileWriter(str(tmp / "model.safetensors"), entries, {"format": "pt"})
        for n in tqdm(names, desc="import-gguf", disable=not progress, leave=False):
            rows = source.shapes[n][0]
            v = source.read_rows(n, 0, rows).to(torch.float32 if n in f32 else torch.bfloat16)
            w.put(n, v.contiguous().view(torch.uint8).numpy())
            source.drop_cache()
        w.close()
        (tmp / C.CONFIG_FILE).write_text(json.dumps(source.config, indent=2, sort_keys=True))
        carried = carry_files(source, tmp)
        if source.origin.get("license"):  # keep the license with the weights (read back by spark-convert)
            (tmp / "README.md").write_text(f"---\nlicense: {source.origin['license']}\n---\n\n"
                                           f"bf16 checkpoint imported by `sparkq import-gguf` from {source.origin['id']}.\n")
            carried.append("README.md")
        size = (tmp / "model.safetensors").stat().st_size
    return {"source": source.origin, "output": str(Path(out).absolute()), "tensors": len(names),
            "bytes": size, "files": ["config.json", "model.safetensors", *carried],
            "seconds": time.perf_counter() - t0}
