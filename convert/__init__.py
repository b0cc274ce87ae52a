"""sparkq.convert: HF / Hub / GGUF checkpoints -> sparkq artifacts (writes through sparkq.formats)."""
