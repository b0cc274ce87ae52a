"""lut4: 4-bit codes into a 16-level table learned per output row (formats/constants.py).

For rows w (float32 [R, K]) and per-column importance ``a`` (the diagonal of the calibration
Hessian X^T X, as llama.cpp's imatrix weighs its quantizers; ones without calibration), each row
gets 16 int8 levels and each group of g columns a bf16 (scale, zero) with
``w ~= levels[q] * scale + zero``. Fitted by weighted Lloyd iterations (k-means) on the rows'
normalized weights: assign every weight its nearest level, refit each group's scale and zero by
weighted least squares on the assigned levels, move each level to the weighted centroid of what
it was assigned (in weight-space units, so a group's error counts as scale^2 times its normalized
error). Started from llama.cpp's fixed IQ4_NL grid, which a learned table can only improve on.
GPTQ then chooses the codes against the learned grid (gptq.py); without calibration they are
the nearest levels.
"""
from __future__ import annotations

import torch

# llama.cpp's kvalues_iq4nl: a fixed non-uniform 4-bit grid (ggml-common.h), the starting table
IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
LLOYD_ITERS = 6  # weighted MSE on Student-t(4) rows, g64: 0.00863 (4), 0.00853 (6), 0.00848 (8), 0.00845 (12)


def nearest(v: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Codes (int64 [R, K]) of the nearest level (levels [R, 16] ascending; the lower on a tie), as
    the GPTQ kernel picks them."""
    mids = (0.5 * (levels[:, :-1] + levels[:, 1:])).contiguous()  # [R, 15]
    return torch.searchsorted(mids, v.contiguous())  # how many midpoints lie below v


def _fit_groups(w, t, a, g):
    """Weighted least squares (scale, zero) per group for fixed level values t [R, K]."""
    r, k = w.shape
    w3, t3, a3 = w.view(r, k // g, g), t.view(r, k // g, g), a.view(1, k // g, g)
    sa, st, sw = a3.sum(-1), (a3 * t3).sum(-1), (a3 * w3).sum(-1)
    stt, stw = (a3 * t3 * t3).sum(-1), (a3 * t3 * w3).sum(-1)
    det = sa * stt - st * st
    ok = det > 1e-12 * (sa * stt).clamp_min(1e-30)
    safe = torch.where(ok, det, torch.ones_like(det))
    s = torch.where(ok, (sa * stw - st * sw) / safe, torch.zeros_like(det))
    z = torch.where(ok, (stt * sw - st * stw) / safe, sw / sa.clamp_min(1e-30))
    return s, z


def _weights(importance, k):
    a = importance.to(torch.float32).clamp_min(0) if importance is not None else torch.ones(k)
    return (a / a.mean().clamp_min(1e-30) + 1e-3).contiguous()  # no column ignored entirely


def fit_lut(w: torch.Tensor, group_size: int, importance: torch.Tensor | None = None, iters: int = LLOYD_ITERS,
            use_c: bool = True):
    """Levels (int8 [R, 16], ascending), scales_zeros (bf16 [K/g, R, 2]) and the nearest-level
    codes (uint8 [R, K]) of rows w, all as the kernel reads them (bf16 scale/zero, int8 levels).
    The C core's sq_lut_fit (runtime/core/csrc/gptq.c) when it builds, else ``fit_lut_py``: the
    same iterations (float sums in other orders, so not the same bits)."""
    from .ccore import lib as core_lib

    lib = core_lib() if use_c else None
    if lib is None:
        return fit_lut_py(w, group_size, importance, iters)
    r, k = w.shape
    w = w.to(torch.float32).contiguous()
    a = _weights(importance, k)
    init = torch.tensor(IQ4NL, dtype=torch.float32)
    levels = torch.empty(r, 16, dtype=torch.int8)
    sz = torch.empty(k // group_size, r, 2, dtype=torch.bfloat16)
    codes = torch.empty(r, k, dtype=torch.uint8)
    if lib.sq_lut_fit(w.data_ptr(), r, k, group_size, a.data_ptr(), iters, init.data_ptr(), levels.data_ptr(),
                      sz.data_ptr(), codes.data_ptr()):
        raise MemoryError("sq_lut_fit: out of memory")
    return levels, sz, codes


def fit_lut_py(w: torch.Tensor, group_size: int, importance: torch.Tensor | None = None, iters: int = LLOYD_ITERS):
    """The torch reference of fit_lut."""
    r, k = w.shape
    g = group_size
    a = _weights(importance, k)
    w3 = w.view(r, k // g, g)
    lo, hi = w3.amin(-1), w3.amax(-1)
    s = ((hi - lo) / 240.0).clamp_min(1e-12)  # IQ4NL spans -127..113
    z = (hi + lo) / 2 + 7.0 * s
    levels = torch.tensor(IQ4NL, dtype=torch.float32).repeat(r, 1)
    aw = a.view(1, k)
    for _ in range(iters):
        v = ((w3 - z[..., None]) / s[..., None]).view(r, k)
        q = nearest(v, levels)
        t = levels.gather(1, q)
        s_new, z_new = _fit_groups(w, t, a, g)
        keep = s_new > 0  # a group whose fit collapsed keeps its last parameters
        s, z = torch.where(keep, s_new, s), torch.where(keep, z_new, z)
        v = ((w3 - z[..., None]) / s[..., None]).view(r, k)
        wt = aw * (s ** 2).repeat_interleave(g, dim=1)  # weight-space error weights
        num = torch.zeros(r, 16).scatter_add_(1, q, wt * v)
        den = torch.zeros(r, 16).scatter_add_(1, q, wt)
        levels = torch.where(den > 0, num / den.clamp_min(1e-30), levels)
        levels = torch.sort(levels.clamp(-127, 127), dim=1).values
    # full int8 range for the levels: the scale absorbs the factor
    peak = levels.abs().amax(1, keepdim=True).clamp_min(1e-6)
    levels = levels * (127.0 / peak)
    s = s * (peak / 127.0)
    lv = torch.sort(torch.round(levels).clamp(-127, 127), dim=1).values
    # the final codes and parameters against the stored (int8, bf16) grid
    sb = s.to(torch.bfloat16).float()
    v = ((w3 - z[..., None]) / torch.where(sb > 0, sb, torch.ones_like(sb))[..., None]).view(r, k)
    q = nearest(v, lv)
    s2, z2 = _fit_groups(w, lv.gather(1, q), a, g)
    ok = s2 > 0
    s, z = torch.where(ok, s2, s), torch.where(ok, z2, z)
    sb, zb = s.to(torch.bfloat16), z.to(torch.bfloat16)
    ok = sb.float() > 0
    safe = torch.where(ok, sb.float(), torch.ones_like(sb.float()))
    v = torch.where(ok[..., None], (w3 - zb.float()[..., None]) / safe[..., None], torch.zeros_like(w3)).view(r, k)
    codes = nearest(v, lv).to(torch.uint8)  # a group with no scale: the level nearest 0, as GPTQ
    sz = torch.stack([sb.T, zb.T], -1).contiguous()  # [K/g, R, 2]
    return lv.to(torch.int8), sz, codes
