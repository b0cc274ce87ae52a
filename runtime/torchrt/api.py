"""``sparkq.runtime.load``: artifact dir, Hub repo id, or bf16 HF checkpoint -> LoadedModel."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from sparkq.formats import constants as C
from sparkq.formats.artifact import Artifact, ArtifactError
from sparkq.formats.layout import LAYOUT_TO_CAPABILITY, ROWS32, LayoutError, host_layout
from sparkq.formats.recipe import recipe_for_config, text_model_view, wrapper_architecture
from sparkq.formats.spec import ModelSpec
from sparkq.formats.views import scaled, views

from ..common import (DEFAULT_KV_BUDGET_MIB, DEFAULT_KV_DTYPE, DEFAULT_MAX_MODEL_LEN, MALLOC_MMAP_THRESHOLD,  # noqa: F401
                     LoadInfo, check_kv_dtype, fix_malloc_mmap_threshold, kv_capacity, resolve)
from ..errors import RuntimeUserError
from ..generate import Generator
from .model import Model
from ..options import LabOptions
from ..tokenizer import ChatTokenizer
from .weights import DenseLinear, Scratch, linears_from_artifact


def check_layout(art_layout: str) -> None:
    if art_layout == ROWS32:
        return  # CPU-independent: the C core's (load() requires it)
    try:
        host = host_layout()
    except LayoutError as e:
        raise RuntimeUserError(str(e)) from None
    if art_layout != host:
        raise RuntimeUserError(
            f"artifact is packed for the {art_layout} layout but torch on this host runs the "
            f"{LAYOUT_TO_CAPABILITY[host]} int4 kernel (layout {host}); re-convert with "
            f"`spark-convert SRC OUT --target {host}` (or `--target native`)")


def _load_bf16_checkpoint(path: Path):
    """An unquantized HF checkpoint, through the same recipe (the fidelity reference)."""
    from safetensors import safe_open

    try:
        config = json.loads((path / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not an object")
        wrapper = wrapper_architecture(config)
        if wrapper is None:
            recipe = recipe_for_config(config)
            spec = ModelSpec.from_recipe(config, recipe)
    except FileNotFoundError:
        raise RuntimeUserError(f"{path}: neither a sparkq artifact nor an HF checkpoint (no config.json)") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise RuntimeUserError(f"{path}/config.json: {e}") from None
    try:
        idx = path / "model.safetensors.index.json"
        files = sorted({path / f for f in json.loads(idx.read_text())["weight_map"].values()}) if idx.exists() \
            else [path / "model.safetensors"]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise RuntimeUserError(f"{path}/model.safetensors.index.json: not a valid index (needs 'weight_map')") from None
    handles = {}
    for f in files:
        if not f.exists():
            raise RuntimeUserError(f"{f}: missing; the checkpoint is incomplete")
        try:
            h = safe_open(str(f), "pt")
        except Exception as e:  # safetensors raises its own error type on a bad header
            raise RuntimeUserError(f"{f}: not a readable safetensors file ({str(e)[:100]})") from None
        for k in h.keys():
            handles[k] = h
    if wrapper is not None:  # a multimodal checkpoint: its text model, under its text-only names
        try:
            config, names = text_model_view(config, handles)
            recipe = recipe_for_config(config)
            spec = ModelSpec.from_recipe(config, recipe)
        except ValueError as e:
            raise RuntimeUserError(f"{path}/config.json: {e}") from None
        handles = {t: handles[n] for t, n in names.items()}
        renamed = {t: n for t, n in names.items()}
    else:
        renamed = {}

    derived = views(recipe.family, config, {n: tuple(h.get_slice(renamed.get(n, n)).get_shape()) for n, h in handles.items()})

    def tensor(name):
        if name in derived:  # rows of other tensors (formats/views.py)
            return torch.cat([scaled(tensor(r[0])[r[1]:r[2]], r) for r in derived[name][1]])
        if name not in handles:
            raise RuntimeUserError(f"{path}: tensor {name} missing from the checkpoint")
        return handles[name].get_tensor(renamed.get(name, name))

    def get(name, shape, dtype=torch.bfloat16):
        t = tensor(name)
        if dtype == torch.float32 and t.numel() == torch.Size(shape).numel():  # a mixer's parameter (conv [C, 1, K])
            t = t.reshape(shape)
        if tuple(t.shape) != tuple(shape) or not t.is_floating_point():
            raise RuntimeUserError(f"{path}: tensor {name} is {t.dtype}{list(t.shape)}, config.json implies a float {list(shape)}")
        return t.to(dtype)

    srcs = recipe.source_names(spec)
    linears = {}
    for name, (_, k) in spec.linear_shapes().items():
        parts = [get(n, (r, k)) for n, r in zip(srcs[name], spec.part_rows(name, len(srcs[name])))]
        linears[name] = DenseLinear(name, parts[0] if len(parts) == 1 else torch.cat(parts, 0))
    norms = {}
    for n, shape in spec.vector_shapes().items():
        if spec.vector_dtype(n) == C.DTYPE_F32:  # kept in fp32, never rounded to bf16
            norms[n] = get(srcs[n][0], shape, torch.float32)
            continue
        # a fused vector (the qkv bias) has one part per fused linear part
        sizes = spec.part_rows(n.rsplit(".", 1)[0]) if len(srcs[n]) > 1 else [shape[0]]
        norms[n] = torch.cat([get(p, (r,)) for p, r in zip(srcs[n], sizes)])
    return config, spec, linears, norms


def _attach_fast(model: Model, lab: LabOptions, pinned: bool = False) -> str:
    """Attach the C core when it applies (``pinned``: a fixed thread count, else fewer while other
    programs take cores: runtime/core/threads.py); returns the decode path's name for LoadInfo."""
    from .. import core
    from . import fastpath

    if not lab.c_decode:
        return "torch (c_decode off)"
    why = fastpath.supported(model)
    if why:  # the model's step is not in the C core: its linears may still take the C products
        lib = None if fastpath.linears_supported(model) else core.try_load()
        if lib is None:
            return f"torch ({why})"
        fastpath.attach_linears(model, lib)
        return f"torch ({why}; its linears through the C products)"
    lib = core.try_load()
    if lib is None:
        return "torch (C decode core unavailable)"
    model.fast = fastpath.session(model, lib, torch.get_num_threads(), pinned)
    model.prefill_off = fastpath.prefill_supported(model, lib)
    model.c_prefill = lab.c_prefill
    fastpath.attach_linears(model, lib)
    built = sum(core.BUILD_SECONDS.values())
    return (f"c ({core.build_name(lib)}, {torch.get_num_threads()} threads"
            + ("" if pinned or torch.get_num_threads() == 1 else " (adaptive)")
            + (f", compiled in {built:.1f} s" if built else "") + ")")


