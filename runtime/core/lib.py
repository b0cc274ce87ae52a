"""Load a build of the C core: compile on first use (build.py), check its ABI (abi.py), cache it."""
from __future__ import annotations

import ctypes
import os
import sys

from . import abi
from .builds import OFF, KernelUnavailable, build, resolve_variant

_LIBS: dict[str, ctypes.CDLL] = {}
_KINDS: dict[int, dict[str, int]] = {}  # id(lib) -> {kind name: code}
_WARNED = False
BUILD_SECONDS: dict[str, float] = {}  # build -> seconds this process spent compiling it (0.0: cached)


def load(variant: str | None = None) -> ctypes.CDLL:
    """The library of a build (resolve_variant: the argument, $SPARKQ_KERNEL, or the best this
    CPU runs), compiled on first use; raises KernelUnavailable."""
    variant = resolve_variant(variant)
    if variant in _LIBS:
        return _LIBS[variant]
    path, BUILD_SECONDS[variant] = build(variant)
    lib = ctypes.CDLL(str(path))
    try:
        abi.declare(lib)
    except AttributeError as e:  # a library from before sq_abi_desc existed
        raise KernelUnavailable(f"{path}: {e}; delete it and run again") from None
    _KINDS[id(lib)] = abi.check(lib, path)
    _LIBS[variant] = lib
    return lib


def try_load() -> ctypes.CDLL | None:
    """The library, or None (with one line on stderr) when the C core is off or cannot be built."""
    global _WARNED
    if os.environ.get("SPARKQ_KERNEL", "").lower() in OFF:
        return None
    try:
        return load()
    except (KernelUnavailable, OSError) as e:
        if not _WARNED:
            print(f"sparkq: C decode path unavailable ({e}); using the torch path", file=sys.stderr)
            _WARNED = True
        return None


def kind_code(lib, kind: str) -> int:
    """The library's code for a linear kind (formats/constants.py KIND_* names)."""
    return _KINDS[id(lib)][kind]


def build_name(lib) -> str:
    """The build a loaded library is, else its products (sq_simd(): 3 AVX512-VNNI, 2 AVX2, 0 portable)."""
    named = next((v for v, other in _LIBS.items() if other is lib), None)
    return named or {3: "avx512-vnni", 2: "avx2"}.get(lib.sq_simd(), "scalar")
