"""Source checkpoints: a local HF dir (single file or shards), a Hub repo id, or a GGUF file.

A source gives the HF config, the shapes of its tensors (from headers, no data read),
and reads rows of one tensor at a time with ``pread``: nothing is memory-mapped, so the
converter's resident memory stays near the block it is working on, not the model.
Nothing is ever unpickled: only safetensors and GGUF are read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sparkq.formats import constants as C
from sparkq.formats.recipe import SpecError, text_model_view, wrapper_architecture
from sparkq.formats.tensorfile import TensorFileError, read_header
from sparkq.formats.views import runs_between, scaled, views
from sparkq.runtime.hub import HubError, is_repo_id, snapshot, split_repo

from .errors import ConvertError

SRC_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class Source:
    config: dict
    shapes: dict[str, tuple[int, ...]]
    origin: dict  # {"kind": "dir"|"hub"|"gguf", "id": ..., "revision": ...}
    directory: Path | None = None  # where tokenizer files etc. live
    extra_files: dict[str, bytes] = field(default_factory=dict)  # generated files (GGUF)

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self, name: str) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SafetensorsSource(Source):
    def __init__(self, directory: Path, origin: dict):
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            raise ConvertError(f"{directory}: no config.json; give a Hugging Face checkpoint directory, a repo id, or a .gguf file")
        try:
            config = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConvertError(f"{cfg_path}: not valid JSON ({e.__class__.__name__}); fix or re-download the checkpoint") from None
        files = self._weight_files(directory)
        self.where: dict[str, tuple[Path, object]] = {}
        shapes = {}
        for f in files:
            try:
                infos, _ = read_header(str(f), require_alignment=False)
            except TensorFileError as e:
                raise ConvertError(str(e)) from None
            for name, info in infos.items():
                self.where[name] = (f, info)
                shapes[name] = info.shape
        super().__init__(config=config, shapes=shapes, origin=origin, directory=directory)
        self._fds: dict[Path, int] = {}

    @staticmethod
    def _weight_files(directory: Path) -> list[Path]:
        idx = directory / "model.safetensors.index.json"
        if idx.is_file():
            try:
                wm = json.loads(idx.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConvertError(f"{idx}: not a valid safetensors index (needs 'weight_map'); re-download the checkpoint") from None
            files = sorted({directory / v for v in wm.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConvertError(f"{directory}: shard {missing[0]} named in model.safetensors.index.json is missing; download all shards")
            return files
        single = directory / "model.safetensors"
        if single.is_file():
            return [single]
        if list(directory.glob("*.bin")) or list(directory.glob("*.pth")):
            raise ConvertError(f"{directory}: only pickle weights (.bin/.pth) found; sparkq never unpickles, use a safetensors checkpoint")
        raise ConvertError(f"{directory}: no model.safetensors or model.safetensors.index.json; give a safetensors checkpoint")

    def nbytes(self, name: str) -> int:
        return self.where[name][1].nbytes

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        path, info = self.where[name]
        if info.dtype not in SRC_DTYPES:
            raise ConvertError(f"{path.name}: tensor {name} has dtype {info.dtype}; sparkq converts bf16/fp16/fp32 checkpoints only")
        row = (info.nbytes // info.shape[0]) if info.shape and info.shape[0] else info.nbytes
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        n = (r1 - r0) * row
        buf = bytearray(n)
        got = os.preadv(fd, [buf], info.start + r0 * row)
        if got != n:
            raise ConvertError(f"{path.name}: tensor {name} is truncated; re-download the checkpoint")
        t = torch.frombuffer(buf, dtype=SRC_DTYPES[info.dtype]) if n else torch.empty(0, dtype=SRC_DTYPES[info.dtype])
        rest = info.shape[1:] if len(info.shape) > 1 else ()
        return t.view(r1 - r0, *rest).to(torch.float32)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# Files fetched from the Hub for a conversion (never pickles).
HUB_PATTERNS = ["config.json", "model.safetensors", "model-*.safetensors", "model.safetensors.index.json",
                "README.md", *C.TOKENIZER_FILES,
                # an embedding model's pooling (runtime/embedding.py; carried by convert/output.py)
                "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", "*_Pooling/*.json"]


def read_fused_rows(source: Source, parts: list[str], part_rows: list[int], r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of the virtual concatenation of the parts along N."""
    out, base = [], 0
    for p, rows in zip(parts, part_rows):
        a, b = max(r0, base), min(r1, base + rows)
        if a < b:
            out.append(source.read_rows(p, a - base, b - base))
        base += rows
    return out[0] if len(out) == 1 else torch.cat(out, 0)


