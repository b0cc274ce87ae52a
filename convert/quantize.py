"""Asymmetric int4 group quantization along K, in the kernel's convention.

For each group of ``g`` consecutive input columns of a row: codes ``q`` in 0..15 and a
bf16 (scale, zero) with ``w ~= (q - 8) * scale + zero``. Codes are computed against the
bf16-rounded scale and zero, so what the kernel dequantizes is exactly what we measured.

Methods:
- ``minmax``: the group's [min, max] mapped onto 0..15.
- ``clip``: calibration-free search per group (the idea behind llama.cpp's k-quant scale
  search): for shrunken candidate ranges, assign codes, refit scale and offset by least
  squares on those codes, and keep whichever candidate reconstructs the group best.
- ``gptq``: activation-aware error compensation with a calibration Hessian (gptq.py), each
  group keeping the parameters of a (shorter) ``clip`` search on the original weights. Rows
  are independent given ``H``, so it streams in row blocks like the others.
"""
from __future__ import annotations

import torch

METHODS = ("minmax", "clip", "gptq")  # plus "auto" at the command line (see options.resolve_method)
CALIBRATED = ("gptq",)  # methods that need a calibration text
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
CLIP_SHIFTS = (-0.05, 0.0, 0.05)
FAST_GRID, FAST_SHIFTS = (1.0, 0.95, 0.9, 0.85, 0.8), (0.0,)  # gptq's static groups: GPTQ does the rest


def _round_params(scale: torch.Tensor, lo: torch.Tensor):
    """bf16 scale and zero (kernel convention zero = lo + 8 * scale)."""
    scale = scale.to(torch.bfloat16).to(torch.float32)
    zero = (lo + 8.0 * scale).to(torch.bfloat16).to(torch.float32)
    return scale, zero


def _codes(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((wg - zero[..., None]) / safe[..., None] + 8.0)
    return torch.where(scale[..., None] > 0, q, torch.full_like(q, 8.0)).clamp_(0, 15)


def _sq_err(wg, q, scale, zero) -> torch.Tensor:
    deq = (q - 8.0) * scale[..., None] + zero[..., None]
    return ((wg - deq) ** 2).sum(-1)


def quantize_rows(w: torch.Tensor, group_size: int, method: str = "minmax", fast: bool = False,
                  use_c: bool = True):
    """w: float32 [R, K]. Returns (codes uint8 [R, K], scales_zeros bf16 [K/g, R, 2],
    squared error sum, squared weight sum). ``clip`` runs in the C core (sq_clip_search) when it
    builds, else here: the same search (float sums in other orders, so not always the same bits)."""
    if method not in METHODS or method in CALIBRATED:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {METHODS}")
    r, k = w.shape
    g = group_size
    if method == "clip" and use_c:
        from .ccore import lib as core_lib

        lib = core_lib()
        if lib is not None:
            return _clip_c(lib, w, g, fast)
    wg = w.reshape(r, k // g, g)
    wmin = wg.amin(dim=2)
    wmax = wg.amax(dim=2)
    scale, zero = _round_params((wmax - wmin) / 15.0, wmin)
    q = _codes(wg, scale, zero)
    if method == "clip":
        best = _sq_err(wg, q, scale, zero)
        rng = wmax - wmin
        mid = (wmax + wmin) / 2
        for s in FAST_GRID if fast else CLIP_GRID:
            for shift in FAST_SHIFTS if fast else CLIP_SHIFTS:
                lo = mid - rng * (s / 2 - shift)
                cs, cz = _round_params(rng * s / 15.0, lo)
                cq = _codes(wg, cs, cz)
                # least-squares refit of (scale, offset) on these codes: w ~ a * (q - 8) + b
                x = cq - 8.0
                xm, wm = x.mean(-1), wg.mean(-1)
                var = ((x - xm[..., None]) ** 2).sum(-1)
                a = torch.where(var > 0, ((x - xm[..., None]) * (wg - wm[..., None])).sum(-1) / var.clamp_min(1e-20), cs)
                b = wm - a * xm
                rs = a.clamp_min(0).to(torch.bfloat16).to(torch.float32)
                rz = b.to(torch.bfloat16).to(torch.float32)
                for ts, tz in ((cs, cz), (rs, rz)):
                    tq = _codes(wg, ts, tz)
                    e = _sq_err(wg, tq, ts, tz)
                    better = e < best
                    best = torch.where(better, e, best)
                    scale = torch.where(better, ts, scale)
                    zero = torch.where(better, tz, zero)
                    q = torch.where(better[..., None], tq, q)
        err = float(best.sum(dtype=torch.float64))
    else:
        err = float(_sq_err(wg, q, scale, zero).sum(dtype=torch.float64))
    ref = float((wg.to(torch.float64) ** 2).sum())
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16)  # [K/g, R, 2]
    return q.to(torch.uint8).reshape(r, k), sz, err, ref


def _clip_c(lib, w: torch.Tensor, g: int, fast: bool):
    import ctypes

    r, k = w.shape
    w = w.to(torch.float32).contiguous()
    grid = torch.tensor(FAST_GRID if fast else CLIP_GRID, dtype=torch.float64)
    shifts = torch.tensor(FAST_SHIFTS if fast else CLIP_SHIFTS, dtype=torch.float64)
    codes = torch.empty(r, k, dtype=torch.uint8)
    sz = torch.empty(k // g, r, 2, dtype=torch.bfloat16)
    err = ctypes.c_double()
    if lib.sq_clip_search(w.data_ptr(), r, k, g, grid.data_ptr(), len(grid), shifts.data_ptr(), len(shifts),
                          codes.data_ptr(), sz.data_ptr(), ctypes.addressof(err)):
        raise MemoryError("sq_clip_search: out of memory")
    return codes, sz, err.value, float((w.to(torch.float64) ** 2).sum())


def quantize_residual(w: torch.Tensor, deq: torch.Tensor, group_size: int):
    """The second plane of a split int4 linear (formats/constants.py): 4-bit codes of what the
    first plane missed, ``w ~= deq + (r - 8) * rscale``, with ``rscale = max|w - deq| / 7`` per
    group (bf16), rounded to nearest (the residual of a round-to-nearest plane is within half a
    step, GPTQ's can be larger: the per-group scale follows it). w, deq: float32 [R, K].
    Returns (codes uint8 [R, K] in 0..15, rscale bf16 [R, K/g], squared error sum, squared weight sum)."""
    r, k = w.shape
    g = group_size
    res = (w.float() - deq).reshape(r, k // g, g)
    rs = (res.abs().amax(-1) / 7.0).to(torch.bfloat16)
    rsf = rs.float()
    safe = torch.where(rsf > 0, rsf, torch.ones_like(rsf))
    q = torch.round(res / safe[..., None]).clamp_(-8, 7)
    err = float(((res - q * rsf[..., None]) ** 2).sum(dtype=torch.float64))
    ref = float((w.to(torch.float64) ** 2).sum())
    return (q + 8).to(torch.uint8).reshape(r, k), rs, err, ref


def quantize_int8_rows(w: torch.Tensor):
    """Per-row symmetric int8: w ~= q * scale[row], q in -127..127, bf16 scales.
    Returns (q int8 [R, K], scales bf16 [R], squared error sum, squared weight sum)."""
    scale = (w.abs().amax(dim=1) / 127.0).to(torch.bfloat16).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127)
    err = float(((w - q * scale[:, None]) ** 2).sum(dtype=torch.float64))
    ref = float((w.to(torch.float64) ** 2).sum())
    return q.to(torch.int8), scale.to(torch.bfloat16), err, ref
