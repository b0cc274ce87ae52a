"""The plan of a conversion: every linear's encoding from the recipe and the options (``plan``),
then, with a bit budget, the allocation's (``spend_budget``, convert/budget.py); the artifact's
tensors in file order (``file_order``). Reads headers and shapes only, except the budget's probe."""
from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
from sparkq.formats import constants as C
from sparkq.formats.kinds import choose_group_size, linear_tensors, role_of
from sparkq.formats.layout import ROWS32
from sparkq.formats.manifest import LinearEntry
from sparkq.formats.recipe import SpecError, recipe_for_config
from sparkq.formats.spec import ModelSpec
from tqdm import tqdm

from .errors import ConvertError
from .headrows import share_rows
from .options import BODY_KINDS, HEAD_MODES, Options, default_bpw
from .quantize import CALIBRATED, METHODS
from .source import Source, read_fused_rows


def plan(source: Source, opts: Options):
    try:
        recipe = recipe_for_config(source.config, opts.recipe)
        spec = ModelSpec.from_recipe(source.config, recipe)
    except SpecError as e:
        raise ConvertError(str(e)) from None
    n_mtp = recipe.mtp_present(spec, source.shapes) if opts.mtp else 0
    if n_mtp and source.config.get("mtp_use_dedicated_embeddings"):
        raise ConvertError("config.json: mtp_use_dedicated_embeddings=true (an MTP block with its own embedding) is "
                           "not implemented; convert with --no-mtp")
    spec = replace(spec, mtp_layers=n_mtp)
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
        rows = spec.part_rows(name, len(parts))
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
        if spec.vector_dtype(name) == C.DTYPE_F32:  # a mixer's parameter: one tensor, any shape of its size
            p = srcs[name][0]
            if len(srcs[name]) != 1 or torch.Size(source.shapes[p]).numel() != torch.Size(shape).numel():
                raise ConvertError(f"source tensor {p} has shape {list(source.shapes[p])}, expected {list(shape)}")
            continue
        got = sum(source.shapes[p][0] for p in srcs[name] if len(source.shapes[p]) == 1)
        if got != shape[0] or any(len(source.shapes[p]) != 1 for p in srcs[name]):
            raise ConvertError(f"source tensor(s) {', '.join(srcs[name])} have shape(s) "
                               f"{[list(source.shapes[p]) for p in srcs[name]]}, expected {list(shape)} in all")
    return recipe, spec, linears, vectors, srcs


def file_order(linears: list[LinearEntry], vectors: dict, spec: ModelSpec):
    """(tensor name, dtype, shape) in file order: layer by layer, then globals."""
    by_name = {l.name: l for l in linears}
    order = []
    for i in range(spec.layers):
        layer_vectors = [n for n in vectors if n.startswith(f"layers.{i}.")]
        order += layer_vectors + [f"layers.{i}.{role}" for role in spec.roles(i)]
    if spec.mtp_layers:
        order += [n for n in vectors if n.startswith("mtp.")] + [n for n in spec.linear_shapes() if n.startswith("mtp.")]
    if spec.ple_dim:
        order += [C.PLE_IN_NORM, C.ROLE_PLE_MODEL, C.ROLE_PLE_EMBED]
    order += ["norm.weight"] + ([C.ROLE_EMBED] if not spec.tied else []) + [C.ROLE_LM_HEAD]
    entries = []
    for item in order:
        if item in by_name:
            l = by_name[item]
            for t, (dt, shp) in linear_tensors(l.name, l.kind, l.n, l.k, l.group_size, l.residual,
                                               l.residual_rows).items():
                entries.append((t, dt, shp))
        else:
            entries.append((item, spec.vector_dtype(item), vectors[item]))
    return entries, order


def spend_budget(source: Source, spec: ModelSpec, srcs: dict, linears: list[LinearEntry], vectors: dict, ids, opts):
    """--bpw: the importance forward (on the first calibration tokens) and the allocation (convert/budget.py)."""
    from . import budget as B

    t0 = time.perf_counter()

    def read(lin, r0, r1):
        return read_fused_rows(source, lin.sources, spec.part_rows(lin.name, len(lin.sources)), r0, r1)

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