def card_license(directory: Path) -> dict:
    """license / license_name / license_link from a model card's YAML header, if any."""
    readme = directory / "README.md"
    if not readme.is_file():
        return {}
    try:
        from huggingface_hub.repocard import metadata_load
        meta = metadata_load(readme) or {}
    except Exception:  # a malformed card must not stop a conversion
        return {}
    return {k: meta[k] for k in ("license", "license_name", "license_link") if isinstance(meta.get(k), str)}


def resolve_hub(repo: str, revision: str | None = None, allow_patterns=None) -> Path:
    """Download (or find in the HF cache) a Hub repo's needed files; honours HF_HUB_OFFLINE."""
    try:
        return snapshot(repo, revision, allow_patterns or HUB_PATTERNS)
    except HubError as e:
        raise ConvertError(str(e)) from None


class TextOnlySource(Source):
    """The text model inside a multimodal checkpoint, under the names and config of its text-only
    architecture (``TEXT_MODELS``); every other tensor (vision tower, projector) is left out."""

    def __init__(self, base: Source, arch: str):
        try:
            config, self.names = text_model_view(base.config, base.shapes)
        except SpecError as e:
            raise ConvertError(str(e)) from None
        self.base = base
        super().__init__(config=config, shapes={t: base.shapes[n] for t, n in self.names.items()},
                         origin={**base.origin, "text_only": f"{arch}: the text model; vision tower and projector dropped"},
                         directory=base.directory, extra_files=base.extra_files)

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        return self.base.read_rows(self.names[name], r0, r1)

    def nbytes(self, name: str) -> int:
        return self.base.nbytes(self.names[name])

    def close(self) -> None:
        self.base.close()


def text_model(source: Source) -> Source:
    """The source itself, or its text model where it is a multimodal wrapper sparkq knows."""
    arch = wrapper_architecture(source.config)
    return TextOnlySource(source, arch) if arch else source


class ViewSource(Source):
    """A source with its family's derived tensors beside its own (formats/views.py)."""

    def __init__(self, base: Source, views: dict):
        self.base, self.views = base, views
        super().__init__(config=base.config, shapes={**base.shapes, **{n: v[0] for n, v in views.items()}},
                         origin=base.origin, directory=base.directory, extra_files=base.extra_files)

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        if name not in self.views:
            return self.base.read_rows(name, r0, r1)
        parts = [scaled(self.base.read_rows(r[0], r[1], r[2]), r) for r in runs_between(self.views[name][1], r0, r1)]
        return torch.cat(parts) if parts else torch.empty(0, *self.views[name][0][1:])

    def nbytes(self, name: str) -> int:
        return sum(self.base.nbytes(r[0]) * (r[2] - r[1]) // self.base.shapes[r[0]][0] for r in self.views[name][1]) \
            if name in self.views else self.base.nbytes(name)

    def close(self) -> None:
        self.base.close()


def with_views(source: Source) -> Source:
    """The source with its family's derived tensors (formats/views.py), where it has any."""
    from sparkq.formats.recipe import recipe_for_config
    try:
        family = recipe_for_config(source.config).family
    except SpecError:
        return source
    v = views(family, source.config, source.shapes)
    return ViewSource(source, v) if v else source


def open_source(src: str) -> Source:
    return with_views(text_model(_open_source(src)))


def _open_source(src: str) -> Source:
    p = Path(src)
    if p.is_file() and p.suffix == ".gguf":
        from .gguf_source import GGUFSource
        return GGUFSource(p)
    if p.is_dir():
        return SafetensorsSource(p, {"kind": "dir", "id": str(p.resolve()), **card_license(p)})
    if p.exists():
        raise ConvertError(f"{src}: not a checkpoint directory or a .gguf file")
    if is_repo_id(src):
        repo, rev = split_repo(src)
        d = resolve_hub(repo, rev)
        return SafetensorsSource(d, {"kind": "hub", "id": repo, "revision": rev or "main", "snapshot": d.name,
                                     **card_license(d)})
    raise ConvertError(f"{src}: no such file or directory (and not a Hub repo id of the form org/name[@revision])")


