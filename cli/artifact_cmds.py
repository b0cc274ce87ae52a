"""Artifacts as files: sparkq inspect, verify, upload."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from . import render as R
from .common import app
from .common import (_fail, _kv, _need_convert_extra, _plot, _prefill_mode, _rss_mib, _run, _runtime, _save,  # noqa: F401
                     _threads, artifact_layout, open_model)


@app.command()
def inspect(artifact: str, as_json: bool = typer.Option(False, "--json")):
    """Layout, group sizes, bytes per role, bits per weight, tied or not, source."""
    from sparkq.formats import Artifact

    s = _run(lambda: Artifact.open(artifact).summary())
    typer.echo(json.dumps(s, indent=1) if as_json else R.inspect_summary(s))


@app.command()
def verify(artifact: str):
    """Recompute every tensor digest: exit 0 if all match, 2 naming the first bad tensor."""
    from sparkq.formats import Artifact
    from tqdm import tqdm

    art = _run(Artifact.open, artifact)
    size = art.weights_path.stat().st_size
    with tqdm(total=size, unit="B", unit_scale=True, desc="verify", leave=False, disable=not sys.stderr.isatty()) as bar:
        bad = art.verify(progress=bar.update)
    if bad:
        _fail(f"tensor {bad!r} does not match its sha256 in the manifest: the artifact is corrupt, re-download or re-convert it")
    typer.echo(f"ok: {len(art.manifest.tensors)} tensors verified ({R.mib(size)})")


@app.command()
def upload(artifact: str, repo_id: str, private: bool = typer.Option(False, "--private"),
           revision: Optional[str] = typer.Option(None, "--revision", help="branch to commit to (created if needed)"),
           base_model: Optional[str] = typer.Option(None, "--base-model", help="the card's base_model when the source "
                                                    "was not a Hub repo id"),
           as_json: bool = typer.Option(False, "--json")):
    """Upload an artifact to the Hub as the <layout>/ variant of REPO_ID, with a generated model card."""
    from sparkq.convert.publish import upload as do_upload

    u = _run(do_upload, artifact, repo_id, private=private, revision=revision, base_model=base_model)
    typer.echo(json.dumps(u, indent=1) if as_json else
               R.table([("repo", f"{u['repo']}@{u['revision']}"), ("variant", f"{u['variant']}/ ({', '.join(u['variants'])} in repo)"),
                       ("commit", u["commit"]), ("message", u["commit_message"]), ("files", str(u["files"]))]))
