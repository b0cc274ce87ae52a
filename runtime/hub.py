"""Resolve a Hub repo id to a local artifact directory (HF cache; honours HF_HUB_OFFLINE)."""
from __future__ import annotations

from pathlib import Path

from sparkq.formats.hub import HubError, snapshot, split_repo

from .errors import RuntimeUserError

ARTIFACT_PATTERNS = ["config.json", "sparkq.json", "model.sparkq.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                     "chat_template.jinja", "README.md"]


def download_artifact(spec: str) -> Path:
    repo, rev = split_repo(spec)
    try:
        return snapshot(repo, rev, ARTIFACT_PATTERNS)
    except HubError as e:
        raise RuntimeUserError(str(e)) from None
