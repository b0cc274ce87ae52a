"""GPTQ (Frantar et al., 2022): activation-aware error compensation against any 16-level grid.

With a calibration Hessian ``H = X^T X`` of a linear's inputs, columns are quantized in act
order (most active inputs first) and each column's error is spread over the columns not yet
quantized through the upper Cholesky factor of ``H^-1``, minimising ``||(W - Q) X^T||`` rather
than ``||W - Q||``. The grid is per row and group: uniform int4 (``q - 8`` times the group's scale
plus its zero) or a lut4 row's learned levels (convert/lut.py); each group keeps the parameters
found on the original weights ("static groups"), so groups stay contiguous along K.

Blocked: inside a block of ``GPTQ_BLOCK`` columns the updates are sequential per column and run in
the C core (``sq_gptq_block``, rows over the threads; ``gptq_block_py`` is the same arithmetic in
torch, used without a C compiler and as the tests' reference); between blocks the rest of the
row is updated by one GEMM. The factor is computed in fp32 (as the paper's implementation) from
one Cholesky factorization: the upper factor of ``H^-1`` is ``flip(L^-1)`` for ``flip(H) = L L^T``.
"""
from __future__ import annotations

import numpy as np
import torch

from .ccore import lib as core_lib
from sparkq.formats.layout import dequantize_codes

# fraction of mean(diag H) added to the diagonal. 0.05, not the paper's 0.01: chosen on a
# validation slice of wikitext-2 (chars 200k-300k, disjoint from the fidelity text and from
# the calibration) with the bundled calibration text: KL 0.1463 (0.01), 0.1370 (0.05),
# 0.1458 (0.1), 0.1417 (0.2) -- more damping is more robust when the calibration text's
# domain differs from the user's.
GPTQ_DAMP = 0.05
GPTQ_BLOCK = 128  # columns per block (a multiple of every group size)

