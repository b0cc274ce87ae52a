"""sparkq.runtime: memory-map a sparkq artifact and generate text on CPU (reads through sparkq.formats).

    from sparkq.runtime import load
    m = load("path/or/org-name")
    print(m.generate("The capital of France is", max_new_tokens=16)["text"])

``load`` is the full runtime (torch: every layout, bf16 checkpoints, fidelity tools);
``load_lite`` (runtime/lite.py) runs rows32 artifacts through the C core with numpy only, and
never imports torch (~200 MiB less resident memory). Both are imported on first use.
"""
from .errors import RuntimeUserError

__all__ = ["load", "load_lite", "LoadedModel", "LiteModel", "RuntimeUserError"]


def __getattr__(name):
    if name in ("load", "LoadedModel"):
        from . import api
        return getattr(api, name)
    if name in ("load_lite", "LiteModel"):
        from . import lite
        return {"load_lite": lite.load, "LiteModel": lite.LiteModel}[name]
    raise AttributeError(name)
