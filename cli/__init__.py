"""sparkq command-line entry points (spark-convert, sparkq)."""
