"""Build and load the C decode core (``kernels/sq_decode.c``) on this machine.

The source ships with the package and is compiled on first use with the system C
compiler (``$CC``, else ``cc``/``gcc``): ``-O3 -march=native -fopenmp``, into
``$SPARKQ_CACHE`` (default ``~/.cache/sparkq``)/kernels/<hash>.so, where the hash covers
the source, the flags, the compiler's version and this CPU's feature flags, so a shared
home directory never runs a binary built for another CPU. The build goes to a temp name
and is renamed, so concurrent first runs are safe. No compiler (or a failed build)
means no fast path: the runtime says so once and uses the torch path.

Builds (``BUILDS``): one per instruction set the C core has paths for, ``avx512-bf16``
(AVX512-VNNI products and the AVX512-BF16 prompt GEMM), ``avx512-vnni`` (the same without the
bf16 GEMM: prompts through the W4A8 GEMM, as on CPUs with VNNI but no BF16), ``avx2`` and
``scalar`` (portable C), plus ``exact`` (portable, fp32 activations: no A8; tests measure the
A8 error against it). ``native``, the default, is the most capable build this CPU runs
(``host_builds()[0]``), so what a user runs is always one of the builds the tests cover.
``SPARKQ_KERNEL=<build>`` picks another one this CPU can run; ``=off`` disables the C path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels") / "sq_decode.c"
ABI = 5
# prompt tokens per sq_prefill chunk: bounds the activation buffers (at the Qwen3-1.7B shape
# ~48 MiB fp32 for 512 tokens, from the buffer sizes) while each chunk reads every weight once
# (and, on AVX512-BF16 CPUs, dequantizes it once: 512 against 256 tokens, pp512 at the 1.7B
# shape 251 vs 239 tok/s, medians of 4 interleaved lite prefills; scratch script, not kept)
PREFILL_CHUNK = 512


class KernelUnavailable(RuntimeError):
    pass


class SqLinear(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("sz", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("g", ctypes.c_int64),
                ("res", ctypes.c_void_p), ("rsc", ctypes.c_void_p)]  # a split int4 linear's second plane, or NULL


class SqLayer(ctypes.Structure):
    _fields_ = [("qkv", SqLinear), ("o", SqLinear), ("gate_up", SqLinear), ("down", SqLinear)] + [
        (n, ctypes.c_void_p) for n in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm",
                                       "k_norm", "cos", "sin", "kcache", "vcache")] + [
        ("rot", ctypes.c_int64), ("window", ctypes.c_int64)]


class SqModel(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                              "vocab", "cap", "act", "norm_offset", "refine_top")] + [
        (n, ctypes.c_double) for n in ("eps", "attn_scale", "embed_mult")] + [
        ("layer", ctypes.POINTER(SqLayer)), ("head", SqLinear), ("embed", SqLinear), ("final_norm", ctypes.c_void_p)]


def simd_name(lib: ctypes.CDLL) -> str:
    """The build a library is (load()'s name for it), else its products: sq_simd() 3 =
    AVX512-VNNI, 2 = AVX2, 0 = portable C."""
    named = next((v for v, other in _LIBS.items() if other is lib), None)
    return named or {3: "avx512-vnni", 2: "avx2"}.get(lib.sq_simd(), "scalar")


def cache_dir() -> Path:
    return Path(os.environ.get("SPARKQ_CACHE") or Path.home() / ".cache" / "sparkq") / "kernels"


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() + platform.machine()


def _compiler() -> str | None:
    for cc in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        if shutil.which(cc):
            return cc
    return None


# build -> (compiler flags, the /proc/cpuinfo flags a CPU needs to run it). The SIMD builds
# start from -march=native and switch off what the build must not use: avx2 on an AVX512 CPU
# runs exactly the code an AVX2-only CPU gets, avx512-vnni the code of a CPU without BF16.
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
BUILDS = {
    "avx512-bf16": (["-march=native"], (*_AVX512, "avx512_bf16")),
    "avx512-vnni": (["-march=native", "-mno-avx512bf16"], _AVX512),
    "avx2": (["-march=native", "-mno-avx512f"], ("avx2", "fma")),
    "scalar": (["-DSQ_SCALAR"], ()),
    "exact": (["-DSQ_SCALAR", "-DSQ_EXACT"], ()),
}
OFF = ("off", "0", "torch")  # SPARKQ_KERNEL values that turn the C core off
ISA_BUILDS = ("avx512-bf16", "avx512-vnni", "avx2", "scalar")  # what users' CPUs run, most capable first
# what each build's products report (sq_simd(): 3 AVX512-VNNI, 2 AVX2, 0 portable) and whether
# its prompts take the bf16 GEMM (sq_prefill_bf16())
EXPECT = {"avx512-bf16": (3, 1), "avx512-vnni": (3, 0), "avx2": (2, 0), "scalar": (0, 0), "exact": (0, 0)}


def missing_features(variant: str) -> list[str]:
    """The CPU flags this machine lacks to run a build (empty: it can run it)."""
    have = set(_cpu_flags().split())
    return [f for f in BUILDS[variant][1] if f not in have]


def host_builds() -> list[str]:
    """The ISA builds this CPU can run, most capable first (x86 only; elsewhere: scalar)."""
    return [b for b in ISA_BUILDS if not missing_features(b)]


def resolve_variant(variant: str | None = None) -> str:
    """The build to use: ``variant``, else $SPARKQ_KERNEL, else the most capable this CPU runs.
    A build this CPU cannot run, or an unknown name, raises KernelUnavailable."""
    v = (variant or os.environ.get("SPARKQ_KERNEL", "") or "native").lower()
    if v in OFF:
        raise KernelUnavailable(f"SPARKQ_KERNEL={v} turns the C core off")
    if v == "native":
        builds = host_builds()
        # not x86 (no AVX2): -march=native with the portable code (the compiler vectorizes it)
        return builds[0] if builds[0] != "scalar" else "native"
    if v not in BUILDS:
        raise KernelUnavailable(f"SPARKQ_KERNEL={v!r} is not a build; choose native, off or one of {', '.join(BUILDS)}")
    lacks = missing_features(v)
    if lacks:
        raise KernelUnavailable(f"this CPU cannot run the {v} build (it lacks {', '.join(lacks)}); "
                                f"unset SPARKQ_KERNEL or choose one of {', '.join(host_builds())}")
    return v


def build(variant: str = "native") -> tuple[Path, float]:
    """Compile (or find in the cache) the library; returns (path, seconds spent compiling)."""
    cc = _compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set $CC or install gcc)")
    flags = ["-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp", "-lm"]
    flags += ["-march=native"] if variant == "native" else BUILDS[variant][0]
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(flags).encode() + ver.encode() + _cpu_flags().encode()).hexdigest()[:16]
    out = cache_dir() / f"sq_decode-{variant}-{key}.so"
    if out.exists():
        return out, 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300)
        if r.returncode:
            raise KernelUnavailable(f"{cc} failed to build {SOURCE.name}: {(r.stderr or r.stdout).strip()[:300]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out, time.perf_counter() - t0


_LIBS: dict[str, ctypes.CDLL] = {}
_WARNED = False
BUILD_SECONDS: dict[str, float] = {}  # variant -> seconds this process spent compiling (0.0: cached)


def load(variant: str | None = None) -> ctypes.CDLL:
    """The library of a build (see resolve_variant), compiled on first use."""
    variant = resolve_variant(variant)
    if variant in _LIBS:
        return _LIBS[variant]
    path, BUILD_SECONDS[variant] = build(variant)
    lib = ctypes.CDLL(str(path))
    if lib.sq_abi() != ABI:
        raise KernelUnavailable(f"{path}: ABI {lib.sq_abi()} != {ABI}; delete {cache_dir()}")
    lib.sq_work_new.restype = ctypes.c_void_p
    lib.sq_work_new.argtypes = [ctypes.POINTER(SqModel)]
    lib.sq_work_free.argtypes = [ctypes.c_void_p]
    lib.sq_step.argtypes = [ctypes.POINTER(SqModel), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_void_p, ctypes.c_void_p]
    lib.sq_linear_f32.argtypes = [ctypes.POINTER(SqLinear), ctypes.c_void_p, ctypes.c_void_p]
    lib.sq_set_threads.argtypes = [ctypes.c_int]
    lib.sq_set_static_schedule.argtypes = [ctypes.c_int]
    lib.sq_set_prefill_bf16.argtypes = [ctypes.c_int]
    # SPARKQ_SCHED=static: decode products in a static schedule instead of work stealing (a
    # `sparkq bench` comparison arm); SPARKQ_PREFILL_BF16=0: the W4A8 GEMM for prompts too
    lib.sq_set_static_schedule(int(os.environ.get("SPARKQ_SCHED", "") == "static"))
    lib.sq_set_prefill_bf16(int(os.environ.get("SPARKQ_PREFILL_BF16", "1") != "0"))
    lib.sq_dequant_rows.argtypes = [ctypes.POINTER(SqLinear), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.sq_head.argtypes = [ctypes.POINTER(SqModel), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.sq_prefill.argtypes = [ctypes.POINTER(SqModel), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_int64]
    lib.sq_linear_batch.argtypes = [ctypes.POINTER(SqLinear), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_void_p]
    _LIBS[variant] = lib
    return lib


def try_load() -> ctypes.CDLL | None:
    """The library, or None (with one line on stderr) when the C path is off or cannot be built."""
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
