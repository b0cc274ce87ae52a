"""Compile the C core (``csrc/``) on this machine, once per build and CPU.

The sources ship with the package and are compiled on first use with the system C compiler
(``$CC``, else ``cc``/``gcc``/``clang``), ``-O3 -fopenmp`` and the build's ISA flags, as one
translation unit (``csrc/sq.c`` includes the others), into ``$SPARKQ_CACHE`` (default
``~/.cache/sparkq``)/kernels/sq-<build>-<hash>.so. The hash covers every source file, the
flags, the compiler's version and this CPU's feature flags, so a shared home directory never
runs a binary built for another CPU. The build goes to a temp name and is renamed, so
concurrent first runs are safe.

Builds (``BUILDS``), one per instruction set the C core has paths for: ``amx`` (AVX512-VNNI
products, prompts on AMX-BF16 tiles), ``avx512-bf16`` (AVX512-VNNI products and the AVX512-BF16
prompt GEMM), ``avx512-vnni`` (the same without the bf16 GEMM: prompts through the W4A8 GEMM, as
on CPUs with VNNI but no BF16), ``avx2`` and ``scalar`` (portable C), plus ``exact`` (portable,
fp32 activations: no A8; tests measure the A8 error against it). ``native``, the default, is the
build this CPU runs fastest: where it runs several builds whose prompt GEMMs differ (amx,
avx512-bf16, avx512-vnni) the choice is measured once per CPU, compiler and sources (native.py)
and cached beside the builds; elsewhere it is the most capable build (``host_builds()[0]``; on a
CPU without AVX2, -march=native over the portable code). So what a user runs is always one of the
builds the tests cover. ``SPARKQ_KERNEL=<build>`` picks another one this CPU can run;
``SPARKQ_KERNEL=off`` turns the C core off.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
MAIN = CSRC / "sq.c"  # the unity file


class KernelUnavailable(RuntimeError):
    pass


class KernelChoiceError(KernelUnavailable):
    """SPARKQ_KERNEL (or a build argument) names no build, or one this CPU cannot run: the user's
    choice to fix (lib.try_load raises it as a one-line error), never a reason to fall back."""


# build -> (compiler flags, the /proc/cpuinfo flags a CPU needs to run it). The SIMD builds
# start from -march=native and switch off what the build must not use: avx2 on an AVX512 CPU
# runs exactly the code an AVX2-only CPU gets, avx512-vnni the code of a CPU without BF16.
# -DSQ_NO_AMX keeps the AMX kernels out where -march=native would allow them (a macro, not
# -mno-amx-*: compilers before AMX reject those flags).
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
BUILDS = {
    "amx": (["-march=native"], (*_AVX512, "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")),
    "avx512-bf16": (["-march=native", "-DSQ_NO_AMX"], (*_AVX512, "avx512_bf16")),
    "avx512-vnni": (["-march=native", "-mno-avx512bf16", "-DSQ_NO_AMX"], _AVX512),
    "avx2": (["-march=native", "-mno-avx512f", "-DSQ_NO_AMX"], ("avx2", "fma")),
    "scalar": (["-DSQ_SCALAR"], ()),
    "exact": (["-DSQ_SCALAR", "-DSQ_EXACT"], ()),
}
OFF = ("off", "0", "torch")  # SPARKQ_KERNEL values that turn the C core off
ISA_BUILDS = ("amx", "avx512-bf16", "avx512-vnni", "avx2", "scalar")  # what users' CPUs run, most capable first
PROMPT_BUILDS = ("amx", "avx512-bf16", "avx512-vnni")  # same products, other prompt GEMMs: native is measured
# what each build's products report (sq_simd(): 3 AVX512-VNNI, 2 AVX2, 0 portable), whether its
# prompts take a W4A16 GEMM (sq_prefill_bf16()) and whether that GEMM runs on AMX tiles
# (sq_prefill_amx(), once the tile state is granted)
EXPECT = {"amx": (3, 1, 1), "avx512-bf16": (3, 1, 0), "avx512-vnni": (3, 0, 0), "avx2": (2, 0, 0), "scalar": (0, 0, 0),
          "exact": (0, 0, 0)}


def sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


def cache_dir() -> Path:
    return Path(os.environ.get("SPARKQ_CACHE") or Path.home() / ".cache" / "sparkq") / "kernels"


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() + platform.machine()


def compiler() -> str | None:
    for cc in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        if shutil.which(cc):
            return cc
    return None


def missing_features(variant: str) -> list[str]:
    """The CPU flags this machine lacks to run a build (empty: it can run it)."""
    have = set(cpu_flags().split())
    return [f for f in BUILDS[variant][1] if f not in have]


def host_builds() -> list[str]:
    """The ISA builds this CPU can run, most capable first (x86 only; elsewhere: scalar)."""
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


def fingerprint(cc: str, flags: list[str]) -> str:
    """A hash of every source file, the flags, the compiler's version and this CPU's flags."""
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from None
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(flags).encode() + ver.encode() + cpu_flags().encode())
    return h.hexdigest()[:16]


def build(variant: str = "native") -> tuple[Path, float]:
    """Compile (or find in the cache) a build's library; returns (path, seconds spent compiling)."""
    cc = compiler()
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
