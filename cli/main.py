"""Console entry points: ``spark-convert`` and ``sparkq`` (typer), a thin layer over the library.

Commands by what they do: convert_cmds (spark-convert, import-gguf, synth), run_cmds (generate,
chat, serve), artifact_cmds (inspect, verify, upload), measure_cmds (memory, fidelity, bench,
bench-serve); what they print is in render.py, what they share in common.py. Every user-facing
failure is one line on stderr (``error: ...``) and exit code 2. ``pip install sparkq`` gives the
torch-free runtime (``sparkq generate`` of rows32 artifacts, inspect, verify, upload); conversion
and the torch runtime need ``pip install 'sparkq[convert]'``.
"""
# importing a group registers its commands, in this order in `sparkq --help`
from . import run_cmds  # noqa: F401, I001
from . import artifact_cmds  # noqa: F401
from . import convert_cmds  # noqa: F401
from . import measure_cmds  # noqa: F401
from .common import app, convert_app


def convert_main():  # console script: spark-convert
    convert_app()


def sparkq_main():  # console script: sparkq
    app()
