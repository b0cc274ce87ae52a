"""The Arm builds (``neon``: armv8.2-a+dotprod, ``neon-i8mm``: + i8mm), cross-compiled for aarch64 with
the flags runtime/core/builds.py gives users and run under qemu-user. tests/csrc/armcheck.c includes the
whole C core: its kernel checks compare each build's decode products, batched products, prompt GEMM and
decode attention with the portable references in the same binary (int32 sums exactly, fp32 within 1e-5),
and its tiny random model (int4 / lut4 / int8 linears, tied head) prints the logits of a 21-token
prefill and 4 decode steps, with a bf16 and an int8 KV cache, which must agree across builds (bf16:
within the x86 SIMD-vs-scalar tests' bounds). Emulated, so no timing here means anything
(docs/performance.md "Arm").

Needs aarch64-linux-gnu-gcc (with libgomp1-arm64-cross) and qemu-aarch64: skipped without them,
except in CI (CI=true), where their absence fails (.ci/run installs them)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkq.runtime.core import builds as B

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "csrc" / "armcheck.c"
XCC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"
ARM = ("neon", "neon-i8mm")
ENV = {**os.environ, "OMP_NUM_THREADS": "2", "QEMU_LD_PREFIX": SYSROOT}


def _flags(build: str) -> list[str]:
    """What builds.build() compiles a build with, as an executable (the library's -shared/-fPIC dropped)."""
    return [f for f in B._flags(build) if f not in ("-shared", "-fPIC", "-lm")]


def _cc(cc: str, build: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([cc, *_flags(build), "-o", str(out), str(DRIVER), "-lm"], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def exes(tmp_path_factory):
    """{aarch64 scalar, neon, neon-i8mm, the host's (x86) scalar: path}, compiled two at a time."""
    missing = [t for t in (XCC, QEMU) if not shutil.which(t)]
    missing += [] if Path(SYSROOT, "lib", "libgomp.so.1").exists() else [f"{SYSROOT}/lib/libgomp.so.1"]
    if missing:
        why = f"{', '.join(missing)} missing: apt-get install gcc-aarch64-linux-gnu libgomp1-arm64-cross qemu-user"
        if os.environ.get("CI") == "true":
            pytest.fail(f"the Arm test cannot run in CI: {why} (.ci/run installs them)")
        pytest.skip(why)
    cc = B.compiler()
    assert cc, "no native C compiler"
    d = tmp_path_factory.mktemp("arm")
    jobs = {"scalar": (XCC, "scalar"), **{b: (XCC, b) for b in ARM}, "native-scalar": (cc, "scalar")}
    with ThreadPoolExecutor(2) as ex:
        done = {k: ex.submit(_cc, c, b, d / k) for k, (c, b) in jobs.items()}
    for k, f in done.items():
        assert f.result().returncode == 0, (k, f.result().stderr[-2000:])
    return {k: d / k for k in jobs}


def _run(exe: Path, cpu: str | None = "max", *args: str) -> subprocess.CompletedProcess:
    cmd = [QEMU, "-cpu", cpu, "-L", SYSROOT, str(exe), *args] if cpu else [str(exe), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)


def _parse(out: str) -> dict:
    r = {"logits": {}}
    for line in out.splitlines():
        w = line.split()
        if not w:
            continue
        if w[0] == "logits":
            r["logits"][w[1]] = [float(v) for v in w[2:]]
        elif w[0] == "simd":
            r["simd"] = int(w[1])
        elif w[0] == "chunked":
            r.setdefault("chunked", {})[w[1]] = int(w[2])
        elif w[0] == "hwcap":
            r["hwcap"] = (int(w[2]), int(w[4]))
        elif w[0] == "kernels":
            r["kernels"] = (int(w[1]), int(w[2]), float(w[4]))
    return r


@pytest.fixture(scope="module")
def runs(exes):
    """each Arm build's whole check under qemu -cpu max, and the host's scalar one natively"""
    out = {}
    with ThreadPoolExecutor(2) as ex:
        jobs = {k: ex.submit(_run, exes[k], None if k == "native-scalar" else "max") for k in exes}
    for k, f in jobs.items():
        p = f.result()
        out[k] = (p, _parse(p.stdout))
    return out


@pytest.mark.parametrize("build", ["scalar", *ARM])
def test_arm_kernels_match_the_reference(runs, build):
    """The build's products (decode, batched, prompt GEMM) against the portable references: every check
    passes, the fp32 results within 1e-5 of the largest reference value, and the build is what it names
    (sq_simd: builds.EXPECT) on a CPU (qemu -cpu max) that offers dotprod and i8mm."""
    p, r = runs[build]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert r["simd"] == B.EXPECT[build][0], r["simd"]
    assert r["hwcap"] == (1, 1), "qemu -cpu max should offer asimddp and i8mm"
    checks, fails, worst = r["kernels"]
    assert fails == 0 and checks > 1000 and worst < 1e-5, (r["kernels"], p.stdout[:3000])
    assert r["chunked"] == {"bf16": 0, "int8": 0}, "a prompt in chunks of 8 gave other hidden states than whole"


def _rel(a: list[float], b: list[float]) -> float:
    """max |a - b| over max |b| (the x86 SIMD-vs-scalar tests' per-step measure)"""
    return max(abs(x - y) for x, y in zip(a, b)) / max(abs(y) for y in b)


@pytest.mark.parametrize("build", [*ARM, "native-scalar"])
def test_arm_logits_match_scalar(runs, build):
    """The tiny model's prefill and decode logits against the aarch64 scalar build's. bf16 KV cache:
    median relative difference < 1e-4 and max < 0.03 over the 5 sets (the x86 SIMD-vs-scalar bounds,
    which test_kernels.py applies to bf16 caches; measured 2.5-4.7e-7). int8 cache (the default): a
    last-bit difference in a K or V value can move its int8 code by one step, which then carries
    through the following steps (measured 4.5e-3..6.7e-3 on neon, this random model): max < 0.03. The
    host's (x86) scalar build of the same driver (native gcc, -std=c11: no FMA contraction on either)
    checks the aarch64 portable build itself (measured: identical)."""
    p, r = runs[build]
    ref = runs["scalar"][1]["logits"]
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    names = {f"{c}-{k}" for c in ("bf16", "int8") for k in ("prefill", "step0", "step1", "step2", "step3")}
    assert set(r["logits"]) == set(ref) == names, p.stdout[-2000:]
    rel = sorted(_rel(r["logits"][k], ref[k]) for k in ref if k.startswith("bf16"))
    assert rel[len(rel) // 2] < 1e-4 and rel[-1] < 0.03, rel
    rel8 = sorted(_rel(r["logits"][k], ref[k]) for k in ref if k.startswith("int8"))
    assert rel8[-1] < 0.03, rel8


def test_arm_builds_use_their_instructions(exes):
    """The compiled kernels are the ISA's: sdot in both Arm builds, smmla only in neon-i8mm."""
    od = shutil.which("aarch64-linux-gnu-objdump")
    if not od:
        pytest.skip("aarch64-linux-gnu-objdump missing (binutils-aarch64-linux-gnu)")
    count = {}
    for k in ("scalar", *ARM):
        asm = subprocess.run([od, "-d", str(exes[k])], capture_output=True, text=True, timeout=120).stdout
        count[k] = {i: len(re.findall(rf"\t{i}\t", asm)) for i in ("sdot", "smmla")}
    assert count["scalar"] == {"sdot": 0, "smmla": 0}, count
    assert count["neon"]["sdot"] > 0 and count["neon"]["smmla"] == 0, count
    assert count["neon-i8mm"]["sdot"] > 0 and count["neon-i8mm"]["smmla"] > 0, count


def test_neon_runs_without_i8mm(exes):
    """On a dotprod CPU without i8mm (qemu -cpu neoverse-n1: Graviton 2, Ampere Altra) the neon build
    passes its kernel checks, and the neon-i8mm build, which such a CPU must not be given (builds.py:
    missing_features), dies on its first smmla."""
    p = _run(exes["neon"], "neoverse-n1", "kernels")
    r = _parse(p.stdout)
    assert p.returncode == 0 and r["hwcap"] == (1, 0) and r["kernels"][1] == 0, p.stdout[-2000:] + p.stderr[-500:]
    p = _run(exes["neon-i8mm"], "neoverse-n1", "kernels")
    assert p.returncode != 0 and "kernels" not in _parse(p.stdout), (p.returncode, p.stdout[-500:])


def test_arm_builds_are_chosen_from_cpuinfo_features(monkeypatch):
    """aarch64 Linux: /proc/cpuinfo's "Features" line picks the build (asimddp: neon; + i8mm: neon-i8mm);
    a 32-bit Arm system runs scalar whatever it lists."""
    a76 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
    monkeypatch.setattr(B.platform, "machine", lambda: "armv7l")  # a 32-bit system: no Arm build
    monkeypatch.setattr(B, "cpu_flags", lambda: a76)
    assert B.host_builds() == ["scalar"]
    monkeypatch.setattr(B.platform, "machine", lambda: "aarch64")
    assert B.host_builds() == ["neon", "scalar"] and B.resolve_variant("native") == "neon"
    monkeypatch.setattr(B, "cpu_flags", lambda: a76 + " sha512 sve asimdfhm i8mm bf16")
    assert B.host_builds() == ["neon-i8mm", "neon", "scalar"] and B.resolve_variant("native") == "neon-i8mm"
    monkeypatch.setattr(B, "cpu_flags", lambda: "Features\t: fp asimd evtstrm crc32 cpuid")  # Cortex-A72 (Pi 4)
    assert B.host_builds() == ["scalar"]
    with pytest.raises(B.KernelUnavailable, match="lacks asimddp"):
        B.resolve_variant("neon")
