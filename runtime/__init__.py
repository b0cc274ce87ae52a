"""sparkq.runtime: memory-map a sparkq artifact and generate text on CPU (reads through sparkq.formats).

    from sparkq.runtime import load
    m = load("path/or/org-name")
    print(m.generate("The capital of France is", max_new_tokens=16)["text"])
"""
from .api import LoadedModel, load
from .errors import RuntimeUserError

__all__ = ["load", "LoadedModel", "RuntimeUserError"]
