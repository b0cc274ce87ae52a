"""The weight kinds: one entry per way an artifact stores a linear. Each names its tensors (suffix,
dtype, shape), its label in ``inspect`` and ``--bpw``, the layouts that hold it, and which tensor
fills which field of the C core's linear (``sq_linear``, csrc/sq_abi.h). The writer
(convert/writers.py), the reader (artifact.py, manifest.py), both runtimes
(runtime/core/session.py ``clinear``, runtime/torchrt/weights.py ``TORCH_LINEARS``) and the
budget read this table; adding a kind is an entry here, its writer, its torch linear and its kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import constants as C
from .layout import ROWS32
from .recipe import Recipe, SpecError

Shapes = dict  # tensor suffix -> (safetensors dtype, shape)


def _int4(n: int, k: int, g: int | None) -> Shapes:
    return {"qweight": (C.DTYPE_U8, (n, k // 2)), "scales_zeros": (C.DTYPE_BF16, (k // g, n, 2))}


def _residual(n: int, k: int, g: int, rows: int | None) -> Shapes:
    m = n if rows is None else rows
    out = {"residual": (C.DTYPE_U8, (m, k // 2)), "residual_scales": (C.DTYPE_BF16, (m, k // g))}
    if m < n:
        out["residual_map"] = (C.DTYPE_I32, (n,))
    return out


@dataclass(frozen=True)
class WeightKind:
    name: str
    grouped: bool  # a group size along K (scales and zeros per group); else per row or none
    layouts: tuple[str, ...] | None  # the packed layouts that hold it (None: every layout)
    splittable: bool  # may carry the head's residual plane (a split head, constants.py)
    k_multiple: int  # K must be a multiple of this (besides the group size)
    shapes: Callable[[int, int, int | None], Shapes]  # (n, k, g) -> the tensors without a residual plane
    core: tuple[tuple[str, str], ...]  # (sq_linear field, tensor suffix): what the C core reads

    def label(self, group_size: int | None, residual: bool = False, share: float | None = None) -> str:
        """How inspect and --bpw name the encoding: "lut4 g64", "int4 g128 + residual", "int8".
        share: the fraction of rows a partial split's second plane covers (None: all)."""
        if not self.grouped:
            return self.name
        part = "" if share is None else f" on {share:.1%} of rows"
        return f"{self.name} g{group_size}" + (f" + residual{part}" if residual else "")


RESIDUAL_CORE = (("res", "residual"), ("rsc", "residual_scales"), ("rmap", "residual_map"))

KINDS: dict[str, WeightKind] = {k.name: k for k in (
    WeightKind(C.KIND_INT4, True, None, True, 1, _int4, (("q", "qweight"), ("sz", "scales_zeros")) + RESIDUAL_CORE),
    WeightKind(C.KIND_LUT4, True, (ROWS32,), False, 32,
               lambda n, k, g: {**_int4(n, k, g), "levels": (C.DTYPE_I8, (n, 16))},
               (("q", "qweight"), ("sz", "scales_zeros"), ("lut", "levels"))),
    WeightKind(C.KIND_INT8, False, None, False, 1,
               lambda n, k, g: {"qweight": (C.DTYPE_I8, (n, k)), "scales": (C.DTYPE_BF16, (n,))},
               (("q", "qweight"), ("sz", "scales"))),
    WeightKind(C.KIND_BF16, False, None, False, 1, lambda n, k, g: {"weight": (C.DTYPE_BF16, (n, k))},
               (("q", "weight"),)),
)}


def weight_kind(kind: str, name: str = "linear") -> WeightKind:
    if kind not in KINDS:
        raise SpecError(f"{name}: unknown linear kind {kind!r} (known: {', '.join(KINDS)})")
    return KINDS[kind]


def role_of(linear_name: str) -> str:
    return linear_name.rsplit(".", 1)[-1]


def linear_tensors(name: str, kind: str, n: int, k: int, group_size: int | None,
                   residual: bool = False, residual_rows: int | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype, shape) of one linear in the artifact (``residual``: a
    split int4 linear's second plane, for ``residual_rows`` of its rows when fewer than N: a
    partial split with its row map, constants.py)."""
    wk = weight_kind(kind, name)
    if (residual or residual_rows is not None) and not wk.splittable:
        raise SpecError(f"{name}: only an int4 linear can have a residual plane, not {kind}")
    if wk.grouped and (group_size not in C.GROUP_SIZES or k % group_size or k % wk.k_multiple):
        extra = f" ({kind} also needs K % {wk.k_multiple} == 0)" if wk.k_multiple > 1 else ""
        raise SpecError(f"{name}: group size {group_size} does not divide K={k}{extra}")
    out = wk.shapes(n, k, group_size)
    if residual:
        if k % 32:
            raise SpecError(f"{name}: a residual plane needs K % 32 == 0, got K={k}")
        if residual_rows is not None and not 1 <= residual_rows <= n:
            raise SpecError(f"{name}: a residual plane covers 1 to {n} rows, not {residual_rows}")
        out.update(_residual(n, k, group_size, residual_rows))
    elif residual_rows is not None:
        raise SpecError(f"{name}: residual_rows without a residual plane")
    return {f"{name}.{s}": v for s, v in out.items()}


def choose_group_size(n: int, k: int, recipe: Recipe, role: str, requested: int | None = None) -> int | None:
    """The group size a linear gets, or None for bf16 (recipe rules; see recipes/llama.toml)."""
    if role in recipe.keep_bf16 or n % 16:
        return None
    first = requested or recipe.group_size
    if role in C.HEAD_ROLES and recipe.head_group_size:
        first = recipe.head_group_size
    for g in (first, *recipe.group_size_fallbacks):
        if g in C.GROUP_SIZES and g <= first and k % g == 0:
            return g
    return None
