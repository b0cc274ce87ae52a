"""Packed int4 byte layouts read by ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

A quantized linear has ``N`` output rows and ``K`` input columns, with 4-bit codes
``q[n, k]`` in 0..15 and the kernel's dequantization ``w = (q - 8) * scale + zero``.
The packed tensor is ``uint8 [N, K/2]`` (that is only its nominal shape: the bytes are
not row-major). Rows are cut into blocks of ``B`` rows (``block_rows``); block ``b``
covers rows ``b*B .. b*B+nb-1`` where ``nb = min(B, N - b*B)`` (always a multiple of
16) and its bytes start at ``b * B * K / 2``. Inside a block the bytes are k-major:
column ``k`` of the block occupies ``nb/2`` bytes at ``k * nb/2``. Byte ``j`` of that
column holds two codes, low nibble first:

=========  ===  ===========================================  ===========================
layout      B   full block (nb == B), byte j                  tail block (nb < B)
=========  ===  ===========================================  ===========================
avx512     64   ``q[j] | q[j+32] << 4``  (j in 0..31)         ``q[2j] | q[2j+1] << 4``
avx2       32   ``q[j] | q[j+16] << 4``  (j in 0..15)         ``q[2j] | q[2j+1] << 4``
default    32   ``q[2j] | q[2j+1] << 4`` (j in 0..15)         ``q[2j] | q[2j+1] << 4``
=========  ===  ===========================================  ===========================

(``q[r]`` means row ``b*B + r`` of the block, at column ``k``.) The layout is chosen by
the CPU capability torch dispatches to (``torch.backends.cpu.get_cpu_capability()``),
so bytes packed for one capability are silent garbage under another: every artifact
names its layout and readers check it against the host.

``rows32`` is sparkq's own layout, read by the C decode core (runtime/core/csrc)
and by no torch kernel: row-major (row ``n`` at byte ``n * K/2``), each row cut into
32-column blocks of 16 bytes, byte ``j`` of block ``b`` = ``q[32b+j] | q[32b+j+16] << 4``
(``q`` is the row's codes). A block's low nibbles are columns 0..15 and its high
nibbles 16..31, so two AND/shift ops give 32 codes in column order for an int8 dot
product against 32 activations. It does not depend on the CPU (the same bytes run under
AVX2, AVX512 and plain C), needs ``K % 32 == 0``, and its ``block_rows`` (16) only
aligns converter/runtime row chunks.

``scales_zeros`` is a separate, contiguous bf16 tensor ``[K/g, N, 2]``: ``[..., 0]``
the scale and ``[..., 1]`` the zero of group ``k // g`` of row ``n``.

This module is pure numpy/torch and never calls torch's own packer (the tests compare
against it byte for byte under every ``ATEN_CPU_CAPABILITY``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class _LazyTorch:
    """torch, imported on first use: importing sparkq.formats stays torch-free (~200 MiB of RSS),
    which the torch-free runtime (runtime/lite/model.py) relies on; every function here that uses
    torch imports it when called."""

    def __getattr__(self, name):
        import torch as _torch
        return getattr(_torch, name)


torch = _LazyTorch()


@dataclass(frozen=True)
class Layout:
    name: str
    block_rows: int
    interleaved: bool  # full blocks pair row j with row j + B/2 (else neighbours)
    rows: bool = False  # sparkq's row-major rows32 layout (no torch kernel reads it)


LAYOUTS: dict[str, Layout] = {
    "avx512": Layout("avx512", 64, True),
    "avx2": Layout("avx2", 32, True),
    "default": Layout("default", 32, False),
    "rows32": Layout("rows32", 16, False, rows=True),
}
ROWS32 = "rows32"
ATEN_LAYOUTS = ("avx512", "avx2", "default")

# torch.backends.cpu.get_cpu_capability() -> layout name
CAPABILITY_TO_LAYOUT = {"AVX512": "avx512", "AVX2": "avx2", "DEFAULT": "default"}
LAYOUT_TO_CAPABILITY = {v: k.lower() for k, v in CAPABILITY_TO_LAYOUT.items()}


class LayoutError(ValueError):
    pass


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(
            f"unknown packed layout {name!r}; known layouts: {', '.join(LAYOUTS)}"
        ) from None


def host_layout() -> str:
    """The layout the int4 kernel reads on this host (honours ATEN_CPU_CAPABILITY)."""
    cap = torch.backends.cpu.get_cpu_capability()
    try:
        return CAPABILITY_TO_LAYOUT[cap]
    except KeyError:
        raise LayoutError(
            f"torch's CPU capability {cap!r} has no known int4 layout "
            f"(supported: {', '.join(CAPABILITY_TO_LAYOUT)})"
        ) from None


def check_shape(n: int, k: int, layout: str | Layout | None = None) -> None:
    if n % 16 or n <= 0:
        raise LayoutError(f"int4 packing needs N % 16 == 0, got N={n}")
    if k % 2 or k <= 0:
        raise LayoutError(f"int4 packing needs an even K, got K={k}")
    lay = get_layout(layout) if isinstance(layout, str) else layout
    if lay is not None and lay.rows and k % 32:
        raise LayoutError(f"the rows32 layout needs K % 32 == 0, got K={k}; use --target native")


def _pack_rows32(codes: np.ndarray) -> np.ndarray:
    r, k = codes.shape
    c = codes.reshape(r, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1)


def _unpack_rows32(flat: torch.Tensor, n: int, k: int) -> torch.Tensor:
    b = flat.reshape(n, k // 32, 16)
    return torch.cat([b & 0xF, b >> 4], dim=2).reshape(n, k)


def _pairs(codes: np.ndarray, layout: Layout, full: bool) -> tuple[np.ndarray, np.ndarray]:
    """Split one block's rows [nb, K] into (low-nibble rows, high-nibble rows)."""
    if full and layout.interleaved:
        h = layout.block_rows // 2
        return codes[:h], codes[h:]
    return codes[0::2], codes[1::2]


