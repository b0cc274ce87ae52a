"""One writer per weight kind (formats/kinds.py): read a linear's source rows in blocks, quantize,
pack in the layout's bytes, write its tensors, and hand the calibration the weight it moves on
through (``Job.deq``). ``write_linear`` picks the writer from ``WRITERS``."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from sparkq.formats import constants as C
from sparkq.formats.kinds import KINDS
from sparkq.formats.layout import ROWS32, check_shape, dequantize_codes, dequantize_codes_lut, get_layout, pack_rows
from sparkq.formats.manifest import LinearEntry
from sparkq.formats.spec import ModelSpec
from sparkq.formats.tensorfile import TensorFileWriter

from .ccore import CoreLinear
from .ccore import lib as core_lib
from .gptq import gptq_factor, gptq_int4, gptq_rows
from .headrows import row_map, top_rows
from .lut import fit_lut
from .quantize import CALIBRATED, quantize_int8_rows, quantize_residual, quantize_rows
from .source import Source, read_fused_rows

ROW_CHUNK_ELEMS = 256 << 10  # float32 elements per row block (1 MiB): keeps peak RSS low
GPTQ_ROW_ELEMS = 4 << 20  # gptq: 16 MiB row blocks (its per-column loop runs once per block)


@dataclass
class Job:
    """One linear to write: where from, where to, how; ``core``: the C core when the calibration
    moves on through the packed weight (rows32, the core loaded), else ``want_deq`` asks for the
    dequantized float32 weight."""
    w: TensorFileWriter
    source: Source
    lin: LinearEntry
    part_rows: list
    layout: str
    method: str
    bar: object
    hessian: list | None
    want_deq: bool
    core: object
    importance: object
    chunk: int

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        return read_fused_rows(self.source, self.lin.sources, self.part_rows, r0, r1)


def write_linear(w: TensorFileWriter, source: Source, spec: ModelSpec, lin: LinearEntry, layout: str,
                 method: str, bar, hessian: list | None = None,
                 keep_deq: bool = True, importance=None) -> tuple[float, torch.Tensor | CoreLinear | None]:
    """Quantize, pack and write one linear; returns its relative error and, with a calibration
    ``hessian`` (gptq), the weight the calibration moves on through: the packed ``CoreLinear``
    (rows32 with the C core loaded), else the dequantized float32 [N, K] (``keep_deq=False`` for the
    head, which ends the forward: at a 152k vocabulary that buffer alone is 1.2 GB). A partial split
    (``lin.residual_rows`` < N) gives its second plane to the rows of the largest ``importance``,
    the rows' mean probabilities (convert/headrows.py)."""
    want_deq = hessian is not None and keep_deq
    core = core_lib() if want_deq and layout == ROWS32 and lin.kind != C.KIND_BF16 else None
    if KINDS[lin.kind].grouped:
        check_shape(lin.n, lin.k, layout)
    chunk = max(get_layout(layout).block_rows, (ROW_CHUNK_ELEMS // lin.k) // 64 * 64)
    return WRITERS[lin.kind](Job(w, source, lin, spec.part_rows(lin.name, len(lin.sources)), layout, method, bar, hessian,
                                 want_deq and core is None, core, importance, chunk))


def _rel(err: float, ref: float) -> float:
    return (err / ref) ** 0.5 if ref > 0 else 0.0


def write_bf16(j: Job):
    w, lin, chunk, bar = j.w, j.lin, j.chunk, j.bar
    deq = torch.empty(lin.n, lin.k) if j.want_deq else None
    w.begin(f"{lin.name}.weight")
    for r0 in range(0, lin.n, chunk):
        rows = j.rows(r0, min(lin.n, r0 + chunk))
        if deq is not None:
            deq[r0:r0 + rows.shape[0]] = rows.to(torch.bfloat16).float()
        w.write(rows.to(torch.bfloat16).view(torch.uint8).numpy())
        bar.update(rows.numel() * 2)
    w.end()
    return 0.0, deq


def write_int8(j: Job):
    w, lin, chunk, bar, core = j.w, j.lin, j.chunk, j.bar, j.core
    err = ref = 0.0
    deq = torch.empty(lin.n, lin.k) if j.want_deq else None
    scales = torch.empty(lin.n, dtype=torch.bfloat16)
    packed = np.empty((lin.n, lin.k), dtype=np.int8) if core is not None else None
    w.begin(f"{lin.name}.qweight")
    for r0 in range(0, lin.n, chunk):
        r1 = min(lin.n, r0 + chunk)
        q, s, e, rf = quantize_int8_rows(j.rows(r0, r1))
        err, ref = err + e, ref + rf
        if deq is not None:
            deq[r0:r1] = q.float() * s.float()[:, None]
        if packed is not None:
            packed[r0:r1] = q.numpy()
        w.write(q.view(torch.uint8).numpy())
        scales[r0:r1] = s
        bar.update(q.numel())
    w.end()
    w.put(f"{lin.name}.scales", scales.view(torch.uint8).numpy())
    if packed is not None:
        deq = CoreLinear(core, C.KIND_INT8, lin.n, lin.k, None, {"qweight": packed, "scales": scales})
    return _rel(err, ref), deq


def write_int4(j: Job):
    """Uniform 4-bit codes per group (minmax, clip or GPTQ), and a split head's second plane."""
    w, lin, chunk, bar, core, method, importance = j.w, j.lin, j.chunk, j.bar, j.core, j.method, j.importance
    hessian, want_deq, lay = j.hessian, j.want_deq, get_layout(j.layout)
    err = ref = 0.0
    deq = None
    # one preallocated scales/zeros tensor, filled per block: retaining many small per-block
    # tensors between large transient ones fragments the heap (measured: +2.3 GB on a 152k vocab)
    sz_all = torch.empty(lin.k // lin.group_size, lin.n, 2, dtype=torch.bfloat16)
    keep = None  # a partial split: the rows that keep their second plane
    if lin.residual:  # the second plane, written after the first (rows32 bytes, formats/constants.py)
        res_all = np.empty(lin.n * lin.k // 2, dtype=np.uint8)
        rs_all = torch.empty(lin.n, lin.k // lin.group_size, dtype=torch.bfloat16)
        if lin.residual_rows is not None and lin.residual_rows < lin.n:
            assert importance is not None, f"{lin.name}: a partial split without its rows' probabilities"
            keep = np.zeros(lin.n, dtype=bool)
            keep[top_rows(importance, lin.residual_rows)] = True
    packed = np.empty(lin.n * lin.k // 2, dtype=np.uint8) if core is not None else None
    factor = None
    if hessian is not None:
        factor = gptq_factor(hessian)
        chunk = max(chunk, (GPTQ_ROW_ELEMS // lin.k) // 64 * 64)  # fewer, larger blocks: the column loop is per block
        deq = torch.empty(lin.n, lin.k) if want_deq else None
    elif method in CALIBRATED:
        method = "clip"  # no calibration inputs for this tensor (e.g. an untied embedding)
    w.begin(f"{lin.name}.qweight")
    for r0 in range(0, lin.n, chunk):
        r1 = min(lin.n, r0 + chunk)
        rows = j.rows(r0, r1)
        if factor is not None:
            codes, sz, e, rf = gptq_int4(rows, lin.group_size, *factor)
            if deq is not None:
                deq[r0:r1] = dequantize_codes(codes, sz, lin.group_size, torch.float32)
        else:
            codes, sz, e, rf = quantize_rows(rows, lin.group_size, method)
        if lin.residual:  # error of the stored weight (both planes)
            d = dequantize_codes(codes, sz, lin.group_size, torch.float32)
            rq, rs, e, rf = quantize_residual(rows, d, lin.group_size)
            if keep is not None and not keep[r0:r1].all():  # rows without the plane: their first plane's error
                out = ~torch.from_numpy(keep[r0:r1])
                e += float(((rows[out] - d[out]) ** 2).sum(dtype=torch.float64)) - float(
                    ((rows[out] - d[out] - (rq[out].float() - 8.0) * rs[out].float().repeat_interleave(lin.group_size, 1))
                     ** 2).sum(dtype=torch.float64))
            del d
            res_all[r0 * lin.k // 2: r1 * lin.k // 2] = pack_rows(rq.numpy(), get_layout(ROWS32), lin.n)
            rs_all[r0:r1] = rs
        err += e
        ref += rf
        b = pack_rows(codes.numpy(), lay, lin.n)
        if packed is not None:
            packed[r0 * lin.k // 2: r1 * lin.k // 2] = b
        w.write(b)
        sz_all[:, r0:r1] = sz
        del rows, codes, sz
        bar.update((r1 - r0) * lin.k // 2)
    w.end()
    w.put(f"{lin.name}.scales_zeros", sz_all.view(torch.uint8).numpy())
    bar.update(sz_all.numel() * 2)
    if lin.residual:
        if keep is not None:  # the covered rows, in row order, and the map to them
            res_all = res_all.reshape(lin.n, lin.k // 2)[keep].reshape(-1)
            rs_all = rs_all[torch.from_numpy(keep)]
        w.put(f"{lin.name}.residual", res_all)
        w.put(f"{lin.name}.residual_scales", rs_all.view(torch.uint8).numpy())
        bar.update(res_all.size + rs_all.numel() * 2)
        if keep is not None:
            w.put(f"{lin.name}.residual_map", row_map(np.flatnonzero(keep), lin.n).view(np.uint8))
    if packed is not None:  # (products read the first plane only, as the runtime's)
        deq = CoreLinear(core, C.KIND_INT4, lin.n, lin.k, lin.group_size, {"qweight": packed, "scales_zeros": sz_all})
    return _rel(err, ref), deq


def write_lut4(j: Job):
    """A lut4 linear (convert/lut.py): per row block, the rows' levels and group parameters fitted
    (weighted by diag H when calibrated), then the codes by GPTQ against that grid, or the
    nearest levels without calibration."""
    w, lin, chunk, bar, core, hessian, want_deq = j.w, j.lin, j.chunk, j.bar, j.core, j.hessian, j.want_deq
    g = lin.group_size
    sz_all = torch.empty(lin.k // g, lin.n, 2, dtype=torch.bfloat16)
    lv_all = torch.empty(lin.n, 16, dtype=torch.int8)
    factor = None
    if hessian is not None:
        imp = torch.diagonal(hessian[0]).clone()  # the importance of each input (as llama.cpp's imatrix)
        factor = gptq_factor(hessian)
        chunk = max(chunk, (GPTQ_ROW_ELEMS // lin.k) // 64 * 64)
    deq = torch.empty(lin.n, lin.k) if want_deq else None  # after the factor (the peak)
    packed = np.empty(lin.n * lin.k // 2, dtype=np.uint8) if core is not None else None
    err = ref = 0.0
    w.begin(f"{lin.name}.qweight")
    for r0 in range(0, lin.n, chunk):
        r1 = min(lin.n, r0 + chunk)
        rows = j.rows(r0, r1)
        if factor is not None:
            w0 = rows.clone()
            w0[:, factor[2]] = 0.0  # dead inputs
            levels, sz, _ = fit_lut(w0, g, imp)
            del w0
            codes = gptq_rows(rows, g, sz[..., 0].float().T, sz[..., 1].float().T, *factor, tab=levels.float())
        else:
            levels, sz, codes = fit_lut(rows, g)
        d = dequantize_codes_lut(codes, sz, levels, g, torch.float32)
        if deq is not None:
            deq[r0:r1] = d
        err += float(((rows - d) ** 2).sum(dtype=torch.float64))
        ref += float((rows.to(torch.float64) ** 2).sum())
        b = pack_rows(codes.numpy(), get_layout(ROWS32), lin.n)
        if packed is not None:
            packed[r0 * lin.k // 2: r1 * lin.k // 2] = b
        w.write(b)
        sz_all[:, r0:r1] = sz
        lv_all[r0:r1] = levels
        del rows, codes, sz, d
        bar.update((r1 - r0) * lin.k // 2)
    w.end()
    w.put(f"{lin.name}.scales_zeros", sz_all.view(torch.uint8).numpy())
    w.put(f"{lin.name}.levels", lv_all.view(torch.uint8).numpy())
    bar.update(sz_all.numel() * 2 + lv_all.numel())
    if packed is not None:
        deq = CoreLinear(core, C.KIND_LUT4, lin.n, lin.k, g, {"qweight": packed, "scales_zeros": sz_all, "levels": lv_all})
    return _rel(err, ref), deq


# weight kind -> its writer (adding a kind: an entry here and in formats/kinds.py)
WRITERS = {C.KIND_INT4: write_int4, C.KIND_LUT4: write_lut4, C.KIND_INT8: write_int8, C.KIND_BF16: write_bf16}
