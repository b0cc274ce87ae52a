"""The converter's one door to the C core (``sparkq.runtime.core``): the library where it builds
(GPTQ's column blocks, the lut4 fit, the Hessians' gram, the calibration's products), and a packed
linear multiplied by it (``CoreLinear``)."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

_LIB = ...  # the C core, or None (no compiler): loaded on first use


def lib():
    """The C core's library, or None where it cannot be built (the converter then runs in torch)."""
    global _LIB
    if _LIB is ...:
        from sparkq.runtime import core
        _LIB = core.try_load()
    return _LIB


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
        self.desc = core.linear_struct(lib, core.clinear(kind, n, k, g, self.keep.get))

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32 or bf16 [M, K]) @ W^T -> float32 [M, N]."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.shape[0])
        if self.lib.sq_linear_batch(ctypes.byref(self.desc), x.data_ptr(), int(x.dtype == torch.bfloat16),
                                    x.shape[0], y.data_ptr(), None):
            raise MemoryError("the C core could not allocate the calibration product's buffers")
        return y
