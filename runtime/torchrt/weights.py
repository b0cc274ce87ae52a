"""Linear layers over memory-mapped weights, and the two ways to build them.

``Int4Linear`` holds views into the artifact's mapping (packed codes + scales/zeros)
and never copies them. rows32 linears multiply in the C core (few rows, and many rows where
its W4A8 GEMM pays: ``Int4Linear.c_gemm``); otherwise few rows go through torch's int4
kernel and many rows (prefill) dequantize the same packed bytes, block by block, into a
reused scratch buffer and use a dense matmul: bf16 where the CPU has native bf16, else fp32
(on AVX2 the bf16 GEMM is 3x slower than the int4 kernel, fp32 GEMM 2x faster at 512 rows).
"""
from __future__ import annotations

import torch
from sparkq.formats import constants as C
from sparkq.formats.layout import (dequantize_codes, dequantize_codes_lut, dequantize_t, gather_rows, get_layout,
                                   residual_rows, unpack)

from .layers import prefill_dtype  # noqa: F401  (re-exported)
from ..options import PREFILL_MODES  # noqa: F401  (the `--prefill` names of prefill_dequant)

int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu

# rows at or below this use the int4 kernel even with prefill_dequant
KERNEL_MAX_ROWS = 256  # measured crossover on the AVX2 box (README: prefill table)
# rows32 linears: at or below this many rows the C W4A8 kernel, above it dequantize + dense GEMM.
# Measured crossover (whole forward, C vs dequant+GEMM tok/s): example 32 rows 1.23x, 64 rows 0.91x;
# Qwen3-1.7B shape 64 rows 1.28x, 96 rows 0.95x, 128 rows 1.03x, 192 rows 0.77x.
C_MAX_ROWS = 64
# ... and above it, with prefill_dequant=None (auto), rows32 int4 linears with K >= C_GEMM_MIN_K
# whose activations pair up for the AVX2 kernel (c_gemm_pairs) still take the
# C core's W4A8 GEMM: `python tools/gemmbench.py` at 512 rows, against dequantize + fp32
# GEMM, over three runs: K=256 0.96x, K=384 1.10-1.25x, K=576 1.11-1.32x, K=1536 1.11-1.29x,
# K=2048/6144 1.32-1.46x (docs/performance.md "Prompt processing").
C_GEMM_MIN_K = 384


def c_gemm_pairs(k: int, g: int) -> bool:
    """Whether the SIMD W4A8 products read this linear's activations in pairs of 32-column blocks
    (act.c: K a multiple of 64; g32 scales the pair's two lanes apart, larger groups span whole pairs)."""
    return k % 64 == 0 and (g == 32 or g % 64 == 0)


class Scratch:
    """One buffer reused by every dequantizing matmul (grown once, never shrunk).

    1M elements (4 MiB fp32): against 4M, prefill pp512 1.11x-1.17x on the Qwen3-1.7B shape
    and ~1.12x on the example, 12 MiB less RSS (`sparkq bench MODEL --tg 16` with the size as
    an arm; the dequantized block stays in L3); 256K was slower (0.99x)."""

    def __init__(self, max_elems: int = 1 << 20, dtype: torch.dtype | None = None):
        self.max_elems = max_elems
        self.dtype = dtype or prefill_dtype()
        self.buf = torch.empty(0, dtype=self.dtype)

    def get(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=self.dtype)
        return self.buf[:n]


