"""Resolve a Hub repo id to a local artifact directory (HF cache; honours HF_HUB_OFFLINE)."""
from __future__ import annotations

from pathlib import Path

from .errors import RuntimeUserError

ARTIFACT_PATTERNS = ["config.json", "sparkq.json", "model.sparkq.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                     "chat_template.jinja", "README.md"]


def download_artifact(repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo_id, _, rev = repo.partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=rev or None, allow_patterns=ARTIFACT_PATTERNS))
    except RepositoryNotFoundError:
        raise RuntimeUserError(f"Hub repo {repo_id!r} not found (or private: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        raise RuntimeUserError(f"Hub repo {repo_id!r} is not in the local HF cache and the Hub cannot be reached "
                               "(or HF_HUB_OFFLINE is set); download it once online") from None
    except (HfHubHTTPError, OSError) as e:
        raise RuntimeUserError(f"Hub repo {repo_id!r}: download failed ({str(e).splitlines()[0]})") from None
