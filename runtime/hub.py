"""The Hugging Face Hub: repo ids, snapshots, and loading an artifact by repo id (only the
layout variant this host can run).

Resolution goes through ``huggingface_hub.snapshot_download`` (HF cache; ``HF_HUB_OFFLINE``,
``HF_HOME`` and pinned revisions are honoured) and fetches only the files asked for. The repo
convention is in ``sparkq.formats.repo``.
"""
from __future__ import annotations

import re
from pathlib import Path

from sparkq.formats.layout import ROWS32, LayoutError, host_layout
from sparkq.formats.repo import variant_patterns, variants_in

from .errors import RuntimeUserError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class HubError(ValueError):
    pass


def split_repo(spec: str) -> tuple[str, str | None]:
    """``org/name[@revision]`` -> (repo id, revision or None)."""
    repo, _, rev = spec.partition("@")
    return repo, rev or None


def is_repo_id(s: str) -> bool:
    return bool(REPO_ID.match(s)) and not s.startswith((".", "/"))


def snapshot(repo: str, revision: str | None, allow_patterns: list[str], force: bool = False) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=allow_patterns, force_download=force))
    except RepositoryNotFoundError:
        raise HubError(f"Hub repo {repo!r} not found (or private: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        raise HubError(f"Hub repo {repo!r} is not in the local HF cache and the Hub cannot be reached "
                       "(or HF_HUB_OFFLINE is set); download it once online") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"Hub repo {repo!r}: download failed ({str(e).splitlines()[0]})") from None


def _repo_variants(repo: str, revision: str | None, snap: Path) -> list[str]:
    try:
        from huggingface_hub import HfApi
        files = HfApi().list_repo_files(repo, revision=revision)
    except Exception:  # offline or unreachable: what the cache holds
        files = [str(p.relative_to(snap)) for p in snap.rglob("sparkq.json")]
    return variants_in(files)


def _verified_marker(repo: str, commit: str, variant: str) -> Path:
    from huggingface_hub import constants
    return Path(constants.HF_HOME) / "sparkq-verified" / repo.replace("/", "--") / f"{commit}-{variant}"


def _first_bad(art_dir: Path) -> str | None:
    from sparkq.formats.artifact import Artifact, ArtifactError
    try:
        return Artifact.open(art_dir).verify()
    except ArtifactError as e:
        return str(e)


def _check_download(repo: str, rev: str | None, patterns: list[str], art_dir: Path, info: dict) -> None:
    """Every tensor digest is checked once per downloaded snapshot; a corrupt or truncated
    download is fetched again once, then refused."""
    marker = _verified_marker(repo, info["revision"], info["variant"])
    if marker.exists():
        return
    bad = _first_bad(art_dir)
    if bad is not None:
        try:
            snapshot(repo, rev, patterns, force=True)
        except HubError as e:
            raise RuntimeUserError(f"download of {repo} is corrupt ({bad}) and re-fetching failed: {e}") from None
        bad = _first_bad(art_dir)
        if bad is not None:
            raise RuntimeUserError(f"download of {repo} is corrupt even after re-fetching ({bad}); "
                                   "the repo itself may be damaged: re-upload it")
        info["refetched"] = True
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def runnable_layouts() -> list[str]:
    """Layouts this host runs, best first: rows32 through the C core when it builds here, then
    the layout of torch's int4 kernel on this CPU (rows32 last: it still runs, slowly)."""
    from . import core

    try:
        host = [host_layout()]
    except LayoutError:
        host = []
    return [ROWS32, *host] if core.try_load() is not None else [*host, ROWS32]


def download_artifact(spec: str, layouts: list[str] | None = None) -> tuple[Path, dict]:
    """(local artifact dir, {"repo", "revision", "variant"}) for ``org/name[@revision]``: the first
    variant of ``layouts`` (default :func:`runnable_layouts`) the repo has (only that folder is fetched)."""
    repo, rev = split_repo(spec)
    want = layouts or runnable_layouts()
    extra = ["sparkq.json", "config.json", "model.sparkq.safetensors", "tokenizer*", "generation_config.json",
             "chat_template*"]
    snap = None
    for i, layout in enumerate(want):
        patterns = variant_patterns(layout) + (extra if i == 0 else [])
        try:
            snap = snapshot(repo, rev, patterns)
        except HubError as e:
            raise RuntimeUserError(str(e)) from None
        info = {"repo": repo, "revision": snap.name, "requested_revision": rev or "main"}
        for d, variant in ((snap / layout, layout), (snap, "(root)")):
            if (d / "sparkq.json").exists():
                info["variant"] = variant
                _check_download(repo, rev, patterns, d, info)
                return d, info
    have = _repo_variants(repo, rev, snap)
    raise RuntimeUserError(
        f"Hub repo {repo} has no artifact this host can run (it has: {', '.join(have) or 'none'}; this host runs "
        f"{', '.join(want)}); convert one yourself: spark-convert SRC OUT --target {want[0]}")
