"""spark-convert: source checkpoint -> sparkq artifact. The driver only.

Resolve the options (options.py), plan every output tensor from the config and the source
headers (plan.py; with a bit budget, the allocation), write the aligned header, then stream in
file order: one linear at a time through its kind's writer (writers.py), in row blocks aligned to
the layout's blocks (quantize -> pack -> write -> hash), with GPTQ's calibration (calib.py) moving
forward in step; then the manifest and the summary (report.py), renamed into place on success.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from sparkq.formats import constants as C
from sparkq.formats.kinds import role_of
from sparkq.formats.layout import LayoutError, check_shape
from sparkq.formats.manifest import Manifest, sparkq_version
from sparkq.formats.recipe import FEATURES
from sparkq.formats.tensorfile import TensorFileWriter
from sparkq.runtime.procmem import RssSampler
from tqdm import tqdm

from . import report
from .errors import ConvertError
from .gguf_source import import_gguf  # noqa: F401  (sparkq import-gguf)
from .headrows import mean_probability
from .keyscale import ScaledSource, key_prepass, key_record, key_scaling
from .options import Options, resolve_budget, resolve_method, target_layout
from .output import atomic_dir, carry_files, heap_trimmer
from .plan import file_order, plan, spend_budget
from .quantize import CALIBRATED
from .source import open_source, read_fused_rows
from .writers import write_linear

__all__ = ["Options", "convert", "import_gguf", "plan"]


class Timer:
    """Seconds spent inside ``with timer:`` blocks, summed."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def __call__(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t