def load(path_or_repo_id: str, *, max_model_len: int | None = None, kv_budget_mib: float = DEFAULT_KV_BUDGET_MIB,
         threads: int | None = None, prefill_dequant: bool | None = None, verify: bool = False,
         lab: LabOptions | None = None, kv_dtype: str = DEFAULT_KV_DTYPE) -> "LoadedModel":
    """Load a sparkq artifact (mapped, no copy) or a bf16 HF checkpoint (reference) on the torch runtime.

    ``max_model_len`` defaults to min(2048, the model's max_position_embeddings); the KV
    cache holds min(max_model_len, kv_budget_mib / bytes per token) tokens, each K and V row bf16
    or (``kv_dtype="int8"``) int8 codes with a bf16 scale per position and KV head. Decode steps, and
    prompts where every layer linear has a C prompt GEMM, go through the C core (rows32, int8 or
    bf16 linears, a C compiler present). ``prefill_dequant`` (``--prefill``) picks the prompt
    product of int4 linears otherwise: None (auto) the C core's W4A8 GEMM where it applies and pays
    (rows32, K >= 384, K a multiple of 64 and g 32 or a multiple of 64), else dequantize + dense GEMM; True always
    dequantize (weights x fp32 activations, no A8); False always the kernel. ``lab``: comparison
    arms (runtime/options.py).
    """
    lab = lab or LabOptions()
    check_kv_dtype(kv_dtype)
    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(int(threads))
    fixed = fix_malloc_mmap_threshold()
    path, hub = resolve(str(path_or_repo_id))
    if (path / C.MANIFEST_FILE).exists():
        try:
            art = Artifact.open(path)
        except ArtifactError as e:
            raise RuntimeUserError(str(e)) from None
        check_layout(art.layout)
        if art.layout == ROWS32 and lab.c_decode:
            from .. import core
            core.require(f"{path}: a rows32 artifact")
        if verify:
            bad = art.verify()
            if bad:
                raise RuntimeUserError(f"{path}: tensor {bad!r} does not match its sha256; the artifact is corrupt, re-download or re-convert it")
        tensors = art.map()
        spec, config = art.spec, art.config
        scratch = Scratch()
        linears = linears_from_artifact(art, tensors, scratch, prefill_dequant)
        norms = {n: tensors[n] for n in spec.vector_shapes()}
        kind, layout = "artifact", art.layout
    else:
        config, spec, linears, norms = _load_bf16_checkpoint(path)
        kind, layout, tensors = "bf16", None, None
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, spec.max_position)
    cap = kv_capacity(spec, max_model_len, kv_budget_mib, kv_dtype)
    model = Model(spec, linears, norms, max_model_len=max_model_len, kv_capacity=cap,
                  rope_len=spec.max_position if lab.rope_len_from_config else None, kv_dtype=kv_dtype)
    extra = {"hub": hub} if hub else {}
    extra["decode_path"] = _attach_fast(model, lab, pinned=bool(threads))
    extra["prefill_path"] = "c" if model.fast is not None and lab.c_prefill and model.prefill_off is None else \
        "torch" + (f" ({model.prefill_off})" if model.fast is not None and lab.c_prefill else "")
    extra["malloc_mmap_threshold"] = MALLOC_MMAP_THRESHOLD if fixed else None
    extra["kv_dtype"] = kv_dtype
    tok = ChatTokenizer.from_dir(path, config) if (path / "tokenizer.json").exists() else None
    info = LoadInfo(str(path_or_repo_id), kind, layout, time.perf_counter() - t0, cap, model.cache.nbytes,
                    sum(r.nbytes for r in model.ropes), max_model_len, extra)
    return LoadedModel(model, tok, info, tensors)