def pack_rows(codes: np.ndarray, layout: str | Layout, n_total: int) -> np.ndarray:
    """Pack uint8 codes for rows ``[r0, r0+len)`` of an ``n_total``-row matrix.

    ``r0`` must be a multiple of the block size, and ``len`` too unless the slice ends
    at ``n_total``. Returns the bytes (flat uint8) that lie contiguously at byte offset
    ``r0 * K / 2`` of the packed tensor.
    """
    lay = get_layout(layout) if isinstance(layout, str) else layout
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    if lay.rows:
        return _pack_rows32(codes)
    rows, k = codes.shape
    B = lay.block_rows
    out = np.empty(rows * k // 2, dtype=np.uint8)
    nfull = rows // B
    if nfull:
        blk = codes[: nfull * B].reshape(nfull, B, k)
        if lay.interleaved:
            lo, hi = blk[:, : B // 2], blk[:, B // 2 :]
        else:
            lo, hi = blk[:, 0::2], blk[:, 1::2]
        packed = (lo | (hi << 4)).transpose(0, 2, 1)  # [nfull, K, B/2]
        out[: nfull * B * k // 2] = packed.reshape(-1)
    tail = rows - nfull * B
    if tail:
        t = codes[nfull * B :]
        lo, hi = t[0::2], t[1::2]
        out[nfull * B * k // 2 :] = (lo | (hi << 4)).T.reshape(-1)
    return out


def unpack(packed: torch.Tensor | np.ndarray, layout: str | Layout, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows` for a whole matrix: uint8 codes ``[N, K]``."""
    lay = get_layout(layout) if isinstance(layout, str) else layout
    flat = torch.as_tensor(packed).reshape(-1)
    if lay.rows:
        return _unpack_rows32(flat, n, k)
    B = lay.block_rows
    nfull = n // B
    parts = []
    if nfull:
        blk = flat[: nfull * B * k // 2].reshape(nfull, k, B // 2)
        lo, hi = blk & 0xF, blk >> 4
        if lay.interleaved:
            rows = torch.cat([lo, hi], dim=2)  # [nfull, K, B]
        else:
            rows = torch.stack([lo, hi], dim=3).reshape(nfull, k, B)
        parts.append(rows.transpose(1, 2).reshape(nfull * B, k))
    tail = n - nfull * B
    if tail:
        t = flat[nfull * B * k // 2 :].reshape(k, tail // 2)
        rows = torch.stack([t & 0xF, t >> 4], dim=2).reshape(k, tail)
        parts.append(rows.T)
    return torch.cat(parts, 0) if len(parts) > 1 else parts[0].contiguous()


def row_addressing(rows: torch.Tensor, layout: str | Layout, n: int, k: int):
    """For each row index: (byte offset of its column 0, bytes per column step, nibble shift)."""
    lay = get_layout(layout) if isinstance(layout, str) else layout
    B = lay.block_rows
    rows = rows.to(torch.int64)
    b = rows // B
    j = rows - b * B
    nb = torch.clamp(n - b * B, max=B)
    full = nb == B
    if lay.interleaved:
        byte = torch.where(full, j % (B // 2), j // 2)
        shift = torch.where(full, (j >= B // 2).to(torch.int64) * 4, (j % 2) * 4)
    else:
        byte = j // 2
        shift = (j % 2) * 4
    base = b * (B * k // 2) + byte
    return base, nb // 2, shift


def gather_rows(packed: torch.Tensor, layout: str | Layout, n: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[len(rows), K]`` of the given rows, read straight from packed bytes."""
    lay = get_layout(layout) if isinstance(layout, str) else layout
    if lay.rows:
        return _unpack_rows32(packed.reshape(n, k // 2)[rows.to(torch.int64)], rows.numel(), k)
    base, step, shift = row_addressing(rows, layout, n, k)
    ks = torch.arange(k, dtype=torch.int64)
    idx = base[:, None] + ks[None, :] * step[:, None]
    flat = packed.reshape(-1)
    return (flat[idx] >> shift[:, None].to(torch.uint8)) & 0xF


def _apply_groups(vals: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, dtype) -> torch.Tensor:
    """``vals * scale + zero`` per group, vals float32 [R, K], scales_zeros [K/g, R, 2]."""
    r, k = vals.shape
    g = group_size
    sz = scales_zeros.to(torch.float32)
    w = vals.reshape(r, k // g, g) * sz[..., 0].T.reshape(r, k // g, 1) + sz[..., 1].T.reshape(r, k // g, 1)
    return w.reshape(r, k).to(dtype or torch.bfloat16)


def dequantize_codes(codes: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(q - 8) * scale + zero`` for codes ``[R, K]`` and scales_zeros ``[K/g, R, 2]`` (dtype: bf16 by default)."""
    return _apply_groups(codes.to(torch.float32) - 8.0, scales_zeros, group_size, dtype)


def dequantize_codes_lut(codes: torch.Tensor, scales_zeros: torch.Tensor, levels: torch.Tensor, group_size: int,
                         dtype: torch.dtype | None = None) -> torch.Tensor:
    """A lut4 linear's ``levels[r][q] * scale + zero`` (constants.py) for codes ``[R, K]``,
    scales_zeros ``[K/g, R, 2]`` and levels ``[R, 16]`` (int8 or float; dtype: bf16 by default)."""
    return _apply_groups(levels.to(torch.float32).gather(1, codes.long()), scales_zeros, group_size, dtype)


def residual_rows(residual: torch.Tensor, rscales: torch.Tensor, n: int, k: int, group_size: int,
                  rows: torch.Tensor, rmap: torch.Tensor | None = None) -> torch.Tensor:
    """A split linear's second plane for the given rows (constants.py): ``(r - 8) * rscale``,
    float32 ``[len(rows), K]``; ``residual`` is rows32 bytes ``[M, K/2]``, ``rscales`` bf16 ``[M, K/g]``
    (M = N, or a partial split's M rows with ``rmap`` int32 [N]: rows it maps to -1 get zeros)."""
    ids = rows.to(torch.int64)
    if rmap is not None:
        ids = rmap[ids].to(torch.int64)
        out = torch.zeros(ids.numel(), k)
        have = ids >= 0
        if have.any():
            out[have] = residual_rows(residual, rscales, residual.shape[0], k, group_size, ids[have])
        return out
    r = _unpack_rows32(residual.reshape(-1, k // 2)[ids], ids.numel(), k).to(torch.float32)
    s = rscales[ids].to(torch.float32)
    return ((r.view(-1, k // group_size, group_size) - 8.0) * s[..., None]).view(-1, k)


def dequantize_t(packed: torch.Tensor, scales_zeros: torch.Tensor, layout: str | Layout, n: int, k: int,
                 group_size: int, out: torch.Tensor) -> torch.Tensor:
    """Dequantize rows ``[0, n)`` of a packed slice into ``out`` = W^T, shape ``[K, n]``.

    Works in the packed (k-major) order, so the only transpose is the write into
    ``out``; ``packed`` is the flat byte slice of those rows (starting on a block
    boundary) and ``scales_zeros`` the matching ``[K/g, n, 2]`` slice.
    ``w = (q - 8) * scale + zero`` is computed in ``out.dtype``.
    """
    lay = get_layout(layout) if isinstance(layout, str) else layout
    g, B, dt = group_size, lay.block_rows, out.dtype
    flat = packed.reshape(-1)
    sz = scales_zeros.to(dt)
    if lay.rows:
        c = _unpack_rows32(flat, n, k).to(dt).view(n, k // g, g)
        s, z = sz[..., 0].T.unsqueeze(2), sz[..., 1].T.unsqueeze(2)
        torch.addcmul(z - 8 * s, c, s, out=out.T.unflatten(1, (k // g, g)))
        return out
    nfull = n // B
    if nfull:
        blk = flat[: nfull * B * k // 2].view(nfull, k, B // 2)
        lo, hi = blk & 0xF, blk >> 4
        codes = torch.cat([lo, hi], -1) if lay.interleaved else torch.stack([lo, hi], -1).view(nfull, k, B)
        c = codes.to(dt).view(nfull, k // g, g, B)
        s = sz[:, : nfull * B, 0].reshape(k // g, nfull, B).permute(1, 0, 2).unsqueeze(2)
        z = sz[:, : nfull * B, 1].reshape(k // g, nfull, B).permute(1, 0, 2).unsqueeze(2)
        dst = out[:, : nfull * B].view(k // g, g, nfull, B).permute(2, 0, 1, 3)
        torch.addcmul(z - 8 * s, c, s, out=dst)
    tail = n - nfull * B
    if tail:
        t = flat[nfull * B * k // 2:].view(k, tail // 2)
        c = torch.stack([t & 0xF, t >> 4], -1).view(k // g, g, tail).to(dt)
        s = sz[:, nfull * B:, 0].unsqueeze(1)
        z = sz[:, nfull * B:, 1].unsqueeze(1)
        torch.addcmul(z - 8 * s, c, s, out=out[:, nfull * B:].view(k // g, g, tail))
    return out