def convert(src: str, out: str, opts: Options) -> dict:
    t0 = time.perf_counter()
    trim_heap = heap_trimmer()
    with RssSampler() as mem:
        source = base = open_source(src)
        try:
            opts = resolve_budget(resolve_method(opts, source))
            layout = target_layout(opts.target)
            recipe, spec, linears, vectors, srcs = plan(source, opts)
            ids = cal_info = budget_info = None
            head_imp: dict = {}  # the head's rows' mean probabilities (a partial split's rows), from the probe
            if opts.method in CALIBRATED:
                from .calib import calibration_ids

                if opts.calib_tokens < 1:
                    raise ConvertError("--calib-tokens must be >= 1")
                ids, cal_info = calibration_ids(source, opts.calib, opts.calib_tokens)
            if opts.bpw is not None:
                # outside the budget: the MTP block's linears (int4: the probe's forward does not reach
                # them) and the per-layer input table (the recipe's int8 rows: read a row per token,
                # its scales a row's own, where int4's [K/g, N, 2] scales put a row on K/g pages)
                mtp = [lin for lin in linears if lin.name.startswith("mtp.") or lin.name == C.ROLE_PLE_EMBED]
                linears, budget_info, head_imp = spend_budget(source, spec, srcs, [lin for lin in linears if lin not in mtp],
                                                              vectors, ids, opts)
                linears += mtp
            for lin in linears:
                if lin.kind == C.KIND_INT4:
                    try:
                        check_shape(lin.n, lin.k, layout)
                    except LayoutError as e:
                        raise ConvertError(f"{lin.name}: {e}") from None
            entries, order = file_order(linears, vectors, spec)
            by_name = {lin.name: lin for lin in linears}
            meta = {"format": C.FORMAT_NAME, "format_version": str(C.FORMAT_VERSION), "layout": layout}
            total = sum(C.DTYPE_BYTES[d] * int(torch.Size(s).numel()) for _, d, s in entries)
            errors: dict[str, float] = {}
            cal, cal_time = None, Timer()
            scaling, key_info = key_scaling(base, spec, srcs, opts)
            if scaling is not None:
                source = ScaledSource(base, scaling)  # every read from here on: q/k rows, biases, norms scaled
            if opts.method in CALIBRATED:
                from .calib import Calibration

                if opts.progress:
                    tqdm.write(f"spark-convert: {opts.method}, calibrated on {cal_info['tokens']} tokens of {cal_info['file']} "
                               "(--method clip: no calibration; --method minmax: fastest)", file=sys.stderr)
                with cal_time():
                    cal = Calibration(source, spec, srcs, ids)
            elif scaling is not None:  # no calibration forward: a short one of the source model measures the keys
                key_time = Timer()
                with key_time():
                    key_prepass(base, source, spec, srcs, scaling, opts, trim_heap)
                key_info["seconds"] = key_time.seconds
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
                                with cal_time():
                                    scaling.measure(base, cal, i)
                                layer_seen = i
                        if item not in by_name:  # a norm or bias (bf16), or a mixer's parameter (fp32, as read)
                            parts = [source.read_rows(p, 0, source.shapes[p][0]) for p in srcs[item]]
                            f32 = spec.vector_dtype(item) == C.DTYPE_F32
                            v = torch.cat(parts).reshape(vectors[item]).to(torch.float32 if f32 else torch.bfloat16)
                            w.put(item, v.contiguous().view(torch.uint8).numpy())
                            bar.update(v.numel() * v.element_size())
                            continue
                        # (the calibration forward applies the output gate from its bf16 source rows itself)
                        lin = by_name[item]
                        calibrated = (cal is not None and item != C.ROLE_EMBED and role_of(item) not in (C.ROLE_GATE, C.ROLE_SSM_GATE)
                                      and not item.startswith("mtp."))  # (the MTP block: outside the forward)
                        with cal_time():
                            # emptied by gptq_factor, which frees H early and recomputes it if H needs more damping
                            hbox = [cal.hessian(item), lambda item=item: cal.hessian(item)] if calibrated else None
                            if lin.residual_rows is not None and item not in head_imp and calibrated:
                                # --head-rows without the budget's probe: the rows' probabilities on the
                                # calibration tokens (the head's inputs are here)
                                head_imp[item] = mean_probability(cal.inputs(item), lambda r0, r1, lin=lin: (
                                    read_fused_rows(source, lin.sources, spec.part_rows(item, len(lin.sources)), r0, r1).float()), lin.n)
                        try:
                            errors[item], deq = write_linear(w, source, spec, lin, layout, opts.method, bar, hbox,
                                                             keep_deq=role_of(item) != C.ROLE_LM_HEAD,
                                                             importance=head_imp.get(item))
                        except LayoutError as e:
                            raise ConvertError(f"{item}: {e}") from None
                        if calibrated:
                            with cal_time():
                                cal.advance(item, deq)  # None for the head: the forward ends there
                        del hbox, deq
                        trim_heap()
                w.close()
                for lin in linears:
                    lin.rel_error = errors[lin.name]
                manifest = Manifest(layout, recipe.family, opts.method, spec.tied, by_name,
                                    report.tensor_meta(w.digests, by_name, srcs),
                                    features={**{k: recipe.feature(k) for k in FEATURES}, "mtp_layers": spec.mtp_layers},
                                    recipe=Path(opts.recipe).name if opts.recipe else recipe.family,
                                    group_size_requested=opts.group_size or recipe.group_size, calibration=cal_info or None,
                                    source=source.origin, converter={"name": "sparkq", "version": sparkq_version()},
                                    key_scaling=key_record(key_info, scaling))
                config = recipe.with_defaults(source.config)  # the artifact describes itself: the family's defaults written out
                config["quantization_config"] = manifest.quantization_config()
                (tmp / C.MANIFEST_FILE).write_text(manifest.dumps())
                (tmp / C.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
                carried = carry_files(source, tmp)
                art_bytes = (tmp / C.WEIGHTS_FILE).stat().st_size
        finally:
            base.close()
    if scaling is not None:
        key_info.update(scaling.summary())
    return report.summary(source=source, out=out, recipe=recipe, layout=layout, opts=opts, cal_info=cal_info,
                          cal_seconds=cal_time.seconds, budget_info=budget_info, key_info=key_info, entries=entries,
                          srcs=srcs, linears=linears, vectors=vectors, errors=errors, spec=spec, carried=carried,
                          art_bytes=art_bytes, seconds=time.perf_counter() - t0, mem=mem)