class LoadedModel(Generator):
    def __init__(self, model: Model, tokenizer: "ChatTokenizer", info: LoadInfo, tensors):
        super().__init__(tokenizer)
        self.model = model
        self.info = info
        self.tensors = tensors  # the mapped views (None for bf16 checkpoints)
        self._tok = torch.empty(1, dtype=torch.int64)

    @property
    def capacity(self) -> int:
        return self.model.capacity

    def check_fits(self, total_tokens: int) -> None:
        self.model.check_fits(total_tokens)

    def first_logits(self, ids: list[int]):
        return self.model.forward(torch.tensor(ids, dtype=torch.int64), 0, last_only=True)[-1].float().numpy()

    def next_logits(self, token: int, pos: int):
        self._tok[0] = token
        return self.model.forward(self._tok, pos, last_only=True)[-1].float().numpy()

    def prefill_from(self, ids: list[int], pos0: int):
        return self.model.forward(torch.tensor(ids[pos0:], dtype=torch.int64), pos0, last_only=True)[-1].float().numpy()

    def verify(self, tokens: list[int], pos: int):
        """(Generator.verify) through the C core's batched step where the model has it"""
        fast = self.model.fast
        if fast is None:
            self._fast_verify = False
            return super().verify(tokens, pos)
        self.model.check_fits(pos + len(tokens))
        self._fast_verify = True
        return fast.step_many(tokens, range(pos, pos + len(tokens)), [0] * len(tokens), rewind=True)

    def keep(self, n: int) -> None:
        if self._fast_verify:
            self.model.fast.rewind(0, n)
        else:
            super().keep(n)

    def logits(self, token_ids) -> torch.Tensor:
        return self.model.logits(token_ids)
