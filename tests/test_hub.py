"""Publishing and loading by repo id with the real huggingface_hub client against a local
server (tests/fakehub.py), and through the offline HF cache. No network."""
import json
import shutil

import pytest

from fakehub import FakeHub
from helpers import run_cli
from sparkq.formats import constants as C
from sparkq.formats.layout import ROWS32, host_layout


@pytest.fixture()
def hub(tmp_path):
    with FakeHub() as h:
        h.env = {"HF_ENDPOINT": h.url, "HF_TOKEN": "hf_test", "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf"),
                 "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
        yield h


def test_upload_download_roundtrip_and_card(hub, tiny_tied, tiny_tied_art, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_tied_art, art)
    # a stored measurement ends up in the card, not a number typed by hand
    assert run_cli("sparkq", "memory", art, "--max-model-len", "64", "--save", "--json").returncode == 0
    p = run_cli("sparkq", "upload", art, "me/tiny-sparkq", "--json", env=hub.env)
    assert p.returncode == 0, p.stderr
    u = json.loads(p.stdout)
    layout = ROWS32  # the default target (this host runs it: C core, or the torch fallback)
    assert u["variant"] == layout and u["variants"] == [layout]
    assert layout in u["commit_message"] and "sparkq" in u["commit_message"] and str(tiny_tied.resolve()) in u["commit_message"]
    files = hub.files("me/tiny-sparkq")
    assert f"{layout}/{C.WEIGHTS_FILE}" in files and "lfs" in files[f"{layout}/{C.WEIGHTS_FILE}"]
    assert f"{layout}/measurements/memory.json" in files and "README.md" in files

    # load by repo id into a fresh HF_HOME: only this layout's folder is fetched
    g = run_cli("sparkq", "generate", "me/tiny-sparkq", "abc", "--max-new-tokens", "6", "--json", env=hub.env)
    assert g.returncode == 0, g.stderr
    local = run_cli("sparkq", "generate", art, "abc", "--max-new-tokens", "6", "--json")
    r, l = json.loads(g.stdout), json.loads(local.stdout)
    assert r["token_ids"] == l["token_ids"]
    assert r["stats"]["hub"]["variant"] == layout and r["stats"]["hub"]["repo"] == "me/tiny-sparkq"
    snaps = list((tmp_path / "hf" / "hub" / "models--me--tiny-sparkq" / "snapshots").iterdir())
    assert len(snaps) == 1
    got = snaps[0] / layout
    for f in (C.WEIGHTS_FILE, C.MANIFEST_FILE, "config.json", "tokenizer.json"):
        assert (got / f).read_bytes() == (art / f).read_bytes(), f

    # the model card parses back and carries the metadata
    from huggingface_hub import ModelCard
    card = ModelCard.load(snaps[0] / "README.md")
    d = card.data.to_dict()
    assert d["library_name"] == "sparkq" and d["pipeline_tag"] == "text-generation"
    assert {"int4", "cpu", "sparkq", layout} <= set(d["tags"])
    assert "sparkq generate me/tiny-sparkq" in card.text and "Peak RSS".lower() in card.text.lower()

    # offline: the populated cache serves the repo id with no server
    hub.server.shutdown()
    off = run_cli("sparkq", "generate", "me/tiny-sparkq", "abc", "--max-new-tokens", "6", "--json",
                  env={**hub.env, "HF_HUB_OFFLINE": "1"})
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["token_ids"] == l["token_ids"]


