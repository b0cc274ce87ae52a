"""Compile the C core (``csrc/``) on this machine, once per build and CPU, or take a wheel's prebuilt one.

A wheel built by ``make wheel`` (tools/wheels.py) ships every build of its architecture compiled
(``prebuilt/sq-<build>.so`` and ``manifest.json``: flags, sources hash, ABI); ``library()`` uses
one when its sources hash is the installed sources' and this CPU runs it, so such an install needs
no compiler. Otherwise the sources, which ship with the package, are compiled on first use with the system C compiler
(``$CC``, else ``cc``/``gcc``/``clang``), ``-O3 -fopenmp`` and the build's ISA flags, as one
translation unit (``csrc/sq.c`` includes the others), into ``$SPARKQ_CACHE`` (default
``~/.cache/sparkq``)/kernels/sq-<build>-<hash>.so. The hash covers every source file, the
flags, the compiler's version and this CPU's feature flags, so a shared home directory never
runs a binary built for another CPU. The build goes to a temp name and is renamed, so
concurrent first runs are safe.

Builds (``BUILDS``), one per instruction set the C core has paths for: ``amx`` (AVX512-VNNI
products, prompts on AMX-BF16 tiles), ``avx512-bf16`` (AVX512-VNNI products and the AVX512-BF16
prompt GEMM), ``avx512-vnni`` (the same without the bf16 GEMM: prompts through the W4A8 GEMM, as
on CPUs with VNNI but no BF16), ``avx2-vnni`` (AVX2 with the AVX-VNNI byte dots: Alder Lake and
later, the same bits as avx2), ``avx2`` and ``scalar`` (portable C), plus ``exact`` (portable,
fp32 activations: no A8; tests measure the A8 error against it) and ``avx2-vnni-evex`` (tests only:
avx2-vnni's code with the EVEX instruction, for AVX512 CPUs). ``native``, the default, is the
build this CPU runs fastest: where it runs several builds whose prompt GEMMs differ (amx,
avx512-bf16, avx512-vnni) the choice is measured once per CPU, compiler and sources (native.py)
and cached beside the builds; elsewhere it is the most capable build (``host_builds()[0]``; on a
CPU without AVX2, -march=native over the portable code). So what a user runs is always one of the
builds the tests cover. ``SPARKQ_KERNEL=<build>`` picks another one this CPU can run;
``SPARKQ_KERNEL=off`` turns the C core off.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
MAIN = CSRC / "sq.c"  # the unity file
PREBUILT = Path(__file__).with_name("prebuilt")  # a wheel's libraries and manifest.json (tools/wheels.py)


class KernelUnavailable(RuntimeError):
    pass


class KernelChoiceError(KernelUnavailable):
    """SPARKQ_KERNEL (or a build argument) names no build, or one this CPU cannot run: the user's
    choice to fix (lib.try_load raises it as a one-line error), never a reason to fall back."""


# build -> (compiler flags, the /proc/cpuinfo flags a CPU needs to run it). Each SIMD build names
# its instruction sets explicitly (never -march=native): what a machine compiles is what the wheel
# ships (tools/wheels.py) and what the tests run, the default generic tuning included; a compiler
# uses nothing a build's CPU flags do not promise. -DSQ_NO_AMX keeps the AMX kernels out.
_AVX2 = ["-mavx2", "-mfma"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
_AVX2_CPU = ("avx2", "fma")
_AVX512_CPU = (*_AVX2_CPU, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
BUILDS = {
    "amx": ([*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
            (*_AVX512_CPU, "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")),
    "avx512-bf16": ([*_AVX512, "-mavx512bf16", "-DSQ_NO_AMX"], (*_AVX512_CPU, "avx512_bf16")),
    "avx512-vnni": ([*_AVX512, "-DSQ_NO_AMX"], _AVX512_CPU),
    "avx2-vnni": ([*_AVX2, "-mavxvnni"], (*_AVX2_CPU, "avx_vnni")),  # Alder Lake on: VEX vpdpbusd
    # tests only (like exact): avx2-vnni's code with the EVEX vpdpbusd (AVX512-VNNI + VL on 8 lanes,
    # the same arithmetic), so CPUs with AVX512 but no AVX-VNNI (Zen 4, Ice Lake) test it too
    "avx2-vnni-evex": ([*_AVX2, "-mavx512vnni", "-mavx512vl", "-DSQ_VNNI_EVEX"],
                       (*_AVX2_CPU, "avx512f", "avx512vl", "avx512_vnni")),
    "avx2": (_AVX2, _AVX2_CPU),
    # Arm (aarch64 compilers only; /proc/cpuinfo "Features"): sdot products and prompt GEMM, and with
    # i8mm the prompt GEMM on smmla (csrc/gemv_neon.c, gemm_neon.c, gemm_i8mm_neon.c)
    "neon-i8mm": (["-march=armv8.2-a+dotprod+i8mm"], ("asimddp", "i8mm")),
    "neon": (["-march=armv8.2-a+dotprod"], ("asimddp",)),
    "scalar": (["-DSQ_SCALAR"], ()),
    "exact": (["-DSQ_SCALAR", "-DSQ_EXACT"], ()),
}
OFF = ("off", "0", "torch")  # SPARKQ_KERNEL values that turn the C core off
ISA_BUILDS = ("amx", "avx512-bf16", "avx512-vnni", "avx2-vnni", "avx2", "neon-i8mm", "neon", "scalar")  # what users' CPUs run, most capable first
ARM_BUILDS = ("neon-i8mm", "neon")  # the builds whose flags only an aarch64 compiler takes
PROMPT_BUILDS = ("amx", "avx512-bf16", "avx512-vnni")  # same products, other prompt GEMMs: native is measured
# what each build's products report (sq_simd(): 4 AVX2 + AVX-VNNI, 3 AVX512-VNNI, 2 AVX2, 6 Arm dotprod + i8mm,
# 5 Arm dotprod, 0 portable), whether its
# prompts take a W4A16 GEMM (sq_prefill_bf16()) and whether that GEMM runs on AMX tiles
# (sq_prefill_amx(), once the tile state is granted)
EXPECT = {"amx": (3, 1, 1), "avx512-bf16": (3, 1, 0), "avx512-vnni": (3, 0, 0), "avx2-vnni": (4, 0, 0),
          "avx2-vnni-evex": (4, 0, 0), "avx2": (2, 0, 0),
          "neon-i8mm": (6, 0, 0), "neon": (5, 0, 0), "scalar": (0, 0, 0), "exact": (0, 0, 0)}


def sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


def cache_dir() -> Path:
    return Path(os.environ.get("SPARKQ_CACHE") or Path.home() / ".cache" / "sparkq") / "kernels"


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):  # x86 "flags", aarch64 "Features" (asimddp, i8mm)
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def compiler() -> str | None:
    for cc in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        if shutil.which(cc):
            return cc
    return None


def missing_features(variant: str) -> list[str]:
    """The CPU flags this machine lacks to run a build (empty: it can run it)."""
    have = set(cpu_flags().split())
    lacks = [f for f in BUILDS[variant][1] if f not in have]
    if variant in ARM_BUILDS and platform.machine().lower() not in ("aarch64", "arm64"):
        lacks.append("aarch64")  # a 32-bit Arm system may list asimddp, but its compiler takes no armv8.2-a
    return lacks


def host_builds() -> list[str]:
    """The ISA builds this CPU can run, most capable first (x86, aarch64 Linux; elsewhere: scalar)."""
    return [b for b in ISA_BUILDS if not missing_features(b)]


def resolve_variant(variant: str | None = None) -> str:
    """The build to use: ``variant``, else $SPARKQ_KERNEL, else the most capable this CPU runs.
    A build this CPU cannot run, an unknown name or ``off`` raises KernelUnavailable."""
    v = (variant or os.environ.get("SPARKQ_KERNEL", "") or "native").lower()
    if v in OFF:
        raise KernelUnavailable(f"SPARKQ_KERNEL={v} turns the C core off")
    if v == "native":
        builds = host_builds()
        if sum(b in PROMPT_BUILDS for b in builds) > 1:
            from .native import measured_native
            return measured_native([b for b in builds if b in PROMPT_BUILDS])
        return builds[0] if builds[0] != "scalar" else "native"
    if v not in BUILDS:
        raise KernelChoiceError(f"SPARKQ_KERNEL={v!r} is not a build; choose native, off or one of {', '.join(BUILDS)}")
    lacks = missing_features(v)
    if lacks:
        raise KernelChoiceError(f"this CPU cannot run the {v} build (it lacks {', '.join(lacks)}); "
                                f"unset SPARKQ_KERNEL or choose one of {', '.join(host_builds())}")
    return v


def _flags(variant: str) -> list[str]:
    return ["-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp", "-lm",
            *(["-march=native"] if variant == "native" else BUILDS[variant][0])]


def compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from None


def _hash_sources(h) -> None:
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")


def sources_hash() -> str:
    """A hash of every source file (a prebuilt library is used only for the sources it was built from)."""
    h = hashlib.sha256()
    _hash_sources(h)
    return h.hexdigest()[:16]


def fingerprint(cc: str, flags: list[str]) -> str:
    """A hash of every source file, the flags, the compiler's version and this CPU's flags."""
    ver = compiler_version(cc)
    h = hashlib.sha256()
    _hash_sources(h)
    h.update(" ".join(flags).encode() + ver.encode() + cpu_flags().encode())
    return h.hexdigest()[:16]


_MANIFEST: dict | None = None


def manifest() -> dict:
    """The wheel's prebuilt libraries (prebuilt/manifest.json, written by tools/wheels.py): {} where
    none ship, they are for another architecture or other sources (an edited tree compiles), or
    SPARKQ_PREBUILT=0 (compile on first use, as from a source checkout)."""
    global _MANIFEST
    if os.environ.get("SPARKQ_PREBUILT", "") == "0":
        return {}
    if _MANIFEST is None:
        try:
            m = json.loads((PREBUILT / "manifest.json").read_text())
            ok = m.get("arch") == platform.machine() and m.get("sources") == sources_hash()
        except (OSError, ValueError, AttributeError):
            ok = False
        _MANIFEST = m if ok else {}
    return _MANIFEST


def prebuilt(variant: str) -> Path | None:
    """The wheel's library of a build, if it ships one for these sources and this architecture."""
    b = manifest().get("builds", {}).get(variant)
    p = PREBUILT / b["file"] if b else None
    return p if p is not None and p.is_file() else None


def library(variant: str) -> tuple[Path, float]:
    """A build's library: the wheel's prebuilt one where it has it, else build() (compiled on first
    use). ``native`` (a CPU without AVX2) without a compiler takes the prebuilt portable build."""
    p = prebuilt(variant)
    if p is None and variant == "native" and compiler() is None:
        p = prebuilt("scalar")
    return (p, 0.0) if p is not None else build(variant)


def build(variant: str = "native", cc: str | None = None) -> tuple[Path, float]:
    """Compile (or find in the cache) a build's library with ``cc`` (default: compiler()); returns
    (path, seconds spent compiling)."""
    cc = cc or compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set $CC or install gcc)")
    flags = _flags(variant)
    out = cache_dir() / f"sq-{variant}-{fingerprint(cc, flags)}.so"
    if out.exists():
        return out, 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, str(MAIN)], capture_output=True, text=True, timeout=300)
        if r.returncode:
            raise KernelUnavailable(f"{cc} failed to build {MAIN.name}: {(r.stderr or r.stdout).strip()[:300]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out, time.perf_counter() - t0
