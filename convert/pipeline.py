"""spark-convert: source checkpoint -> sparkq artifact. Orchestration only.

Plan every output tensor from the config and the source headers (no data read), write
the aligned header, then stream: one source tensor (or fused group) at a time, in row
blocks aligned to the layout's blocks, quantize -> pack -> write -> hash.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from sparkq.formats import constants as C
from sparkq.formats.manifest import LinearEntry, Manifest, sparkq_version
from sparkq.formats.layout import (LAYOUTS, ROWS32, LayoutError, check_shape, dequantize_codes, dequantize_codes_lut,
                                   get_layout, host_layout, pack_rows)
from sparkq.runtime.procmem import RssSampler
from sparkq.formats.spec import (FEATURES, ModelSpec, SpecError, choose_group_size, linear_tensors, recipe_for_config,
                                 role_of)
from sparkq.formats.tensorfile import TensorFileWriter
from tqdm import tqdm

from .errors import ConvertError
from .output import atomic_dir
from .calib import CoreLinear
from .gptq import _lib, gptq_factor, gptq_int4, gptq_rows
from .lut import fit_lut
from .quantize import CALIBRATED, METHODS, quantize_int8_rows, quantize_residual, quantize_rows
from .keyscale import ScaledSource
from .headrows import mean_probability, row_map, share_rows, top_rows
from .source import Source, open_source, read_fused_rows as _read_fused_rows

KEY_PREPASS_TOKENS = 256  # uncalibrated conversions: the key ranges' window (its activations are the pass's memory)
ROW_CHUNK_ELEMS = 256 << 10  # float32 elements per row block (1 MiB): keeps peak RSS low
HEAD_MODES = ("int4", "int8", "bf16", "split", "lut4")  # --head (split: int4 + a 4-bit residual plane)
BODY_KINDS = ("int4", "lut4")  # --kind
# SPLIT_DEFAULT: without --head, on the rows32 target (the C core's), a head/embedding the recipe
# keeps in int8 is stored split instead: the same ~8-bit precision (example, 2048 tokens of
# wikitext-2 against bf16: KL 0.1343 vs 0.1341, top-1 81.93% vs 81.59%, ppl 21.69 vs 21.77), and
# the decode step reads the 4-bit plane: 1.7B shape decode +15% (docs/quality.md "Split head"). Other
# targets (torch's int4 layouts, whose runtime gathers the refined rows slowly) keep int8.
# The budget a plain `spark-convert SRC OUT` spends (docs/quality.md "Bit budget"): 4.55 bits/weight
# from 1B parameters (Qwen2.5-Coder-1.5B: KL 0.022 vs llama.cpp IQ4_XS+imatrix's 0.035 at 4.59), 5.0
# below, where the tied head is a fifth of the weights and a bit buys more (SmolLM2-135M: KL 0.028 at
# 5.0; 0.10 at 4.65 with the earlier estimates) while the file stays small (84 MB)
DEFAULT_BPW, DEFAULT_BPW_SMALL, SMALL_PARAMS = 4.55, 5.0, 1_000_000_000


def default_bpw(params: int) -> float:
    return DEFAULT_BPW_SMALL if params < SMALL_PARAMS else DEFAULT_BPW
GPTQ_ROW_ELEMS = 4 << 20  # gptq: 16 MiB row blocks (its per-column loop runs once per block)


@dataclass
class Options:
    group_size: int | None = None  # None: the recipe's [quant] group_size
    target: str = "rows32"
    recipe: str | None = None
    method: str = "auto"  # auto: gptq when the source has a tokenizer (calibration text to read), else clip
    force: bool = False
    progress: bool = True
    head: str | None = None  # None: the recipe decides; int4 | int8 | bf16 | split for lm_head and embed
    calib: str | None = None  # calibration text for gptq; None: the bundled text (convert/data/calibration.txt)
    calib_tokens: int = 8192
    kind: str | None = None  # the body linears' 4-bit codes: int4 (uniform; None) or lut4 (a learned table per row)
    # bits per weight of the whole file, spent per linear (convert/budget.py); "auto": default_bpw()
    # unless --kind / --head / --group-size ask for one encoding everywhere (then None: uniform)
    bpw: float | str | None = None
    # powers of two moved from the keys' large channels onto the queries' (convert/keyscale.py):
    # the same q.k, flatter rows for the int8 KV cache
    key_scaling: bool = True
    # --head split only: the share of lm_head's rows that get the second plane (a partial split,
    # convert/headrows.py: the rows of the most probable tokens on the calibration text); None: all
    head_rows: float | None = None


def _target_layout(target: str) -> str:
    if target == "native":
        try:
            return host_layout()
        except LayoutError as e:
            raise ConvertError(f"{e}; pass --target rows32|avx512|avx2|default") from None
    if target not in LAYOUTS:
        raise ConvertError(f"unknown --target {target!r}; choose native, {', '.join(LAYOUTS)}")
    return target


def resolve_budget(opts: Options) -> Options:
    """"auto" stays "auto" (default_bpw of the planned model) for a plain rows32 conversion and
    becomes None (one encoding everywhere) when --kind / --head / --group-size choose one; an
    explicit --bpw is checked against them."""
    uniform = opts.kind is not None or opts.head is not None or opts.group_size is not None
    if opts.bpw == "auto":
        return replace(opts, bpw=None) if uniform or opts.target != ROWS32 else opts
    if opts.bpw is None:
        return opts
    if uniform:
        raise ConvertError("--bpw chooses each linear's encoding; drop --kind / --head / --group-size, or drop --bpw "
                           "for one encoding everywhere")
    if opts.target != ROWS32:
        raise ConvertError("--bpw mixes lut4 and split linears, which only the C core reads: use --target rows32")
    if not isinstance(opts.bpw, (int, float)) or not 2.0 <= float(opts.bpw) <= 16.0:
        raise ConvertError(f"--bpw {opts.bpw}: give bits per weight between 2 and 16 (e.g. 4.5)")
    return opts


def plan(source: Source, opts: Options):
    try:
        recipe = recipe_for_config(source.config, opts.recipe)
        spec = ModelSpec.from_recipe(source.config, recipe)
    except SpecError as e:
        raise ConvertError(str(e)) from None
    if opts.group_size is not None and opts.group_size not in C.GROUP_SIZES:
        raise ConvertError(f"--group-size {opts.group_size} is not supported; choose one of {C.GROUP_SIZES}")
    if opts.head not in (None, *HEAD_MODES):
        raise ConvertError(f"unknown --head {opts.head!r}; choose {', '.join(HEAD_MODES)}")
    if opts.kind not in (None, *BODY_KINDS):
        raise ConvertError(f"unknown --kind {opts.kind!r}; choose {', '.join(BODY_KINDS)}")
    if C.KIND_LUT4 in (opts.kind, opts.head) and opts.target != ROWS32:
        raise ConvertError("lut4 (--kind / --head) is read by the C core only: convert with --target rows32")
    if opts.method not in (*METHODS, "auto"):
        raise ConvertError(f"unknown --method {opts.method!r}; choose auto or one of {', '.join(METHODS)}")
    if opts.head_rows is not None:
        if opts.head != "split":
            raise ConvertError("--head-rows is the share of a split head's rows with the second plane: add --head split")
        if not 0.0 < opts.head_rows <= 1.0:
            raise ConvertError(f"--head-rows {opts.head_rows}: give a share of the rows in (0, 1], e.g. 0.0625")
        if opts.method not in CALIBRATED:
            raise ConvertError("--head-rows picks the rows by the tokens' probability on the calibration text: "
                               "use --method gptq (or auto with a tokenizer), or drop --head-rows")
    srcs = recipe.source_names(spec)
    for module, names in srcs.items():
        for n in names:
            if n not in source.shapes:
                raise ConvertError(f"source has no tensor {n!r} (needed for {module}); the checkpoint is incomplete "
                                   f"or not a {recipe.family} model (override with --recipe FILE)")
    linears: list[LinearEntry] = []
    shapes = spec.linear_shapes()
    for name, (n, k) in shapes.items():
        parts = srcs[name]
        rows = spec.part_rows(name)
        for p, r in zip(parts, rows):
            if tuple(source.shapes[p]) != (r, k):
                raise ConvertError(f"source tensor {p} has shape {list(source.shapes[p])}, config implies {[r, k]}; "
                                   "config.json and weights disagree")
        role = role_of(name)
        head = role in C.HEAD_ROLES and opts.head
        if role in C.HEAD_ROLES and not head and role in recipe.keep_int8 and opts.target == ROWS32:
            head = "split"  # the default head: ~int8 precision, the decode step reads 4 bits (see SPLIT_DEFAULT)
        g = None if head in ("bf16", "int8") else choose_group_size(n, k, recipe, role, opts.group_size)
        if head == "split" and g is None and not opts.head:
            head = "int8"  # no int4 group size for it (N % 16): the recipe's int8
        int8 = head == "int8" or (not head and role in recipe.keep_int8)
        split = head == "split" and g is not None  # (a head with no int4 group size stays bf16, as with int4)
        lut = (head == C.KIND_LUT4 or not head and role not in C.HEAD_ROLES and opts.kind == C.KIND_LUT4) and k % 32 == 0
        kind = C.KIND_INT8 if int8 else (C.KIND_LUT4 if lut else C.KIND_INT4) if g else C.KIND_BF16
        rrows = share_rows(opts.head_rows, n) if split and opts.head_rows is not None and name == C.ROLE_LM_HEAD else None
        linears.append(LinearEntry(name, kind, n, k, None if int8 else g, parts, residual=split,
                                   residual_rows=rrows if rrows is not None and rrows < n else None))
    vectors = spec.vector_shapes()
    for name, shape in vectors.items():
        got = sum(source.shapes[p][0] for p in srcs[name] if len(source.shapes[p]) == 1)
        if got != shape[0] or any(len(source.shapes[p]) != 1 for p in srcs[name]):
            raise ConvertError(f"source tensor(s) {', '.join(srcs[name])} have shape(s) "
                               f"{[list(source.shapes[p]) for p in srcs[name]]}, expected {list(shape)} in all")
    return recipe, spec, linears, vectors, srcs


def _ordered_entries(linears: list[LinearEntry], vectors: dict, spec: ModelSpec):
    """(tensor name, dtype, shape) in file order: layer by layer, then globals."""
    by_name = {l.name: l for l in linears}
    order = []
    for i in range(spec.layers):
        layer_vectors = [n for n in vectors if n.startswith(f"layers.{i}.")]
        order += layer_vectors + [f"layers.{i}.qkv", f"layers.{i}.o", f"layers.{i}.gate_up", f"layers.{i}.down"]
    order += ["norm.weight"] + ([C.ROLE_EMBED] if not spec.tied else []) + [C.ROLE_LM_HEAD]
    entries = []
    for item in order:
        if item in by_name:
            l = by_name[item]
            for t, (dt, shp) in linear_tensors(l.name, l.kind, l.n, l.k, l.group_size, l.residual,
                                               l.residual_rows).items():
                entries.append((t, dt, shp))
        else:
            entries.append((item, C.DTYPE_BF16, vectors[item]))
    return entries, order


def _write_linear(w: TensorFileWriter, source: Source, spec: ModelSpec, lin: LinearEntry, layout: str,
                  method: str, bar, hessian: torch.Tensor | None = None,
                  keep_deq: bool = True, importance=None) -> tuple[float, torch.Tensor | None]:
    """Quantize, pack and write one linear. With a calibration ``hessian`` (gptq) it also
    returns the weight the calibration moves on through: the packed ``CoreLinear`` (rows32 with
    the C core loaded), else the dequantized float32 [N, K]
    (``keep_deq=False`` for the head, which ends the forward: at a 152k vocabulary that buffer
    alone is 1.2 GB). A partial split (``lin.residual_rows`` < N) gives its second plane to the
    rows of the largest ``importance``, the rows' mean probabilities (convert/headrows.py)."""
    part_rows = spec.part_rows(lin.name)
    lay = get_layout(layout)
    chunk = max(lay.block_rows, (ROW_CHUNK_ELEMS // lin.k) // 64 * 64)
    err = ref = 0.0
    want_deq = hessian is not None and keep_deq
    # the calibration moves on through the packed weight in the C core where it can (rows32, the
    # core loaded), else through the dequantized float32 weight
    core = _lib() if want_deq and layout == ROWS32 and lin.kind != C.KIND_BF16 else None
    want_deq = want_deq and core is None
    # allocated once the GPTQ factor exists: the factor's K x K matrix is the peak
    deq = torch.empty(lin.n, lin.k) if want_deq and lin.kind in (C.KIND_BF16, C.KIND_INT8) else None
    if lin.kind == C.KIND_BF16:
        w.begin(f"{lin.name}.weight")
        for r0 in range(0, lin.n, chunk):
            rows = _read_fused_rows(source, lin.sources, part_rows, r0, min(lin.n, r0 + chunk))
            if deq is not None:
                deq[r0:r0 + rows.shape[0]] = rows.to(torch.bfloat16).float()
            w.write(rows.to(torch.bfloat16).view(torch.uint8).numpy())
            bar.update(rows.numel() * 2)
        w.end()
        return 0.0, deq
    if lin.kind == C.KIND_INT8:
        scales = torch.empty(lin.n, dtype=torch.bfloat16)
        packed = np.empty((lin.n, lin.k), dtype=np.int8) if core is not None else None
        w.begin(f"{lin.name}.qweight")
        for r0 in range(0, lin.n, chunk):
            r1 = min(lin.n, r0 + chunk)
            rows = _read_fused_rows(source, lin.sources, part_rows, r0, r1)
            q, s, e, rf = quantize_int8_rows(rows)
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
            deq = CoreLinear(core, C.KIND_INT8, lin.n, lin.k, packed, scales)
        return ((err / ref) ** 0.5 if ref > 0 else 0.0), deq
    check_shape(lin.n, lin.k, layout)
    if lin.kind == C.KIND_LUT4:
        return _write_lut4(w, source, lin, part_rows, chunk, hessian, bar, want_deq, core)
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
        rows = _read_fused_rows(source, lin.sources, part_rows, r0, r1)
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
        deq = CoreLinear(core, C.KIND_INT4, lin.n, lin.k, packed, sz_all, lin.group_size)
    return ((err / ref) ** 0.5 if ref > 0 else 0.0), deq


def _write_lut4(w: TensorFileWriter, source: Source, lin: LinearEntry, part_rows, chunk: int, hessian, bar,
                want_deq: bool, core=None):
    """A lut4 linear (convert/lut.py): per row block, the rows' levels and group parameters fitted
    (weighted by diag H when calibrated), then the codes by GPTQ against that grid, or the
    nearest levels without calibration."""
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
        rows = _read_fused_rows(source, lin.sources, part_rows, r0, r1)
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
        deq = CoreLinear(core, C.KIND_LUT4, lin.n, lin.k, packed, sz_all, g, lv_all)
    return ((err / ref) ** 0.5 if ref > 0 else 0.0), deq


def _spend_budget(source: Source, spec: ModelSpec, srcs: dict, linears: list[LinearEntry], vectors: dict, ids, opts):
    """--bpw: the importance forward (on the first calibration tokens) and the allocation (convert/budget.py)."""
    from . import budget as B

    t0 = time.perf_counter()

    def read(lin, r0, r1):
        return _read_fused_rows(source, lin.sources, spec.part_rows(lin.name), r0, r1)

    params = sum(l.n * l.k for l in linears) + sum(s[0] for s in vectors.values())
    if opts.bpw == "auto":
        opts = replace(opts, bpw=default_bpw(params))
    probe_ids = None if ids is None else ids[: max(1, B.PROBE_TOKENS // ids.shape[1])]
    if opts.progress:
        tqdm.write(f"spark-convert: --bpw {opts.bpw}: each linear's error under each encoding"
                   + ("" if probe_ids is None else f", on {probe_ids.numel()} calibration tokens"), file=sys.stderr)
    fixed = sum(2 * s[0] for s in vectors.values()) + 128 * (4 * len(linears) + len(vectors))  # vectors, alignment, header
    budget = int(float(opts.bpw) * params / 8) - fixed
    head_imp: dict = {}
    steps = len(linears) + (0 if probe_ids is None else sum(role_of(l.name) in C.LAYER_LINEARS for l in linears) + 1)
    with tqdm(total=steps, desc="budget", disable=not opts.progress, leave=False) as bar:
        options, sens = B.probe(source, spec, srcs, linears, probe_ids, read, bar, head_imp)
    try:
        linears, report = B.spend(linears, budget, options)
        for n, r in report.items():
            if n in sens:
                r["sensitivity"] = sens[n]
    except B.BudgetError as e:
        least = 8 * (e.least + fixed) / params
        raise ConvertError(f"--bpw {opts.bpw} is below the smallest encoding of this model "
                           f"({least:.2f} bits/weight); raise --bpw") from None
    return linears, {"bpw": float(opts.bpw), "probe_tokens": 0 if ids is None else int(probe_ids.numel()),
                     "seconds": time.perf_counter() - t0, "mix": B.mix(linears), "linears": report}, head_imp


def _carry_files(source: Source, tmp: Path) -> list[str]:
    carried = []
    for name, data in source.extra_files.items():
        (tmp / name).write_bytes(data)
        carried.append(name)
    if source.directory is not None:
        for name in C.TOKENIZER_FILES:
            p = source.directory / name
            if p.is_file() and name not in source.extra_files:
                shutil.copyfile(p, tmp / name)
                carried.append(name)
    return sorted(carried)


def _key_scaling(source: Source, spec: ModelSpec, srcs: dict, opts: Options):
    """(KeyScaling or None, a record of why not)."""
    from .calib import has_tokenizer
    from .keyscale import KeyScaling

    if not opts.key_scaling:
        return None, {"applied": False, "why": "--no-key-scaling"}
    why = KeyScaling.unsupported(spec)
    if why is None and opts.method not in CALIBRATED and not has_tokenizer(source):
        why = "the source has no tokenizer.json to read calibration text with"
    if why:
        return None, {"applied": False, "why": why}
    # the calibration's 8,192 tokens: exponents rounded to nearest; the uncalibrated pass's 256
    # see smaller maxima: rounded up (docs/long-context.md, both measured on Qwen2.5-Coder-1.5B)
    return KeyScaling(spec, srcs, round_up=opts.method not in CALIBRATED), {"applied": True}


def _key_prepass(base: Source, scaled, spec: ModelSpec, srcs: dict, scaling, opts: Options, trim_heap) -> None:
    """The key ranges of an uncalibrated conversion: one window of the calibration text through the
    (unquantized, scaled as it goes) source model, layer by layer, its weights read in row blocks."""
    from .calib import Calibration, RowBlocks, calibration_ids

    ids, _ = calibration_ids(base, opts.calib, KEY_PREPASS_TOKENS, seq_len=KEY_PREPASS_TOKENS)
    cal = Calibration(scaled, spec, srcs, ids[:1])
    shapes = spec.linear_shapes()
    for i in tqdm(range(spec.layers), desc="key ranges", disable=not opts.progress, leave=False):
        scaling.measure(base, cal, i)
        for role in C.LAYER_LINEARS:
            name = f"layers.{i}.{role}"
            if role in (C.ROLE_QKV, C.ROLE_GATE_UP):
                cal.inputs(name)
            n, k = shapes[name]
            rows = lambda r0, r1, name=name: _read_fused_rows(scaled, srcs[name], spec.part_rows(name), r0, r1).float()  # noqa: E731
            cal.advance(name, RowBlocks(rows, n, k, max(64, (ROW_CHUNK_ELEMS // k) // 64 * 64)))
            trim_heap()


def _key_record(info: dict, scaling) -> dict:
    """The manifest's record: whether the keys were scaled, and each layer's exponents."""
    if scaling is None:
        return {"applied": False, "why": info["why"]}
    return {"applied": True, "exponents": {str(i): e.tolist() for i, e in sorted(scaling.layers.items())}}


def resolve_method(opts: Options, source) -> Options:
    """auto: gptq (calibrated on --calib or the bundled text) when the source's tokenizer can
    read calibration text, else the calibration-free clip search."""
    if opts.method != "auto":
        return opts
    from .calib import has_tokenizer

    return replace(opts, method="gptq" if opts.calib or has_tokenizer(source) else "clip")


def _heap_trimmer():
    """A function returning the heap's free pages to the system (glibc ``malloc_trim``; a no-op
    elsewhere), called after each linear: the conversion's 16-32 MiB transients land on the heap
    once glibc's mmap threshold has risen, and its free chunks kept the peak RSS creeping up layer
    by layer (1.53 -> 1.78 GB at the same step of a 1.5B model). A fixed mmap threshold instead
    cost a page fault per 4 KiB of every transient (that run reached layer 13 of 28 at 7:00, where
    the trimmed one passed layer 18 at 5:40; stopped, not timed to the end)."""
    import ctypes
    import ctypes.util

    if sys.platform == "linux":
        try:
            trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            return lambda: trim(0)
        except (OSError, AttributeError):
            pass
    return lambda: None


def convert(src: str, out: str, opts: Options) -> dict:
    t0 = time.perf_counter()
    trim_heap = _heap_trimmer()
    with RssSampler() as mem:
        source = base = open_source(src)
        try:
            opts = resolve_budget(resolve_method(opts, source))
            layout = _target_layout(opts.target)
            recipe, spec, linears, vectors, srcs = plan(source, opts)
            ids = cal_info = budget_info = None
            head_imp: dict = {}  # the head's rows' mean probabilities (a partial split's rows), from the probe
            if opts.method in CALIBRATED:
                from .calib import calibration_ids

                if opts.calib_tokens < 1:
                    raise ConvertError("--calib-tokens must be >= 1")
                ids, cal_info = calibration_ids(source, opts.calib, opts.calib_tokens)
            if opts.bpw is not None:
                linears, budget_info, head_imp = _spend_budget(source, spec, srcs, linears, vectors, ids, opts)
            for lin in linears:
                if lin.kind == C.KIND_INT4:
                    try:
                        check_shape(lin.n, lin.k, layout)
                    except LayoutError as e:
                        raise ConvertError(f"{lin.name}: {e}") from None
            entries, order = _ordered_entries(linears, vectors, spec)
            by_name = {l.name: l for l in linears}
            meta = {"format": C.FORMAT_NAME, "format_version": str(C.FORMAT_VERSION), "layout": layout}
            total = sum(C.DTYPE_BYTES[d] * int(torch.Size(s).numel()) for _, d, s in entries)
            src_bytes = sum(source.nbytes(p) for names in srcs.values() for p in names)
            errors: dict[str, float] = {}
            cal, cal_s = None, 0.0
            scaling, key_info = _key_scaling(base, spec, srcs, opts)
            if scaling is not None:
                source = ScaledSource(base, scaling)  # every read from here on: q/k rows, biases, norms scaled
            if opts.method in CALIBRATED:
                from .calib import Calibration

                if opts.progress:
                    tqdm.write(f"spark-convert: {opts.method}, calibrated on {cal_info['tokens']} tokens of {cal_info['file']} "
                               "(--method clip: no calibration; --method minmax: fastest)", file=sys.stderr)
                tc = time.perf_counter()
                cal = Calibration(source, spec, srcs, ids)
                cal_s += time.perf_counter() - tc
            elif scaling is not None:  # no calibration forward: a short one of the source model measures the keys
                tk = time.perf_counter()
                _key_prepass(base, source, spec, srcs, scaling, opts, trim_heap)
                key_info["seconds"] = time.perf_counter() - tk
            layer_seen = -1
            with atomic_dir(out, opts.force) as tmp:
                w = TensorFileWriter(str(tmp / C.WEIGHTS_FILE), entries, meta)
                with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not opts.progress,
                          leave=False) as bar:
                    for item in order:
                        bar.set_postfix_str(item, refresh=False)
                        if cal is not None and scaling is not None and item.startswith("layers."):
                            i = int(item.split(".")[1])
                            if i != layer_seen:  # before the layer's first tensor (its norms and biases come first)
                                tc = time.perf_counter()
                                scaling.measure(base, cal, i)
                                cal_s += time.perf_counter() - tc
                                layer_seen = i
                        if item in by_name:
                            calibrated = cal is not None and item != C.ROLE_EMBED
                            tc = time.perf_counter()
                            # emptied by gptq_factor, which frees H early and recomputes it if H needs more damping
                            hbox = [cal.hessian(item), lambda item=item: cal.hessian(item)] if calibrated else None
                            cal_s += time.perf_counter() - tc
                            try:
                                lin = by_name[item]
                                if lin.residual_rows is not None and item not in head_imp and calibrated:
                                    # --head-rows without the budget's probe: the rows' probabilities
                                    # on the calibration tokens (the head's inputs are here)
                                    tc = time.perf_counter()
                                    head_imp[item] = mean_probability(cal.inputs(item), lambda r0, r1, lin=lin: (
                                        _read_fused_rows(source, lin.sources, spec.part_rows(item), r0, r1).float()),
                                        lin.n)
                                    cal_s += time.perf_counter() - tc
                                errors[item], deq = _write_linear(w, source, spec, lin, layout, opts.method,
                                                                  bar, hbox, keep_deq=role_of(item) != C.ROLE_LM_HEAD,
                                                                  importance=head_imp.get(item))
                            except LayoutError as e:
                                raise ConvertError(f"{item}: {e}") from None
                            if calibrated:
                                tc = time.perf_counter()
                                cal.advance(item, deq)  # None for the head: the forward ends there
                                cal_s += time.perf_counter() - tc
                            del hbox, deq
                            trim_heap()
                        else:
                            parts = [source.read_rows(p, 0, source.shapes[p][0]) for p in srcs[item]]
                            v = torch.cat(parts).to(torch.bfloat16)
                            w.put(item, v.view(torch.uint8).numpy())
                            bar.update(v.numel() * 2)
                w.close()
                for l in linears:
                    l.rel_error = errors[l.name]
                tensor_meta = {}
                for n, d in w.digests.items():
                    owner, _, part = n.rpartition(".")
                    if owner in by_name:
                        tensor_meta[n] = {"sha256": d, "role": f"{role_of(owner)}.{part}", "linear": owner}
                    else:
                        tensor_meta[n] = {"sha256": d, "role": part if part == "bias" else "norm", "sources": srcs[n]}
                manifest = Manifest(layout, recipe.family, opts.method, spec.tied, by_name, tensor_meta,
                                    features={k: recipe.feature(k) for k in FEATURES},
                                    recipe=Path(opts.recipe).name if opts.recipe else recipe.family,
                                    group_size_requested=opts.group_size or recipe.group_size, calibration=cal_info or None,
                                    source=source.origin, converter={"name": "sparkq", "version": sparkq_version()},
                                    key_scaling=_key_record(key_info, scaling))
                config = dict(source.config)
                config["quantization_config"] = manifest.quantization_config()
                (tmp / C.MANIFEST_FILE).write_text(manifest.dumps())
                (tmp / C.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
                carried = _carry_files(source, tmp)
                art_bytes = (tmp / C.WEIGHTS_FILE).stat().st_size
        finally:
            base.close()
    if scaling is not None:
        key_info.update(scaling.summary())
    elapsed = time.perf_counter() - t0
    groups: dict[str, list[str]] = {}
    for l in linears:
        groups.setdefault((f"g{l.group_size}" + ("+residual" if l.residual else "") + ("/lut4" if l.kind == C.KIND_LUT4 else ""))
                          if l.group_size else l.kind,
                          []).append(l.name)
    params = sum(l.n * l.k for l in linears) + sum(s[0] for s in vectors.values())
    largest = max(source.nbytes(p) for names in srcs.values() for p in names)
    by_role: dict[str, list[float]] = {}
    for n, e in errors.items():
        if by_name[n].kind != C.KIND_BF16:
            by_role.setdefault(role_of(n), []).append(e)
    return {
        "source": source.origin,
        "output": str(Path(out).absolute()),
        "family": recipe.family,
        "layout": layout,
        "method": opts.method,
        "calibration": cal_info and {**cal_info, "forward_seconds": cal_s},
        "budget": budget_info,
        "key_scaling": key_info,
        "tensors": len(entries),
        "source_bytes": src_bytes,
        "artifact_bytes": art_bytes,
        "bits_per_weight": 8 * art_bytes / params,
        "parameters": params,
        "tied_embeddings": spec.tied,
        "group_sizes": {g: len(v) for g, v in groups.items()},
        "group_size_by_role": {role_of(l.name): (l.group_size or l.kind) for l in linears},
        "rel_error_by_role": {r: {"mean": sum(v) / len(v), "max": max(v)} for r, v in by_role.items()},
        "carried_files": carried,
        "seconds": elapsed,
        "peak_rss_mib": mem.peak_kib / 1024,
        "start_rss_mib": mem.start_kib / 1024,
        "peak_rss_anon_mib": mem.peak_anon_kib / 1024,
        "start_rss_anon_mib": mem.start_anon_kib / 1024,
        "largest_source_tensor_mib": largest / 2**20,
    }


def import_gguf(src: str, out: str, force: bool = False, progress: bool = True) -> dict:
    """Write the standard bf16 HF checkpoint equivalent to a GGUF file."""
    from .gguf_source import GGUFSource

    p = Path(src)
    if not p.is_file():
        raise ConvertError(f"{src}: no such GGUF file")
    t0 = time.perf_counter()
    source = GGUFSource(p)
    names = sorted(source.shapes)
    entries = [(n, C.DTYPE_BF16, source.shapes[n]) for n in names]
    with atomic_dir(out, force) as tmp:
        w = TensorFileWriter(str(tmp / "model.safetensors"), entries, {"format": "pt"})
        for n in tqdm(names, desc="import-gguf", disable=not progress, leave=False):
            rows = source.shapes[n][0]
            w.put(n, source.read_rows(n, 0, rows).to(torch.bfloat16).contiguous().view(torch.uint8).numpy())
            source._cache = None
        w.close()
        (tmp / C.CONFIG_FILE).write_text(json.dumps(source.config, indent=2, sort_keys=True))
        carried = _carry_files(source, tmp)
        if source.origin.get("license"):  # keep the license with the weights (read back by spark-convert)
            (tmp / "README.md").write_text(f"---\nlicense: {source.origin['license']}\n---\n\n"
                                           f"bf16 checkpoint imported by `sparkq import-gguf` from {source.origin['id']}.\n")
            carried.append("README.md")
        size = (tmp / "model.safetensors").stat().st_size
    return {"source": source.origin, "output": str(Path(out).absolute()), "tensors": len(names),
            "bytes": size, "files": ["config.json", "model.safetensors", *carried],
            "seconds": time.perf_counter() - t0}