def gptq_factor(h, damp: float = GPTQ_DAMP):
    """H (float32 [K, K], sum of x x^T over calibration tokens) -> (upper Cholesky factor of
    (H + damp*mean(diag) I)^-1 in act order (fp32 [K, K]), the order (columns by descending diag
    H), and the mask of dead input columns that never fired). ``h`` may be a list holding H, which
    is emptied, and optionally a function that recomputes H if the factorization needs more
    damping. H is overwritten when that function is given (permuted and factored in place), else copied.
    Peak: one K x K fp32 matrix: H is factored, inverted, transposed and flipped in its own memory
    (4.3 were alive once, two until 2026-12-05: docs/quality.md "Conversion cost")."""
    rebuild = None
    if isinstance(h, list):
        rebuild = h[1] if len(h) > 1 else None
        h, _ = h.pop(0), h.clear()
    if rebuild is None:  # H is kept for another damping: the factorization runs on a copy
        orig = h
        rebuild, h = (lambda: orig.clone()), orig.clone()
    diag = torch.diagonal(h)
    dead = diag == 0
    perm = torch.argsort(torch.where(dead, 1.0, diag.double()), descending=True)
    rev = perm.flip(0)  # flip(H[perm][:, perm]): reversed act order
    k = h.shape[0]
    dead_rev = dead[rev]
    # every matrix in the order LAPACK reads, so that no call copies: H is permuted in place and,
    # being symmetric, its row-major memory is the column-major matrix the factorization runs on;
    # the inverse is solved as the transposed system U X^T = I on the row-major X
    info = torch.empty(0, dtype=torch.int32)
    for extra in (damp, 0.1, 1.0):  # escalate the damping if H is numerically singular
        if h is None:
            h = rebuild()  # rare: the failed factorization overwrote H (recomputed for the next damping)
        _permute_symmetric(h, rev)
        low = h.mT
        d = torch.diagonal(low)  # a view: dead columns and the damping go in place
        d[dead_rev] = 1.0
        d += extra * d.mean()
        torch.linalg.cholesky_ex(low, out=(low, info))
        if int(info) == 0:
            break
        h = diag = None
    else:
        raise ValueError("calibration Hessian is not positive definite even with damping")
    del diag, d, low
    # h's row-major memory holds U = L^T: U^-1 = (L^-1)^T in place, transposed to L^-1
    _upper_inverse_(h)
    _transpose(h)
    inv = h
    del h
    flat, n, c = inv.view(-1), k * k, 1 << 20  # flip both axes in place: reverse the row-major array
    for a in range(0, n // 2, c):
        b = min(c, n // 2 - a)
        head = flat[a:a + b].clone()
        flat[a:a + b] = flat[n - a - b:n - a].flip(0)
        flat[n - a - b:n - a] = head.flip(0)
    return inv, perm, dead


INV_BLOCK = 512  # rows of U^-1 per step (the transients: one block row)


def _upper_inverse_(u: torch.Tensor, block: int | None = None) -> None:
    """u <- U^-1 in place for an upper-triangular U (row-major; whatever lies below its diagonal
    is ignored and left zero), by row blocks from the bottom: with the trailing part C already
    replaced by C^-1, block row I becomes X_II = U_II^-1 and X_I,>I = -X_II (U_I,>I C^-1), the
    product skipping C^-1's zero blocks: about K^3 / 3 multiply-adds (LAPACK trtri's) instead of the
    K^3 of a triangular solve against the whole identity, in U's own memory, with transients of one
    block row (measured at K = 8960: docs/quality.md "Conversion cost")."""
    k, b = u.shape[0], block or INV_BLOCK
    for j in reversed(range(0, k, b)):
        e = min(b, k - j)
        xii = torch.linalg.solve_triangular(u[j:j + e, j:j + e].triu(), torch.eye(e), upper=True)
        if j + e < k:
            r = torch.empty(e, k - j - e)
            for c in range(j + e, k, b):  # C^-1 is zero below its diagonal blocks
                c1 = min(k, c + b)
                r[:, c - j - e:c1 - j - e] = u[j:j + e, j + e:c1] @ u[j + e:c1, c:c1]
            u[j:j + e, j + e:] = torch.mm(xii, r).neg_()
        u[j:j + e, j:j + e] = xii
        u[j:j + e, :j] = 0.0


def _permute_rows(a: np.ndarray, src: np.ndarray) -> None:
    """a <- a[src] in place, one row buffer: each cycle of the permutation moves whole rows."""
    seen = np.zeros(len(src), dtype=bool)
    for i0 in range(len(src)):
        if seen[i0] or src[i0] == i0:
            seen[i0] = True
            continue
        tmp = a[i0].copy()
        i = i0
        while True:
            seen[i] = True
            j = src[i]
            if j == i0:
                a[i] = tmp
                break
            a[i] = a[j]
            i = j


def _transpose(h: torch.Tensor, tile: int = 256) -> None:
    """h <- h^T in place (square, row-major), tile by tile."""
    k = h.shape[0]
    for i in range(0, k, tile):
        d = h[i:i + tile, i:i + tile]
        d.copy_(d.T.clone())
        for j in range(i + tile, k, tile):
            a, b = h[i:i + tile, j:j + tile], h[j:j + tile, i:i + tile]
            t = a.clone()
            a.copy_(b.T)
            b.copy_(t.T)


def _permute_symmetric(h: torch.Tensor, order: torch.Tensor) -> None:
    """h <- h[order][:, order] in place for a symmetric h (float32 [K, K] row-major): rows
    permuted, the result transposed (h[order]^T = h[:, order]), rows permuted again; whole-row
    moves and square tiles, no strided column copies."""
    src = order.numpy()
    _permute_rows(h.numpy(), src)
    _transpose(h)
    _permute_rows(h.numpy(), src)


def gptq_block_py(w, hinv, s, z, grp, tab, codes, err):
    """The reference of sq_gptq_block (runtime/core/csrc/gptq.c), in place on the views given."""
    B = w.shape[1]
    for i in range(B):
        x = w[:, i]
        sc, zc = s[:, grp[i]], z[:, grp[i]]
        ok = sc > 0
        v = torch.where(ok, (x - zc) / torch.where(ok, sc, torch.ones_like(sc)), torch.zeros_like(x))
        if tab is None:
            q = torch.where(ok, torch.round(v + 8.0).clamp_(0, 15), torch.full_like(x, 8.0))
            dq = (q - 8.0) * sc + zc
        else:
            mids = 0.5 * (tab[:, :-1] + tab[:, 1:])  # [R, 15]
            q = (v[:, None] > mids).sum(1).to(torch.float32)
            dq = tab.gather(1, q.long()[:, None])[:, 0] * sc + zc
        codes[:, i] = q.to(torch.uint8)
        e = (x - dq) / hinv[i, i]
        err[:, i] = e
        w[:, i + 1:] -= e[:, None] * hinv[i, i + 1:][None, :]


def gptq_rows(w: torch.Tensor, group_size: int, scale: torch.Tensor, zero: torch.Tensor, hinv_u: torch.Tensor,
              perm: torch.Tensor, dead: torch.Tensor, tab: torch.Tensor | None = None, use_c: bool = True):
    """Codes (uint8 [R, K], column order) for rows w (float32 [R, K]) on the grid given by per-group
    ``scale``/``zero`` (float32 [R, K/g], the bf16-rounded values the kernel reads) and, for lut4,
    the rows' ascending levels ``tab`` (float32 [R, 16])."""
    r, k = w.shape
    g = group_size
    lib = core_lib() if use_c else None
    w = w.clone()
    w[:, dead] = 0.0
    w = w[:, perm].contiguous()
    grp = (perm // g).to(torch.int32).contiguous()
    scale, zero = scale.contiguous(), zero.contiguous()
    tab = tab.contiguous() if tab is not None else None
    qp = torch.empty(r, k, dtype=torch.uint8)
    for i1 in range(0, k, GPTQ_BLOCK):
        i2 = min(k, i1 + GPTQ_BLOCK)
        b = i2 - i1
        err = torch.empty(r, b)
        if lib is not None:
            lib.sq_gptq_block(w.data_ptr() + 4 * i1, k, hinv_u.data_ptr() + 4 * (i1 * k + i1), k, scale.data_ptr(),
                              zero.data_ptr(), scale.shape[1], grp.data_ptr() + 4 * i1,
                              tab.data_ptr() if tab is not None else None, r, b, qp.data_ptr() + i1, k, err.data_ptr())
        else:
            codes = torch.empty(r, b, dtype=torch.uint8)
            gptq_block_py(w[:, i1:i2], hinv_u[i1:i2, i1:i2], scale, zero, grp[i1:i2], tab, codes, err)
            qp[:, i1:i2] = codes
        if i2 < k:
            w[:, i2:] -= err @ hinv_u[i1:i2, i2:]
    codes = torch.empty(r, k, dtype=torch.uint8)
    codes[:, perm] = qp
    return codes



def gptq_int4(w: torch.Tensor, group_size: int, hinv_u: torch.Tensor, perm: torch.Tensor, dead: torch.Tensor):
    """GPTQ on the uniform int4 grid, each group's scale and zero from the ``clip`` search on the
    original weights. Returns (codes uint8 [R, K], scales_zeros bf16 [K/g, R, 2], squared error,
    squared weight sum), as ``quantize_rows`` (the error in weight space, against the input rows)."""
    from .quantize import quantize_rows

    w0 = w.clone()
    w0[:, dead] = 0.0
    _, sz, _, _ = quantize_rows(w0, group_size, "clip", fast=True)
    del w0
    codes = gptq_rows(w, group_size, sz[..., 0].float().T, sz[..., 1].float().T, hinv_u, perm, dead)
    err = float(((w - dequantize_codes(codes, sz, group_size, torch.float32)) ** 2).sum(dtype=torch.float64))
    return codes, sz, err, float((w.to(torch.float64) ** 2).sum())
