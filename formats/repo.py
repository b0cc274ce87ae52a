"""How artifacts are laid out in a Hugging Face Hub repo (the contract between
``sparkq upload`` / ``spark-convert --push-to-hub`` and the runtime's download).

One Hub repo holds one artifact per CPU layout, each in a subfolder named after the layout
(``rows32/``, ``avx512/``, ``avx2/``, ``default/``), so a pinned revision pins every variant and
a download fetches only the folder matching the host; the model card (README.md) is at the
root. A repo with an artifact at its root (a single variant) is read too.
"""
from __future__ import annotations

VARIANT_FILES = ["config.json", "sparkq.json", "model.sparkq.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                 "measurements/*.json", "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
                 "*_Pooling/*.json"]


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
