"""Asymmetric int4 group quantization along K, in the kernel's convention.

For each group of ``g`` consecutive input columns of a row: codes ``q`` in 0..15 and a
bf16 (scale, zero) with ``w ~= (q - 8) * scale + zero``. Codes are computed against the
bf16-rounded scale and zero, so what the kernel dequantizes is exactly what we measured.
"""
from __future__ import annotations

import torch

METHODS = ("minmax",)


def quantize_rows(w: torch.Tensor, group_size: int, method: str = "minmax"):
    """w: float32 [R, K]. Returns (codes uint8 [R, K], scales_zeros bf16 [K/g, R, 2],
    squared error sum, squared weight sum)."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {METHODS}")
    r, k = w.shape
    g = group_size
    wg = w.reshape(r, k // g, g)
    wmin = wg.amin(dim=2)
    wmax = wg.amax(dim=2)
    scale = ((wmax - wmin) / 15.0).to(torch.bfloat16).to(torch.float32)
    zero = (wmin + 8.0 * scale).to(torch.bfloat16).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((wg - zero[..., None]) / safe[..., None] + 8.0)
    q = torch.where(scale[..., None] > 0, q, torch.full_like(q, 8.0)).clamp_(0, 15)
    deq = (q - 8.0) * scale[..., None] + zero[..., None]
    err = float(((wg - deq) ** 2).sum(dtype=torch.float64))
    ref = float((wg.to(torch.float64) ** 2).sum())
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16)  # [K/g, R, 2]
    return q.to(torch.uint8).reshape(r, k), sz, err, ref
