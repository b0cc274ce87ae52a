"""sparkq.runtime: memory-map a sparkq artifact and generate text on CPU (reads through sparkq.formats).

    from sparkq.runtime import open_model
    m = open_model("path/or/org-name")          # runtime="auto" | "lite" | "torch"
    print(m.generate("The capital of France is", max_new_tokens=16)["text"])

Subpackages: ``core`` (the C core and its binding), ``lite`` (the torch-free runtime: rows32
artifacts through the C core, numpy only), ``torchrt`` (the torch runtime: one decoder over
swappable linears, every layout and bf16 checkpoints), ``serve`` (``sparkq serve``), ``measure``
(bench, memory, fidelity, bench-serve). The modules beside them are what generation needs in
either runtime. ``load`` / ``load_lite`` / ``open_model`` are imported on first use, so importing
this package never imports torch.
"""
from .errors import RuntimeUserError

__all__ = ["load", "load_lite", "open_model", "LoadedModel", "LiteModel", "RuntimeUserError"]


def __getattr__(name):
    if name in ("load", "LoadedModel"):
        from . import torchrt
        return getattr(torchrt, name)
    if name in ("load_lite", "LiteModel"):
        from . import lite
        return {"load_lite": lite.load, "LiteModel": lite.LiteModel}[name]
    if name == "open_model":
        from .opening import open_model
        return open_model
    raise AttributeError(name)
