"""Where artifacts and checkpoints live on the Hugging Face Hub, and fetching them.

Resolution goes through ``huggingface_hub.snapshot_download`` (so ``HF_HUB_OFFLINE``,
``HF_HOME`` and the local cache are honoured) and fetches only the files asked for.
"""
from __future__ import annotations

import re
from pathlib import Path

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


# ---------------------------------------------------------------- layout variants on the Hub
# One Hub repo holds one artifact per CPU layout, each in a subfolder named after the layout
# (``avx512/``, ``avx2/``, ``default/``), so a pinned revision pins every variant and a
# download fetches only the folder matching the host; the model card (README.md) is at the
# root. A repo with an artifact at its root (a single variant) is read too.
VARIANT_FILES = ["config.json", "sparkq.json", "model.sparkq.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                 "measurements/*.json"]


def variant_patterns(layout: str) -> list[str]:
    return [f"{layout}/{p}" for p in VARIANT_FILES] + ["README.md"]


def variants_in(paths) -> list[str]:
    """Layouts present in a list of repo paths (folders holding a sparkq.json)."""
    out = set()
    for p in paths:
        parts = str(p).split("/")
        if len(parts) == 2 and parts[1] == "sparkq.json":
            out.add(parts[0])
        elif p == "sparkq.json":
            out.add("(root)")
    return sorted(out)
