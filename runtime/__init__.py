"""sparkq.runtime: memory-map a sparkq artifact and generate text on CPU (reads through sparkq.formats)."""