def test_second_variant_pinned_revision_and_missing_variant(hub, tiny_tied, tmp_path):
    from sparkq.runtime.hub import runnable_layouts
    layout = runnable_layouts()[0]  # rows32 where the C core builds, else torch's layout for this CPU
    other = "default" if host_layout() != "default" else "avx2"  # a torch layout this CPU cannot run
    for t in (layout, other):
        assert run_cli("spark-convert", tiny_tied, tmp_path / t, "--target", t, "--quiet").returncode == 0
    p1 = run_cli("sparkq", "upload", tmp_path / other, "me/multi", "--json", env=hub.env)
    assert p1.returncode == 0, p1.stderr
    first = json.loads(p1.stdout)["commit"]
    # only the other layout exists: refused, listing what the repo has
    g = run_cli("sparkq", "generate", "me/multi", "abc", env=hub.env)
    assert g.returncode == 2 and other in g.stderr and f"--target {layout}" in g.stderr, g.stderr
    p2 = run_cli("spark-convert", tiny_tied, tmp_path / "again", "--target", layout, "--quiet", "--push-to-hub", "me/multi",
                 "--json", env=hub.env)
    assert p2.returncode == 0, p2.stderr
    u = json.loads(p2.stdout)["upload"]
    assert sorted(u["variants"]) == sorted([layout, other])
    ok = run_cli("sparkq", "generate", "me/multi", "abc", "--max-new-tokens", "3", "--json", env=hub.env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["stats"]["hub"]["variant"] == layout
    if layout == "rows32":  # the torch-free runtime fetches the rows32 variant only
        lite = run_cli("sparkq", "generate", "me/multi", "abc", "--lite", "--max-new-tokens", "3", "--json", env=hub.env)
        assert lite.returncode == 0 and json.loads(lite.stdout)["stats"]["hub"]["variant"] == "rows32", lite.stderr
    # pinned to the first commit: that revision has no variant for this host
    pinned = run_cli("sparkq", "generate", f"me/multi@{first}", "abc", env=hub.env)
    assert pinned.returncode == 2 and other in pinned.stderr
    # branches: --revision creates and commits to a branch
    b = run_cli("sparkq", "upload", tmp_path / layout, "me/multi", "--revision", "exp", "--json", env=hub.env)
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout)["revision"] == "exp" and "exp" in hub.repos["me/multi"].branches


@pytest.mark.parametrize("family", ["llama", "spark2_5"])
def test_hub_source_for_conversion(hub, tiny_tied, tmp_path, family):
    # put a plain HF checkpoint on the fake hub with the real client, then convert it by repo id
    if family == "spark2_5":
        from test_spark2_5 import make_spark
        tiny_tied = make_spark(tmp_path / "spark")
    code = f"""
from huggingface_hub import HfApi
api = HfApi()
api.create_repo("org/tiny-bf16", exist_ok=True)
api.upload_folder(repo_id="org/tiny-bf16", folder_path={str(tiny_tied)!r})
"""
    from helpers import run_py
    p = run_py(code, env=hub.env)
    assert p.returncode == 0, p.stderr
    c = run_cli("spark-convert", "org/tiny-bf16", tmp_path / "o", "--json", env=hub.env)
    assert c.returncode == 0, c.stderr
    s = json.loads(c.stdout)
    assert s["source"]["kind"] == "hub" and s["source"]["id"] == "org/tiny-bf16"
    local = run_cli("spark-convert", tiny_tied, tmp_path / "l", "--quiet")
    assert local.returncode == 0
    assert (tmp_path / "o" / C.WEIGHTS_FILE).read_bytes() == (tmp_path / "l" / C.WEIGHTS_FILE).read_bytes()
    # nothing pickled or unneeded was fetched
    snap = next((tmp_path / "hf" / "hub" / "models--org--tiny-bf16" / "snapshots").iterdir())
    assert not list(snap.glob("*.bin"))


def test_upload_failure_says_why(hub, tiny_tied_art):
    env = {**hub.env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    p = run_cli("sparkq", "upload", tiny_tied_art, "me/x", env=env)
    assert p.returncode == 2 and p.stderr.startswith("error: upload to me/x failed"), p.stderr


def test_corrupted_download_is_detected_and_refetched(hub, tiny_tied_art, tmp_path):
    assert run_cli("sparkq", "upload", tiny_tied_art, "me/c", env=hub.env).returncode == 0
    layout = ROWS32
    hub.corrupt_next.add(f"{layout}/{C.WEIGHTS_FILE}")  # the first download of the weights gets a flipped byte
    g = run_cli("sparkq", "generate", "me/c", "abc", "--max-new-tokens", "3", "--json", env=hub.env)
    assert g.returncode == 0, g.stderr
    assert json.loads(g.stdout)["stats"]["hub"].get("refetched") is True
    assert not hub.corrupt_next
    # a repo whose stored bytes are wrong is refused after one re-fetch, naming the problem
    files = hub.files("me/c")
    entry = files[f"{layout}/{C.WEIGHTS_FILE}"]
    data = bytearray(hub.content(entry))
    data[-1] ^= 0x01
    import hashlib
    oid = hashlib.sha256(bytes(data)).hexdigest()
    hub.lfs[oid] = bytes(data)
    files[f"{layout}/{C.WEIGHTS_FILE}"] = {"lfs": oid}
    env2 = {**hub.env, "HF_HOME": str(tmp_path / "hf2")}
    bad = run_cli("sparkq", "generate", "me/c", "abc", env=env2)
    assert bad.returncode == 2 and "corrupt even after re-fetching" in bad.stderr, bad.stderr
