"""Load an artifact by Hub repo id: fetch only the layout variant this host can run.

Resolution goes through ``snapshot_download`` (HF cache; ``HF_HUB_OFFLINE``, ``HF_HOME`` and
pinned revisions are honoured). The repo convention is in ``sparkq.formats.hub``.
"""
from __future__ import annotations

from pathlib import Path

from sparkq.formats.hub import HubError, snapshot, split_repo, variant_patterns, variants_in
from sparkq.formats.layout import LayoutError, host_layout

from .errors import RuntimeUserError


def _repo_variants(repo: str, revision: str | None, snap: Path) -> list[str]:
    try:
        from huggingface_hub import HfApi
        files = HfApi().list_repo_files(repo, revision=revision)
    except Exception:  # offline or unreachable: what the cache holds
        files = [str(p.relative_to(snap)) for p in snap.rglob("sparkq.json")]
    return variants_in(files)


def download_artifact(spec: str) -> tuple[Path, dict]:
    """(local artifact dir, {"repo", "revision", "variant"}) for ``org/name[@revision]``."""
    repo, rev = split_repo(spec)
    try:
        layout = host_layout()
    except LayoutError as e:
        raise RuntimeUserError(str(e)) from None
    try:
        snap = snapshot(repo, rev, variant_patterns(layout) + ["sparkq.json", "config.json", "model.sparkq.safetensors",
                                                               "tokenizer*", "generation_config.json", "chat_template*"])
    except HubError as e:
        raise RuntimeUserError(str(e)) from None
    info = {"repo": repo, "revision": snap.name, "requested_revision": rev or "main"}
    if (snap / layout / "sparkq.json").exists():
        return snap / layout, {**info, "variant": layout}
    if (snap / "sparkq.json").exists():
        return snap, {**info, "variant": "(root)"}
    have = _repo_variants(repo, rev, snap)
    raise RuntimeUserError(
        f"Hub repo {repo} has no artifact for this CPU's layout {layout!r} (it has: {', '.join(have) or 'none'}); "
        f"convert one yourself: spark-convert SRC OUT --target {layout}")
