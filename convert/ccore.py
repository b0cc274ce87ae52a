"""The converter's one door to the C core (``sparkq.runtime.core``): the library where it builds
(GPTQ's column blocks, the lut4 fit, the Hessians' gram, the calibration's products), and a packed
linear multiplied by it (``CoreLinear``)."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

_LIB = ...  # the C core, or None (no compiler): loaded on first use


def lib():
    """The C core's library, or None where it cannot be built (the converter then runs in torch).
    Every call runs on one fixed thread count, this process's CPUs: some of the converter's C
    functions (their reductions) give other bits at another count, and a runtime session in the same
    process may have left the library on fewer threads (runtime/core/threads.py)."""
    global _LIB
    if _LIB is ...:
        from sparkq.runtime import core
        raw = core.try_load()
        _LIB = None if raw is None else _Pinned(raw, len(os.sched_getaffinity(0)))
    return _LIB


class _Pinned:
    """The library with each ``sq_*`` call preceded by ``sq_set_threads(threads)``."""

    def __init__(self, raw, threads: int):
        self.raw, self.threads = raw, threads

    def __getattr__(self, name):
        f = getattr(self.raw, name)
        if not name.startswith("sq_") or name == "sq_set_threads":
            return f

        def call(*args):
            self.raw.sq_set_threads(self.threads)
            return f(*args)
        return call


class CoreLinear:
    """A quantized linear as the artifact stores it (rows32 int4 / lut4 codes with their scales and
    zeros and levels, or int8 rows with their scales), multiplied by the C core's prompt products
    (``sq_linear_batch``): the calibration moves forward through what the runtime computes, several
    times faster than a float32 GEMM over the dequantized weight (docs/quality.md "Conversion
    cost"), and the packed weight is an eighth of that float copy."""

    def __init__(self, lib, kind: str, n: int, k: int, g: int | None, tensors: dict):
        """tensors: the kind's artifact tensors by suffix (formats/kinds.py), numpy or torch."""
        from sparkq.runtime import core

        self.keep = {s: np.ascontiguousarray(t) if isinstance(t, np.ndarray) else t.contiguous()
                     for s, t in tensors.items()}  # the buffers the descriptor points into
        self.lib, self.shape = lib, (n, k)
        self.desc = core.linear_struct(getattr(lib, "raw", lib), core.clinear(kind, n, k, g, self.keep.get))

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32 or bf16 [M, K]) @ W^T -> float32 [M, N]."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.shape[0])
        if self.lib.sq_linear_batch(ctypes.byref(self.desc), x.data_ptr(), int(x.dtype == torch.bfloat16),
                                    x.shape[0], y.data_ptr(), None):
            raise MemoryError("the C core could not allocate the calibration product's buffers")
        return y
