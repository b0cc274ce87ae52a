"""Load a build of the C core: a wheel's prebuilt one or compiled on first use (builds.py), check its ABI (abi.py), cache it."""
from __future__ import annotations

import ctypes
import os
import sys

from . import abi
from .builds import OFF, KernelChoiceError, KernelUnavailable, compiler, host_builds, library, resolve_variant

_LIBS: dict[str, ctypes.CDLL] = {}
_KINDS: dict[int, dict[str, int]] = {}  # id(lib) -> {kind name: code}
_WARNED = False
BUILD_SECONDS: dict[str, float] = {}
PATHS: dict[str, str] = {}  # build -> the file loaded (a wheel's prebuilt one or the cache's)
# spins before a thread waiting at a barrier sleeps (libgomp's default: 300000, ~1 ms): one that
# sleeps gives its core to the thread of ours that another program's process took a core from
# (threads.py); decode's waits are shorter than this, so a quiet machine keeps spinning. Measured:
# docs/performance.md "A busy machine".
SPINCOUNT = "10000"  # build -> seconds this process spent compiling it (0.0: cached)


def load(variant: str | None = None, fallback: bool = True) -> ctypes.CDLL:
    """The library of a build (resolve_variant: the argument, $SPARKQ_KERNEL, or the best this
    CPU runs), a wheel's prebuilt library or compiled on first use; raises KernelUnavailable
    (native: a build that fails to compile gives the next one this CPU runs, with one line on
    stderr). An amx build whose tile state
    the kernel refuses is replaced by the best other build this CPU runs, with one line on
    stderr (``fallback=False``: raised instead)."""
    native = (variant or os.environ.get("SPARKQ_KERNEL", "") or "native").lower() == "native"
    variant = resolve_variant(variant)
    if variant in _LIBS:
        return _LIBS[variant]
    try:
        path, BUILD_SECONDS[variant] = library(variant)
    except KernelUnavailable as e:  # native only: e.g. a compiler too old for -mavxvnni takes the next build
        hb = host_builds()
        nxt = hb[hb.index(variant) + 1] if native and compiler() and variant in hb[:-1] else None
        if nxt is None:
            raise
        print(f"sparkq: the {variant} build failed ({str(e).splitlines()[0][:200]}); using the {nxt} build", file=sys.stderr)
        lib = _LIBS[variant] = load(nxt)
        return lib
    PATHS[variant] = str(path)
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPINCOUNT  # read once, when libgomp loads with the first build
    lib = ctypes.CDLL(str(path))
    try:
        abi.declare(lib)
    except AttributeError as e:  # a library from before sq_abi_desc existed
        raise KernelUnavailable(f"{path}: {e}; delete it and run again") from None
    _KINDS[id(lib)] = abi.check(lib, path)
    if variant == "amx":  # the tile state, once per process (csrc/gemm_amx.c)
        rc = lib.sq_amx_init()
        if rc:
            why = ("the kernel refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)" if rc == -1
                   else f"{path.name} was compiled without AMX (needs gcc >= 11 or clang >= 12)")
            other = next((b for b in host_builds() if b != "amx"), "scalar")
            if not fallback:
                raise KernelUnavailable(f"{why}; choose SPARKQ_KERNEL={other}")
            print(f"sparkq: {why}; using the {other} build", file=sys.stderr)
            lib = _LIBS[variant] = load(other)
            return lib
    _LIBS[variant] = lib
    return lib


def try_load() -> ctypes.CDLL | None:
    """The library, or None (with one line on stderr) when the C core is off or cannot be built.
    A SPARKQ_KERNEL that names no build, or one this CPU cannot run, is the user's error
    (RuntimeUserError: one line, exit 2 in every command), not a fallback."""
    global _WARNED
    if os.environ.get("SPARKQ_KERNEL", "").lower() in OFF:
        return None
    try:
        return load()
    except KernelChoiceError as e:
        from ..errors import RuntimeUserError
        raise RuntimeUserError(str(e)) from None
    except (KernelUnavailable, OSError) as e:
        if not _WARNED:
            print(f"sparkq: C decode path unavailable ({e}); using the torch path", file=sys.stderr)
            _WARNED = True
        return None


def require(what: str) -> ctypes.CDLL:
    """The library for ``what``, which has no usable path without it (rows32 artifacts on the torch
    runtime: dequantizing every weight each step decodes the example at 0.16 tok/s): one line
    (RuntimeUserError) saying what to install or unset, never a silent crawl."""
    from ..errors import RuntimeUserError

    if os.environ.get("SPARKQ_KERNEL", "").lower() in OFF:
        raise RuntimeUserError(f"{what} runs on sparkq's C core, which SPARKQ_KERNEL=off turns off; unset SPARKQ_KERNEL")
    try:
        return load()
    except KernelChoiceError as e:
        raise RuntimeUserError(str(e)) from None
    except (KernelUnavailable, OSError) as e:
        raise RuntimeUserError(f"{what} runs on sparkq's C core, which cannot be built here ({str(e).splitlines()[0]}); "
                               "install a C compiler (apt-get install gcc, or xcode-select --install) or unset "
                               "SPARKQ_KERNEL") from None


def kind_code(lib, kind: str) -> int:
    """The library's code for a linear kind (formats/constants.py KIND_* names)."""
    return _KINDS[id(lib)][kind]


def build_name(lib) -> str:
    """The build a loaded library is, else its products (sq_simd(): 6 Arm dotprod + i8mm, 5 Arm dotprod, 4 AVX2 +
    AVX-VNNI, 3 AVX512-VNNI, 2 AVX2, 0 portable)."""
    named = next((v for v, other in _LIBS.items() if other is lib), None)
    return named or {6: "neon-i8mm", 5: "neon", 4: "avx2-vnni", 3: "avx512-vnni", 2: "avx2"}.get(lib.sq_simd(), "scalar")
