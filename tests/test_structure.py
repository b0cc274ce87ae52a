"""The code's structure as docs/architecture.md draws it: one table of weight kinds that every side
reads, the converter without layer math of its own and with the C core behind one door, files
that each do one job, and one public way to open a model."""
import ast
from pathlib import Path

import pytest

from sparkq.convert.writers import WRITERS
from sparkq.formats.kinds import KINDS, linear_tensors
from sparkq.formats.manifest import LinearEntry
from sparkq.runtime.errors import RuntimeUserError
from sparkq.runtime.torchrt.weights import TORCH_LINEARS

ROOT = Path(__file__).resolve().parent.parent


def test_every_weight_kind_has_a_writer_a_torch_linear_and_c_core_fields_it_stores():
    assert set(WRITERS) == set(KINDS) == set(TORCH_LINEARS)
    for name, wk in KINDS.items():
        g = 64 if wk.grouped else None
        stored = {t.rsplit(".", 1)[1] for t in linear_tensors("x", name, 32, 128, g, residual=wk.splittable,
                                                              residual_rows=16 if wk.splittable else None)}
        fields = dict(wk.core)
        assert fields["q"] in stored, name  # every kind gives the C core its codes or weights
        assert set(fields.values()) <= stored, (name, set(fields.values()) - stored)
        e = LinearEntry("layers.0.o", name, 32, 128, g, residual=wk.splittable)
        assert e.encoding.startswith(name) and (e.group_label == name) != wk.grouped


def _python_files(*dirs):
    return [p for d in dirs for p in (ROOT / d).rglob("*.py")]


def test_the_converter_has_no_layer_math_and_reaches_the_runtime_through_public_modules():
    allowed = {"sparkq.runtime.torchrt.layers", "sparkq.runtime.hub", "sparkq.runtime.procmem", "sparkq.runtime.core",
               "sparkq.runtime"}
    for p in _python_files("convert"):
        text = p.read_text()
        for math in ("scaled_dot_product_attention", "rsqrt", ".cos(", ".sin(", "F.silu", "F.gelu", "softmax("):
            assert math not in text, f"{p.name} computes {math!r}: the layer math lives in runtime/torchrt/layers.py"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparkq.runtime"):
                names = {f"{node.module}.{a.name}" for a in node.names} if node.module == "sparkq.runtime" else {node.module}
                for n in names:
                    assert n in allowed, f"{p.name} imports {n}"
                    if n.endswith("runtime.core"):
                        assert p.name == "ccore.py", f"{p.name} reaches the C core outside convert/ccore.py"


@pytest.mark.parametrize("path", [p.relative_to(ROOT) for d in ("convert", "formats", "runtime", "cli")
                                  for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".c", ".h")])
def test_files_do_one_job(path):
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= (250 if str(path) == "cli/main.py" else 400), f"{path}: {lines} lines"


def test_open_model_picks_the_runtime(tiny_tied, tiny_tied_art):
    from sparkq.runtime import LiteModel, LoadedModel, open_model
    from sparkq.runtime.opening import artifact_layout

    assert artifact_layout(tiny_tied_art) == "rows32" and artifact_layout(tiny_tied) is None
    assert isinstance(open_model(str(tiny_tied_art), max_model_len=32), LiteModel)
    assert isinstance(open_model(str(tiny_tied_art), "torch", max_model_len=32), LoadedModel)
    assert isinstance(open_model(str(tiny_tied_art), prefill="dequant", max_model_len=32), LoadedModel)
    assert isinstance(open_model(str(tiny_tied), max_model_len=32), LoadedModel)  # a bf16 checkpoint
    with pytest.raises(RuntimeUserError, match="runtime 'gpu'"):
        open_model(str(tiny_tied_art), "gpu")
    with pytest.raises(RuntimeUserError, match="--prefill applies to the torch runtime"):
        open_model(str(tiny_tied_art), "lite", prefill="kernel")