def c_matmul(lin, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x @ W^T through the C core's products (lin.c = (lib, SqLinear), set by fastpath.attach_linears)."""
    import ctypes

    lib, desc = lin.c
    xc = (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()
    if out_dtype == torch.bfloat16:  # the C core writes bf16 directly (no [M, N] fp32 buffer here)
        y, yb = None, torch.empty(x.shape[0], lin.n, dtype=torch.bfloat16)
    else:
        y, yb = torch.empty(x.shape[0], lin.n, dtype=torch.float32), None
    if lib.sq_linear_batch(ctypes.byref(desc), xc.data_ptr(), int(xc.dtype == torch.bfloat16), xc.shape[0],
                           y.data_ptr() if y is not None else None, yb.data_ptr() if yb is not None else None):
        raise MemoryError(f"{lin.name}: C kernel could not allocate its activation buffers")
    if yb is not None:
        return yb
    return y if out_dtype == torch.float32 else y.to(out_dtype)


class Int4Linear:
    kind = C.KIND_INT4
    TENSOR_ATTRS = {"residual_scales": "rscales", "residual_map": "rmap"}  # artifact suffix -> attribute

    def tensor(self, suffix: str):
        """The artifact tensor ``suffix`` (formats/kinds.py) this linear holds, or None."""
        return getattr(self, self.TENSOR_ATTRS.get(suffix, suffix), None)

    def __init__(self, name: str, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                 n: int, k: int, layout: str, scratch: Scratch, prefill_dequant: bool | None = None):
        self.name, self.qweight, self.scales_zeros = name, qweight, scales_zeros
        self.g, self.n, self.k = group_size, n, k
        self.layout = get_layout(layout)
        self.scratch = scratch
        self.prefill_dequant = prefill_dequant
        B = self.layout.block_rows
        rows = max(B, (scratch.max_elems // k) // B * B)
        self.block_rows = min(n, rows)
        self.c = None  # (lib, SqLinear) when the C core is loaded (rows32 only)
        self.residual = self.rscales = None  # a split linear's second plane (set by linears_from_artifact)
        self.rmap = None  # a partial split's row map (formats/constants.py)

    def c_gemm(self, m: int) -> bool:
        """Whether m rows go through the C core's W4A8 product (else dequantize + dense GEMM)."""
        if self.c is None:
            return False
        if m <= C_MAX_ROWS or self.prefill_dequant is False:
            return True
        return self.prefill_dequant is None and self.k >= C_GEMM_MIN_K and c_gemm_pairs(self.k, self.g)

    def _c_dequant_matmul(self, xc: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Many rows: the C core dequantizes row blocks to fp32 [rows, K] (row-major, as rows32
        is), torch's GEMM multiplies with the transposed view (no copy)."""
        import ctypes

        lib, desc = self.c
        out = torch.empty(xc.shape[0], self.n, dtype=out_dtype)
        for r0 in range(0, self.n, self.block_rows):
            r1 = min(self.n, r0 + self.block_rows)
            w = self.scratch.get(self.k * (r1 - r0)).view(r1 - r0, self.k)
            lib.sq_dequant_rows(ctypes.byref(desc), r0, r1, w.data_ptr())
            if r1 - r0 == self.n:
                return (xc @ w.t()).to(out_dtype)
            torch.matmul(xc, w.t(), out=out[:, r0:r1]) if out_dtype == torch.float32 else \
                out[:, r0:r1].copy_(xc @ w.t())
        return out

    def dequant_t(self, r0: int, r1: int) -> torch.Tensor:
        """W^T for rows [r0, r1) (r0 on a layout block boundary), in the scratch buffer."""
        out = self.scratch.get(self.k * (r1 - r0)).view(self.k, r1 - r0)
        flat = self.qweight.reshape(-1)[r0 * self.k // 2: r1 * self.k // 2]
        return dequantize_t(flat, self.scales_zeros[:, r0:r1], self.layout, r1 - r0, self.k, self.g, out)

    def dequant(self) -> torch.Tensor:
        """The whole stored weight [N, K] in bf16, both planes of a split linear (tests and tools;
        not used on the hot path)."""
        if self.residual is not None:
            return self.rows(torch.arange(self.n))
        codes = unpack(self.qweight, self.layout, self.n, self.k)
        return dequantize_codes(codes, self.scales_zeros, self.g, torch.bfloat16)

    def uses_kernel(self, m: int) -> bool:
        if self.layout.rows:  # no torch kernel reads rows32: always dequantize (the C core decodes)
            return False
        return m <= KERNEL_MAX_ROWS or self.prefill_dequant is False

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        m = x.shape[0]
        if self.c_gemm(m):
            return c_matmul(self, x, out_dtype or x.dtype)
        if self.uses_kernel(m):
            y = int4_mm(x.contiguous(), self.qweight, self.g, self.scales_zeros)
            return y if out_dtype is None else y.to(out_dtype)
        out_dtype = out_dtype or x.dtype
        xc = x.to(self.scratch.dtype)
        if self.c is not None and self.scratch.dtype == torch.float32:
            return self._c_dequant_matmul(xc, out_dtype)
        if self.block_rows >= self.n:
            return (xc @ self.dequant_t(0, self.n)).to(out_dtype)
        out = torch.empty(m, self.n, dtype=out_dtype)
        for r0 in range(0, self.n, self.block_rows):
            r1 = min(self.n, r0 + self.block_rows)
            out[:, r0:r1] = xc @ self.dequant_t(r0, r1)
        return out

    def rows(self, ids: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
        """Rows of the stored weight gathered straight from the packed bytes (row -> block/lane);
        a split linear's rows add the second plane (in fp32, then rounded to dtype)."""
        codes = gather_rows(self.qweight, self.layout, self.n, self.k, ids)
        if self.residual is None:
            return dequantize_codes(codes, self.scales_zeros[:, ids], self.g, dtype)
        w = dequantize_codes(codes, self.scales_zeros[:, ids], self.g, torch.float32)
        return (w + residual_rows(self.residual, self.rscales, self.n, self.k, self.g, ids, self.rmap)).to(dtype)

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in fp32 with the whole stored weight (a split linear's both planes), W built
        in row blocks: the split head's refinement when many positions need it."""
        xf = x.float()
        out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        for r0 in range(0, self.n, self.block_rows):
            r1 = min(self.n, r0 + self.block_rows)
            torch.matmul(xf, self.rows(torch.arange(r0, r1), torch.float32).t(), out=out[:, r0:r1])
        return out

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup on the (tied) packed weight: no dense copy ever exists."""
        return self.rows(ids)


class LutLinear(Int4Linear):
    """A lut4 linear (formats/constants.py): rows32 codes into each row's 16 learned levels. The C
    core multiplies it (products, GEMMs and row dequantization); the torch fallback dequantizes
    with a gather."""
    kind = C.KIND_LUT4

    def __init__(self, name: str, qweight, scales_zeros, levels, group_size: int, n: int, k: int, scratch: Scratch,
                 prefill_dequant: bool | None = None):
        super().__init__(name, qweight, scales_zeros, group_size, n, k, "rows32", scratch, prefill_dequant)
        self.levels = levels

    def rows(self, ids: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
        ids = ids.to(torch.int64)
        codes = gather_rows(self.qweight, self.layout, self.n, self.k, ids)
        return dequantize_codes_lut(codes, self.scales_zeros[:, ids], self.levels[ids], self.g, dtype)

    def dequant(self) -> torch.Tensor:
        return self.rows(torch.arange(self.n))

    def dequant_t(self, r0: int, r1: int) -> torch.Tensor:
        out = self.scratch.get(self.k * (r1 - r0)).view(self.k, r1 - r0)
        out.copy_(self.rows(torch.arange(r0, r1), self.scratch.dtype).T)
        return out


class Int8Linear:
    """Per-row int8 weights (sensitive roles such as the tied head): torch's int8 kernel,
    rows gathered straight from the mapped bytes for the embedding."""
    kind = C.KIND_INT8

    def tensor(self, suffix: str):
        return getattr(self, suffix, None)

    def __init__(self, name: str, qweight: torch.Tensor, scales: torch.Tensor):
        self.name, self.qweight, self.scales = name, qweight, scales
        self.n, self.k = qweight.shape
        self.c = None  # (lib, SqLinear) when the C core is loaded

    def uses_kernel(self, m: int) -> bool:
        return True

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.c is not None:
            return c_matmul(self, x, out_dtype or x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        return y if out_dtype is None else y.to(out_dtype)

    def rows(self, ids: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
        return (self.qweight[ids].to(torch.float32) * self.scales[ids].to(torch.float32)[:, None]).to(dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)

    def dequant(self) -> torch.Tensor:
        return self.rows(torch.arange(self.n))


class DenseLinear:
    """A bf16 linear (bf16 reference checkpoints, or linears the recipe kept in bf16)."""
    kind = C.KIND_BF16

    def tensor(self, suffix: str):
        assert suffix == "weight", suffix
        return self.weight.to(torch.bfloat16).contiguous()  # a no-op view for bf16 checkpoints

    def __init__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.name, self.weight, self.bias = name, weight, bias
        self.n, self.k = weight.shape

    def uses_kernel(self, m: int) -> bool:
        return True  # output is bf16-rounded, like the int4 kernel's

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = x @ self.weight.t()
        y = y + self.bias if self.bias is not None else y
        return y if out_dtype is None else y.to(out_dtype)

    def dequant(self) -> torch.Tensor:
        return self.weight

    def rows(self, ids: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
        return self.weight[ids].to(dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


def _int4(name, e, t, layout, scratch, prefill_dequant):
    lin = Int4Linear(name, t("qweight"), t("scales_zeros"), e.group_size, e.n, e.k, layout, scratch, prefill_dequant)
    lin.residual, lin.rscales, lin.rmap = t("residual"), t("residual_scales"), t("residual_map")
    return lin


# weight kind (formats/kinds.py) -> its torch linear, from (name, LinearEntry, tensor(suffix), layout,
# scratch, prefill_dequant)
TORCH_LINEARS = {
    C.KIND_INT4: _int4,
    C.KIND_LUT4: lambda name, e, t, layout, scratch, pd: LutLinear(name, t("qweight"), t("scales_zeros"), t("levels"),
                                                                   e.group_size, e.n, e.k, scratch, pd),
    C.KIND_INT8: lambda name, e, t, *_: Int8Linear(name, t("qweight"), t("scales")),
    C.KIND_BF16: lambda name, e, t, *_: DenseLinear(name, t("weight")),
}


def linears_from_artifact(art, tensors: dict[str, torch.Tensor], scratch: Scratch, prefill_dequant: bool | None):
    return {name: TORCH_LINEARS[e.kind](name, e, lambda s, name=name: tensors.get(f"{name}.{s}"), art.layout, scratch,
                                        prefill_dequant)
            for name, e in art.linears.items()}
