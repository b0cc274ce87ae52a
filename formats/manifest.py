"""The manifest (``sparkq.json``) and config.json's ``quantization_config``: one type for the
writer (spark-convert) and the reader (``Artifact.open``); every key is a field here.

An artifact describes itself: the family and the resolved architecture ``features`` are
stored, so an artifact converted with a custom recipe (``--recipe FILE``) loads as converted.
Format-1 artifacts written before ``features`` existed load through the built-in recipe of
their family. Group sizes at the top level are derived from the linears, never stored apart
from them (constants.py: "Group sizes").
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from . import constants as C
from .kinds import KINDS
from .recipe import FEATURES


def sparkq_version() -> str:
    """The installed sparkq's version (the manifest's converter stamp)."""
    try:
        return version("sparkq")
    except PackageNotFoundError:
        return "0+unknown"


class ManifestError(ValueError):
    """A manifest that is not what this format says (the reader turns it into ArtifactError)."""


def encoding_label(kind: str, group_size: int | None, residual: bool = False, share: float | None = None) -> str:
    """share: the fraction of rows a partial split's second plane covers (None: all)."""
    return KINDS[kind].label(group_size, residual, share)


@dataclass
class LinearEntry:
    """One linear of the artifact: its kind, shape, applied int4 group size (None for int8 and
    bf16), source tensors, quantization error and whether it is split (a second 4-bit plane).
    The converter plans with it and the runtime reads it."""
    name: str
    kind: str
    n: int
    k: int
    group_size: int | None
    sources: list = field(default_factory=list)
    rel_error: float | None = None
    residual: bool = False
    residual_rows: int | None = None  # a partial split: the rows its second plane covers (None: all N)

    @property
    def role(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def encoding(self) -> str:
        """How the weights are stored, as inspect and --bpw name it: "lut4 g64", "int4 g128 +
        residual", "int8", "bf16"."""
        return encoding_label(self.kind, self.group_size, self.residual,
                              None if self.residual_rows is None else self.residual_rows / self.n)

    @property
    def group_label(self) -> str:
        """The conversion summary's and inspect's group: "g128", "g64+residual", "g64/lut4", "int8"."""
        if not self.group_size:
            return self.kind
        return f"g{self.group_size}" + ("+residual" if self.residual else "") + \
            ("" if self.kind == C.KIND_INT4 else f"/{self.kind}")

    def to_json(self) -> dict:
        d = {"role": self.role, "kind": self.kind, "n": self.n, "k": self.k, "group_size": self.group_size,
             "sources": self.sources, "rel_error": None if self.rel_error is None else round(self.rel_error, 6)}
        if self.residual:
            d["residual"] = True
        if self.residual_rows is not None:
            d["residual_rows"] = self.residual_rows
        return d

    @classmethod
    def from_json(cls, name: str, e) -> "LinearEntry":
        if not isinstance(e, dict) or e.get("kind") not in KINDS \
                or type(e.get("n")) is not int or type(e.get("k")) is not int \
                or not (e.get("group_size") is None or type(e.get("group_size")) is int) \
                or not isinstance(e.get("sources", []), list) or type(e.get("residual", False)) is not bool \
                or not (e.get("residual_rows") is None or type(e.get("residual_rows")) is int):
            raise ManifestError(f"field 'linears.{name}' must be {{kind: {'|'.join(KINDS)}, n: int, k: int, "
                                "group_size: int|null, sources: list, residual: bool, residual_rows: int (optional)}")
        rel = e.get("rel_error")
        grouped = KINDS[e["kind"]].grouped
        return cls(name, e["kind"], e["n"], e["k"], e["group_size"] if grouped else None,
                   list(e.get("sources") or []), rel if isinstance(rel, (int, float)) else None, e.get("residual", False),
                   e.get("residual_rows"))


def group_sizes(linears) -> list[int]:
    return sorted({lin.group_size for lin in linears if lin.group_size})


@dataclass
class Manifest:
    layout: str
    family: str
    method: str
    tied: bool
    linears: dict  # name -> LinearEntry
    tensors: dict  # tensor name -> {"sha256": hex, "role": ..., "linear": owner | "sources": [...]}
    features: dict | None = None  # the resolved recipe features (spec.FEATURES); None: a pre-features artifact
    recipe: str | None = None  # the recipe it was converted with (built-in family name or the file given)
    group_size_requested: int | None = None
    calibration: dict | None = None
    source: dict | None = None
    converter: dict | None = None
    format: str = C.FORMAT_NAME
    format_version: int = C.FORMAT_VERSION
    bits: int = C.BITS
    # the keys' power-of-two channel scaling (convert/keyscale.py): {"applied": bool, "exponents" |
    # "why"}; None: written before it existed (nothing to undo at load: q.k is the same either way)
    key_scaling: dict | None = None

    @property
    def group_sizes(self) -> list[int]:
        """The distinct int4 group sizes the linears got, ascending."""
        return group_sizes(self.linears.values())

    @property
    def group_size(self) -> int | None:
        """The int4 group size every int4 linear has, or None when they differ (or there are none)."""
        g = self.group_sizes
        return g[0] if len(g) == 1 else None

    def _group_fields(self) -> dict:
        return {"group_size": self.group_size, "group_sizes": self.group_sizes,
                "group_size_requested": self.group_size_requested}

    def to_json(self) -> dict:
        d = {"format": self.format, "format_version": self.format_version, "layout": self.layout,
             "family": self.family, "method": self.method, "bits": self.bits, **self._group_fields(), "tied": self.tied,
             "converter": self.converter, "source": self.source,
             "linears": {n: lin.to_json() for n, lin in self.linears.items()}, "tensors": self.tensors}
        for key in ("calibration", "features", "recipe", "key_scaling"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)

    def quantization_config(self) -> dict:
        """config.json's quantization_config: a quant_method transformers does not know, so a plain
        from_pretrained fails instead of building a random model."""
        return {"quant_method": C.QUANT_METHOD, "format": self.format, "format_version": self.format_version,
                "bits": self.bits, **self._group_fields(), "layout": self.layout, "method": self.method,
                "weights_file": C.WEIGHTS_FILE,
                "note": "sparkq int4 artifact: load with sparkq.runtime.load(), not transformers"}

    @classmethod
    def from_json(cls, m) -> "Manifest":
        """Every field's type checked before any is used; ManifestError names the first bad one."""
        def bad(key, want):
            raise ManifestError(f"field {key!r} must be {want}")

        if not isinstance(m, dict):
            bad("(top level)", "an object")
        for key, typ, want in (("format", str, "a string"), ("layout", str, "a string"), ("family", str, "a string"),
                               ("method", str, "a string"), ("linears", dict, "an object"),
                               ("tensors", dict, "an object")):
            if not isinstance(m.get(key), typ):
                bad(key, want)
        if type(m.get("format_version")) is not int:
            bad("format_version", "an integer")
        if type(m.get("tied")) is not bool:
            bad("tied", "true or false")
        for key in ("source", "calibration", "converter", "key_scaling"):
            if m.get(key) is not None and not isinstance(m[key], dict):
                bad(key, "an object")
        feats = m.get("features")
        if feats is not None and (not isinstance(feats, dict) or set(feats) - set(FEATURES)):
            bad("features", f"an object with keys among {', '.join(FEATURES)}")
        if m.get("recipe") is not None and not isinstance(m["recipe"], str):
            bad("recipe", "a string")
        req = m.get("group_size_requested")
        if req is not None and type(req) is not int:
            bad("group_size_requested", "an integer")
        linears = {name: LinearEntry.from_json(name, e) for name, e in m["linears"].items()}
        for name, e in m["tensors"].items():
            if not isinstance(e, dict) or not isinstance(e.get("sha256"), str):
                bad(f"tensors.{name}", "{sha256: string}")
        out = cls(m["layout"], m["family"], m["method"], m["tied"], linears, m["tensors"], feats, m.get("recipe"), req,
                  m.get("calibration"), m.get("source"), m.get("converter"), m["format"], m["format_version"],
                  m.get("bits", C.BITS), m.get("key_scaling"))
        if "group_sizes" in m and m["group_sizes"] != out.group_sizes:  # written by this format's writer
            raise ManifestError(f"field 'group_sizes' {m['group_sizes']} contradicts the linears' {out.group_sizes}")
        return out

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        return cls.from_json(json.loads(Path(path).read_text()))
