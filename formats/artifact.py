"""Open, validate, map and verify a sparkq artifact directory.

``Artifact.open(dir)`` checks, before mapping anything: the format name and version,
the layout id, that config.json, the manifest and the weights header agree, and that
every tensor the config requires is present with the dtype, shape and group size the
format prescribes (spec.py). ``Artifact.map()`` then returns tensors that are views
into one private memory map of the weights file: no copy, no repack, no dtype change.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

from . import constants as C
from .layout import LAYOUTS
from .manifest import LinearEntry, Manifest, ManifestError
from .kinds import KINDS, linear_tensors
from .recipe import SpecError, builtin_recipes
from .spec import ModelSpec
from .tensorfile import TensorFileError, TensorInfo, read_header


class ArtifactError(ValueError):
    """One-line, user-facing problem with an artifact (names what and how to fix)."""


# numpy has no bfloat16: BF16 maps to its bit pattern (uint16), which is what the C core reads
NUMPY_DTYPES = {"U8": np.uint8, "BF16": np.uint16, "F16": np.float16, "F32": np.float32, "I8": np.int8,
                "I32": np.int32, "I64": np.int64}


def torch_dtypes() -> dict:
    import torch  # not at import time: sparkq.formats stays importable without loading torch
    return {"U8": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
            "I8": torch.int8, "I32": torch.int32, "I64": torch.int64}


def _load_json(path: Path, what: str) -> dict:
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing; {what}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e.__class__.__name__}); the artifact is corrupt, re-download or re-convert it") from None
    if not isinstance(d, dict):
        raise ArtifactError(f"{path}: expected a JSON object; the artifact is corrupt")
    return d


class Artifact:
    def __init__(self, path: Path, config: dict, manifest: Manifest, infos: dict[str, TensorInfo],
                 spec: ModelSpec, linears: dict[str, LinearEntry]):
        self.path = path
        self.config = config
        self.manifest = manifest
        self.infos = infos
        self.spec = spec
        self.linears = linears
        self.layout: str = manifest.layout
        self.weights_path = path / C.WEIGHTS_FILE

    # ---------------------------------------------------------------- open/validate
    @classmethod
    def open(cls, path: str | os.PathLike) -> "Artifact":
        path = Path(path)
        if not path.is_dir():
            raise ArtifactError(f"{path}: not a directory; give the artifact directory written by spark-convert")
        if not (path / C.MANIFEST_FILE).exists():
            hint = " (this looks like a plain HF checkpoint: convert it with spark-convert)" if (path / "config.json").exists() else ""
            raise ArtifactError(f"{path}: no {C.MANIFEST_FILE}, not a sparkq artifact{hint}")
        config = _load_json(path / C.CONFIG_FILE, "the artifact is incomplete, re-convert it")
        try:
            m = Manifest.from_json(_load_json(path / C.MANIFEST_FILE, "the artifact is incomplete, re-convert it"))
        except ManifestError as e:
            raise ArtifactError(f"{path}/{C.MANIFEST_FILE}: {e}; the artifact is corrupt, re-convert") from None
        if m.format != C.FORMAT_NAME:
            raise ArtifactError(f"{path}: manifest format is {m.format!r}, expected {C.FORMAT_NAME!r}")
        if m.format_version != C.FORMAT_VERSION:
            raise ArtifactError(f"{path}: format version {m.format_version!r} is not supported by this sparkq "
                                f"(reads version {C.FORMAT_VERSION}); upgrade sparkq or re-convert")
        if m.layout not in LAYOUTS:
            raise ArtifactError(f"{path}: unknown packed layout {m.layout!r}; known: {', '.join(LAYOUTS)}")
        qc = config.get("quantization_config")
        if not isinstance(qc, dict) or qc.get("quant_method") != C.QUANT_METHOD or qc.get("layout") != m.layout:
            raise ArtifactError(f"{path}: config.json quantization_config does not match the manifest; the artifact is inconsistent, re-convert it")
        wpath = path / C.WEIGHTS_FILE
        if not wpath.exists():
            raise ArtifactError(f"{wpath}: missing; the artifact is incomplete, re-download or re-convert it")
        try:
            infos, meta = read_header(str(wpath))
        except TensorFileError as e:
            raise ArtifactError(str(e)) from None
        if meta.get("format") != C.FORMAT_NAME or meta.get("layout") != m.layout or meta.get("format_version") != str(C.FORMAT_VERSION):
            raise ArtifactError(f"{wpath}: header metadata {meta} does not match the manifest; re-convert")
        try:
            if m.features is not None:  # the artifact describes itself
                spec = ModelSpec.from_config(config, m.family, **m.features)
            else:  # written before features were stored: the built-in recipe of its family
                spec = ModelSpec.from_recipe(config, builtin_recipes()[m.family])
        except SpecError as e:
            raise ArtifactError(f"{path}/config.json: {e}") from None
        except KeyError:
            raise ArtifactError(f"{path}: family {m.family!r} is not known to this sparkq; upgrade sparkq or "
                                "re-convert (artifacts from a newer converter describe their features)") from None
        except TypeError as e:
            raise ArtifactError(f"{path}/{C.MANIFEST_FILE}: bad features ({e}); re-convert") from None
        if m.tied != spec.tied:
            raise ArtifactError(f"{path}: manifest says tied={m.tied} but config.json says tie_word_embeddings={spec.tied}")
        linears = cls._validate_tensors(path, m, infos, spec)
        return cls(path, config, m, infos, spec, linears)

    @staticmethod
    def _validate_tensors(path: Path, m: Manifest, infos: dict[str, TensorInfo], spec: ModelSpec) -> dict[str, LinearEntry]:
        tens_meta = m.tensors
        if len(m.linears) != len(spec.linear_shapes()):
            raise ArtifactError(f"{path}: the manifest lists {len(m.linears)} linears but config.json implies "
                                f"{len(spec.linear_shapes())}; config and weights disagree, re-convert")
        expected: dict[str, tuple[str, tuple]] = {}
        linears = {}
        for name, (n, k) in spec.linear_shapes().items():
            e = m.linears.get(name)
            if e is None:
                raise ArtifactError(f"{path}: linear {name!r} missing from the manifest (config needs it); re-convert")
            g = e.group_size
            wk = KINDS[e.kind]
            if wk.layouts is not None and m.layout not in wk.layouts:
                raise ArtifactError(f"{path}: linear {name!r} is {e.kind}, which only the {'/'.join(wk.layouts)} layout "
                                    "holds; re-convert")
            if wk.grouped and (g not in C.GROUP_SIZES or k % g):
                raise ArtifactError(f"{path}: linear {name!r} has group size {g!r}, which does not divide K={k} or is not one of {C.GROUP_SIZES}")
            if (e.n, e.k) != (n, k):
                raise ArtifactError(f"{path}: linear {name!r} is {e.n}x{e.k} in the manifest but the config needs {n}x{k}")
            try:
                expected.update(linear_tensors(name, e.kind, n, k, g, e.residual, e.residual_rows))
            except SpecError as err:
                raise ArtifactError(f"{path}: {err}") from None
            linears[name] = e
        for name, shape in spec.vector_shapes().items():
            expected[name] = (spec.vector_dtype(name), shape)
        for name, (dtype, shape) in expected.items():
            t = infos.get(name)
            if t is None:
                raise ArtifactError(f"{path}: tensor {name!r} is missing from {C.WEIGHTS_FILE}; the artifact is incomplete, re-convert")
            if t.dtype != dtype or t.shape != tuple(shape):
                raise ArtifactError(f"{path}: tensor {name!r} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
            d = tens_meta.get(name)
            if not isinstance(d, dict) or not isinstance(d.get("sha256"), str) or len(d["sha256"]) != 64:
                raise ArtifactError(f"{path}: manifest has no sha256 for tensor {name!r}; re-convert")
        extra = [n for n in infos if n not in expected and not n.startswith(C.PAD_PREFIX)]
        if extra:
            raise ArtifactError(f"{path}: unexpected tensor {extra[0]!r} in {C.WEIGHTS_FILE} (not in the format for this config)")
        return linears

    # ---------------------------------------------------------------- data access
    @staticmethod
    def _advise_hugepages(addr: int, length: int) -> None:
        """madvise(MADV_HUGEPAGE) on the weights mapping (Linux; best effort, errors ignored):
        where the file enters the page cache through this mapping (not cached yet: after a
        reboot or an eviction), the kernel reads it in 2 MiB folios and maps them with PMD
        entries (seen here: ext4, Linux 6.18, FilePmdMapped = the whole file), so streaming the
        weights takes ~500x fewer TLB misses. Decode at the Qwen3-1.7B shape, the same artifact
        with its page cache in 2 MiB vs 4 KiB folios, 5 interleaved passes: +2.6% to +7% in every
        pass (docs/performance.md "Memory"). spark-convert writes in aligned 4 MiB pieces
        so that its output is cached in 2 MiB folios; a file cached in small folios (a download,
        a `cp`) keeps them until evicted. SPARKQ_THP=0 skips the advice."""
        if os.environ.get("SPARKQ_THP", "1") == "0" or not sys.platform.startswith("linux") or length <= 0:
            return
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise(addr, length, 14)  # MADV_HUGEPAGE
        except (OSError, AttributeError):
            pass

    def _advise_rows(self, base: int) -> None:
        """madvise(MADV_NOHUGEPAGE, MADV_RANDOM) on the tensors read a row per token (Gemma 4's
        per-layer input table, constants.ROW_READ; Linux, best effort): a token's row faults in its
        own pages, not the 2 MiB folio or the read-around window around them (the E2B shape's table
        after a 128-token generation: 240 MiB resident of 2240 without this; docs/performance.md)."""
        if not sys.platform.startswith("linux"):
            return
        import ctypes
        import mmap

        page = mmap.PAGESIZE
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            return
        for name, t in self.infos.items():
            if name.split(".")[0] in C.ROW_READ and t.nbytes:
                a, b = (base + t.start + page - 1) // page * page, (base + t.start + t.nbytes) // page * page
                if b > a:
                    libc.madvise(a, b - a, 15)  # MADV_NOHUGEPAGE
                    libc.madvise(a, b - a, 1)  # MADV_RANDOM

    def map(self) -> dict[str, torch.Tensor]:
        """Every tensor as a view into one private mmap of the weights file."""
        import torch

        TORCH_DTYPES = torch_dtypes()
        size = os.path.getsize(self.weights_path)
        storage = torch.UntypedStorage.from_file(str(self.weights_path), shared=False, nbytes=size)
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._advise_hugepages(flat.data_ptr(), size)
        self._advise_rows(flat.data_ptr())
        out = {}
        for name, t in self.infos.items():
            if name.startswith(C.PAD_PREFIX):
                continue
            dt = TORCH_DTYPES[t.dtype]
            view = flat[t.start:t.start + t.nbytes]
            out[name] = view.view(dt).view(t.shape) if t.nbytes else torch.empty(t.shape, dtype=dt)
        self._check_residual_maps({n: v.numpy() for n, v in out.items() if n.endswith(".residual_map")})
        return out

    def map_numpy(self) -> dict[str, np.ndarray]:
        """Every tensor as a read-only numpy view into one mmap of the weights file (no torch;
        bf16 tensors as their uint16 bit patterns)."""
        flat = np.memmap(self.weights_path, dtype=np.uint8, mode="r")
        self._advise_hugepages(flat.ctypes.data, flat.nbytes)
        self._advise_rows(flat.ctypes.data)
        out = {}
        for name, t in self.infos.items():
            if name.startswith(C.PAD_PREFIX):
                continue
            dt = NUMPY_DTYPES[t.dtype]
            out[name] = flat[t.start:t.start + t.nbytes].view(dt).reshape(t.shape) if t.nbytes else np.empty(t.shape, dt)
        self._check_residual_maps(out)
        return out

    def _check_residual_maps(self, tensors: dict) -> None:
        """A partial split's row map (constants.py) names each covered row's plane row once, in
        ascending order, and -1 elsewhere: the kernels index the planes with it, so a map that
        points outside them is refused here, not read."""
        for lin in self.linears.values():
            if lin.residual_rows is None or lin.residual_rows == lin.n:
                continue
            name = f"{lin.name}.residual_map"
            mp = np.asarray(tensors[name])
            got = mp[mp >= 0]
            if (mp < -1).any() or got.size != lin.residual_rows or not np.array_equal(got, np.arange(got.size)):
                raise ArtifactError(f"{self.path}: tensor {name!r} is not a row map of {lin.residual_rows} rows "
                                    "(constants.py); the artifact is corrupt, re-convert or re-download it")

    def verify(self, progress=None) -> str | None:
        """Recompute every tensor digest; returns the first mismatching tensor name or None."""
        expected = self.manifest.tensors
        with open(self.weights_path, "rb") as f:
            for name, t in sorted(self.infos.items(), key=lambda kv: kv[1].start):
                if name.startswith(C.PAD_PREFIX):
                    continue
                f.seek(t.start)
                h = hashlib.sha256()
                left = t.nbytes
                while left:
                    chunk = f.read(min(left, 8 << 20))
                    if not chunk:
                        return name
                    h.update(chunk)
                    left -= len(chunk)
                    if progress:
                        progress(len(chunk))
                if h.hexdigest() != expected[name]["sha256"]:
                    return name
        return None

    # ---------------------------------------------------------------- reporting
    def summary(self) -> dict:
        """Layout, group sizes, per-role bytes and bits per weight (inspect's data)."""
        roles: dict[str, int] = {}
        groups: dict[str, int] = {}
        encodings: dict[str, dict[str, int]] = {}
        q_params = q_bytes = 0
        for lin in self.linears.values():
            e = encodings.setdefault(lin.role, {})
            e[lin.encoding] = e.get(lin.encoding, 0) + 1
            b = sum(self.infos[n].nbytes for n in linear_tensors(lin.name, lin.kind, lin.n, lin.k, lin.group_size,
                                                                  lin.residual, lin.residual_rows))
            roles[lin.role] = roles.get(lin.role, 0) + b
            groups[lin.group_label] = groups.get(lin.group_label, 0) + 1
            q_params += lin.n * lin.k
            q_bytes += b
        vectors = self.spec.vector_shapes()
        roles["norms/biases"] = sum(self.infos[n].nbytes for n in vectors)
        total = os.path.getsize(self.weights_path)
        params = q_params + sum(s[0] for s in vectors.values())
        return {
            "path": str(self.path),
            "format_version": self.manifest.format_version,
            "layout": self.layout,
            "method": self.manifest.method,
            "family": self.spec.family,
            "tied_embeddings": self.spec.tied,
            "source": self.manifest.source,
            "group_sizes": groups,
            "encodings": encodings,
            "bytes_by_role": roles,
            "weights_file_bytes": total,
            "parameters": params,
            "bits_per_weight": 8 * total / params,
            "bits_per_weight_linears": 8 * q_bytes / q_params,
            "key_scaling": _key_scaling_summary(self.manifest.key_scaling),
            "linears": {n: {"kind": l.kind, "n": l.n, "k": l.k, "group_size": l.group_size, "rel_error": l.rel_error,
                            **({"residual": True} if l.residual else {}),
                            **({"residual_rows": l.residual_rows} if l.residual_rows is not None else {})}
                        for n, l in self.linears.items()},
        }


def _key_scaling_summary(k: dict | None) -> str:
    if k is None:
        return "not recorded (converted before key scaling)"
    if not k.get("applied"):
        return f"none: {k.get('why', '?')}"
    ex = [abs(e) for layer in k.get("exponents", {}).values() for e in (layer if isinstance(layer[0], int) else
                                                                          [v for row in layer for v in row])]
    return (f"{sum(1 for e in ex if e)} of {len(ex)} key channels scaled by 2^-e (e <= {max(ex, default=0)}), "
            f"queries by 2^e, {len(k.get('exponents', {}))} layers")

