"""Switches for measurements and comparisons, in one place (not needed for normal use).

``LabOptions`` are the A/B arms of ``load()`` (``sparkq bench --arm NAME=key=value``, ``sparkq
memory``, the tests). Environment variables the runtime reads:

    SPARKQ_KERNEL   the C core's build: native (default: the best this CPU runs), avx512-bf16,
                    avx512-vnni, avx2, scalar, exact, or off (runtime/core/builds.py)
    SPARKQ_CACHE    where compiled builds are cached (default ~/.cache/sparkq)
    SPARKQ_THP      0: no MADV_HUGEPAGE on the weights mapping (formats/artifact.py)
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# the torch runtime's `--prefill` names for load(prefill_dequant=...) (runtime/torchrt/weights.py)
PREFILL_MODES = {"auto": None, "kernel": False, "dequant": True}


@dataclass(frozen=True)
class LabOptions:
    c_decode: bool = True  # decode steps through the C core where it applies (False: the torch model)
    c_prefill: bool = True  # prompts through the C core where it applies (False: the torch model)
    rope_len_from_config: bool = False  # RoPE tables sized from max_position_embeddings, as other runtimes do

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
