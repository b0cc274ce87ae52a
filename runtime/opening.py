"""Which runtime opens a model: one public way (``open_model``) for the CLI, the server and users.

``runtime="auto"`` takes the torch-free runtime for rows32 artifacts and Hub repo ids (it fetches
their rows32 variant), the torch runtime for torch's int4 layouts, bf16 checkpoints and
``prefill`` other than ``auto``; where the torch-free runtime cannot open a Hub repo or has no C
core, the torch runtime takes over when installed.
"""
from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from sparkq.formats import constants as C

from .errors import RuntimeUserError

RUNTIMES = ("auto", "lite", "torch")


def artifact_layout(path: str | Path) -> str | None:
    """The layout a local artifact's manifest names, or None for anything else (a Hub repo id, a
    bf16 checkpoint, a missing or unreadable manifest: the loaders say what it is)."""
    from sparkq.formats.manifest import Manifest, ManifestError

    m = Path(path) / C.MANIFEST_FILE
    if not m.is_file():
        return None
    try:
        return Manifest.read(m).layout
    except (ValueError, OSError, KeyError, TypeError, ManifestError):
        return None


def have_torch() -> bool:
    return find_spec("torch") is not None


def open_model(model: str, runtime: str = "auto", prefill: str = "auto", **kw):
    """The model on ``runtime`` (auto | lite | torch); ``prefill``: the torch runtime's prompt
    products (runtime/options.py PREFILL_MODES); ``kw``: the loader's keywords."""
    from sparkq.formats.layout import ROWS32

    from .options import PREFILL_MODES

    if runtime not in RUNTIMES:
        raise RuntimeUserError(f"runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
    if prefill not in PREFILL_MODES:
        raise RuntimeUserError(f"--prefill {prefill!r}: use one of {', '.join(PREFILL_MODES)}")
    layout = artifact_layout(model)
    bf16_dir = layout is None and (Path(model) / "config.json").is_file()
    fallback = False
    if runtime == "auto":
        runtime = "torch" if prefill != "auto" or (layout is not None and layout != ROWS32) or bf16_dir else "lite"
        fallback = have_torch() and not bf16_dir
    if runtime == "lite":
        if prefill != "auto":
            raise RuntimeUserError("--prefill applies to the torch runtime (--torch); the torch-free runtime's "
                                   "prompts go through the C prefill")
        from .lite import load as load_lite
        try:
            return load_lite(model, **kw)
        except RuntimeUserError:
            if not fallback:
                raise
    if not have_torch():
        what = "a bf16 checkpoint" if bf16_dir else "an artifact in torch's int4 layout" if layout is not None \
            else "the torch runtime"
        raise RuntimeUserError(f"{model} needs the torch runtime ({what}): pip install 'sparkq[convert]' "
                               "(torch==2.13.0 first)")
    from .torchrt import load
    return load(model, prefill_dequant=PREFILL_MODES[prefill], **kw)
