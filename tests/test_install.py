"""The package as users install it: the wheel's contents, and `pip install sparkq` without extras
giving the torch-free runtime (no torch in the environment; nothing downloaded: the fresh venv
sees only the base dependencies' files, linked from this one)."""
import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("wheel")
    src = d / "src"  # a clean copy: setuptools would reuse a stale build/ of the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "work", "*.egg-info",
                                                               "__pycache__", ".pytest_cache", ".hypothesis"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(d), str(src)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return next(d.glob("sparkq-*.whl"))


def test_wheel_holds_the_product_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"sparkq", next(t for t in top if t.endswith(".dist-info"))}, top
    for sub in ("convert", "formats", "runtime", "recipes", "cli"):
        assert any(n.startswith(f"sparkq/{sub}/") for n in names), sub
    assert "sparkq/recipes/llama.toml" in names
    csrc = {Path(n).name for n in names if n.startswith("sparkq/runtime/core/csrc/")}
    assert {p.name for p in (ROOT / "runtime" / "core" / "csrc").iterdir() if p.suffix in (".c", ".h")} == csrc
    # the lab tools live in tools/, outside the wheel
    assert not [n for n in names if n.endswith(("benchmarks.py", "quality.py", "gemmbench.py", "llamacpp.py"))]
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    base = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert not [ln for ln in base if "torch" in ln or "gguf" in ln], base


def _base_closure(wheel) -> list:
    """The distributions `pip install sparkq` (no extras) pulls in, found in this environment."""
    from packaging.requirements import Requirement

    meta = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist()
                                            if n.endswith("METADATA"))).decode()
    todo = [Requirement(ln.split(":", 1)[1]) for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    seen, dists = set(), []
    while todo:
        r = todo.pop()
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        key = r.name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        d = metadata.distribution(r.name)
        dists.append(d)
        todo += [Requirement(x) for x in (d.requires or [])]
    return dists


def _link_site(dists, dest: Path) -> None:
    dest.mkdir()
    for d in dists:
        for top in {Path(f).parts[0] for f in (d.files or []) if not str(f).startswith("..")}:
            src = Path(d.locate_file(top))
            if src.exists() and not (dest / top).exists():
                (dest / top).symlink_to(src)


def venv_with(wheel: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(venv, its python): a fresh venv with the wheel installed and its base dependencies (no torch,
    no gguf) linked in from this environment (no network)"""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                        str(wheel)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    dists = _base_closure(wheel)
    assert not [d for d in dists if d.metadata["Name"].lower() in ("torch", "gguf")]
    _link_site(dists, tmp_path / "deps")
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "sparkq_base_deps.pth").write_text(str(tmp_path / "deps") + "\n")
    return venv, py


def test_torch_free_install_generates_from_a_rows32_artifact(wheel, tiny_tied_art, tmp_path):
    venv, py = venv_with(wheel, tmp_path)
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "SPARKQ_CACHE": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1"}
    if os.environ.get("CC"):
        env["CC"] = os.environ["CC"]
    run = lambda *a: subprocess.run([str(x) for x in a], capture_output=True, text=True, env=env, cwd=tmp_path,  # noqa: E731
                                    timeout=600)
    no_torch = run(py, "-c", "import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    g = run(venv / "bin" / "sparkq", "generate", tiny_tied_art, "hello", "--max-new-tokens", "4", "--json")
    assert g.returncode == 0, g.stderr[-2000:]
    r = json.loads(g.stdout)
    assert r["stats"]["runtime"] == "lite" and 1 <= len(r["token_ids"]) <= 4, r["stats"]
    assert run(venv / "bin" / "sparkq", "inspect", tiny_tied_art).returncode == 0
    assert run(venv / "bin" / "sparkq", "verify", tiny_tied_art).returncode == 0
    for cmd in (["spark-convert", tiny_tied_art, tmp_path / "out"], ["sparkq", "generate", tiny_tied_art, "hi", "--torch"]):
        bad = run(venv / "bin" / cmd[0], *cmd[1:])
        assert bad.returncode == 2 and "pip install 'sparkq[convert]'" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert not (tmp_path / "out").exists()
