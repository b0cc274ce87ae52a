"""``--bpw B``: a bit budget, spent per linear where it buys the most fidelity.

Each linear has candidate encodings (lut4 and int4 at g32/64/128, int8; the head also the split
int4 + residual), each with an exact byte cost (formats/spec.py ``linear_tensors``) and an
estimated damage: the relative error of its output on calibration inputs X,
``tr(E H E^T) / tr(W H W^T)`` with ``H = X^T X`` and ``E = W - Q``, times the linear's measured
sensitivity, the KL a unit of that error costs where it sits (convert/sensitivity.py). Q is what the conversion would write: GPTQ
codes against the candidate's grid (lut4 and int4), per-row rounding (int8, the residual head),
computed on a sample of rows and, for wide inputs, on a column sample (whole 128-column blocks,
the Hessian restricted to them). GPTQ is fitted on the first half of the probe's tokens and its
error measured on the second: GPTQ lowers the errors of round-to-nearest by 1.5-4x, by a
different factor per kind and linear, and in-sample errors flatter GPTQ on wide inputs several
times over (docs/quality.md "Bit budget"). The allocation is the
greedy solution of the Lagrangian relaxation: every linear starts at its cheapest candidate on the
lower convex hull of (bytes, damage) and the upgrade with the largest damage saved per byte is
taken while the file stays within budget.

The estimates come from one forward of the unquantized model over the first ``PROBE_TOKENS``
calibration tokens (convert/calib.py), before the conversion proper, one layer alive at a time
(its products in bf16 on CPUs with native bf16: the source's weights are bf16 already), and the
sensitivities from one more over a few of them.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from sparkq.formats import constants as C
from sparkq.formats.layout import dequantize_codes, dequantize_codes_lut
from sparkq.formats.manifest import encoding_label
from sparkq.formats.kinds import linear_tensors, role_of

from .calib import gram
from .headrows import SHARES, coverage, mean_probability, share_rows
from .lut import fit_lut
from .gptq import gptq_factor, gptq_int4, gptq_rows
from .quantize import quantize_int8_rows, quantize_residual, quantize_rows

PROBE_TOKENS = 2048  # calibration tokens of the probe forward: GPTQ fits on the first half, errors on the second
SAMPLE_ROWS = 256  # rows per linear quantized to estimate each candidate's error
SAMPLE_COLS = 1024  # inputs beyond this: estimate on this many columns, in whole blocks of 256 (or 128)
ESTIMATE_ITERS = 3  # Lloyd iterations of the lut4 estimates (the conversion uses LLOYD_ITERS)


class BudgetError(ValueError):
    """The budget is below the cheapest encoding; ``least`` is that encoding's bytes."""

    def __init__(self, least: int):
        super().__init__(f"the cheapest encoding needs {least} bytes")
        self.least = least


@dataclass(frozen=True)
class Choice:
    kind: str
    group_size: int | None
    residual: bool = False
    share: float | None = None  # a partial split head: the fraction of rows with the second plane (headrows.py)

    @property
    def label(self) -> str:
        return encoding_label(self.kind, self.group_size, self.residual, self.share)


def candidates(role: str, k: int) -> list[Choice]:
    """The encodings a linear of this role and K may take (the rows32 target: lut4 is C-core only)."""
    # g256 is not offered: measured on Qwen2.5-Coder-1.5B at the default 4.55, with it the budget
    # took g256 for most gate_up and KL rose 0.029 -> 0.034 (its estimates undercount it)
    # g32 only where K is a multiple of 64: the SIMD products pair 32-column blocks (act.c), and one
    # linear they cannot pair sends the whole prefill to torch
    gs = [g for g in (32, 64, 128) if k % g == 0 and k % 64 == 0]
    out = [Choice(C.KIND_INT8, None)]
    if k % 32 == 0:
        out += [Choice(C.KIND_LUT4, g) for g in gs]
    out += [Choice(C.KIND_INT4, g) for g in gs]
    if role == C.ROLE_LM_HEAD and k % 32 == 0:  # the split head: the decode step reads only the 4-bit plane
        out += [Choice(C.KIND_INT4, g, True) for g in gs]
    return out


def choice_bytes(name: str, n: int, k: int, c: Choice) -> int:
    m = None if c.share is None else share_rows(c.share, n)
    return sum(C.DTYPE_BYTES[dt] * int(torch.Size(shp).numel())
               for dt, shp in linear_tensors(name, c.kind, n, k, c.group_size, c.residual, m).values())


def _rtn(w: torch.Tensor, imp: torch.Tensor, c: Choice) -> torch.Tensor:
    """Rows w under encoding c, each weight rounded to its nearest grid value."""
    if c.kind == C.KIND_INT8:
        q, s, _, _ = quantize_int8_rows(w)
        return q.float() * s.float()[:, None]
    if c.kind == C.KIND_LUT4:
        levels, sz, codes = fit_lut(w, c.group_size, imp, iters=ESTIMATE_ITERS)
        return dequantize_codes_lut(codes, sz, levels, c.group_size, torch.float32)
    codes, sz, _, _ = quantize_rows(w, c.group_size, "clip", fast=True)
    d = dequantize_codes(codes, sz, c.group_size, torch.float32)
    if c.residual:
        rq, rs, _, _ = quantize_residual(w, d, c.group_size)
        d = d + (rq.float() - 8.0) * rs.float().repeat_interleave(c.group_size, dim=1)
    return d


def _gptq(w: torch.Tensor, imp: torch.Tensor, c: Choice, factor) -> torch.Tensor:
    """Rows w under encoding c with GPTQ's codes (as the conversion writes lut4 and int4)."""
    if c.kind == C.KIND_LUT4:
        w0 = w.clone()
        w0[:, factor[2]] = 0.0
        levels, sz, _ = fit_lut(w0, c.group_size, imp, iters=ESTIMATE_ITERS)
        codes = gptq_rows(w, c.group_size, sz[..., 0].float().T, sz[..., 1].float().T, *factor, tab=levels.float())
        return dequantize_codes_lut(codes, sz, levels, c.group_size, torch.float32)
    codes, sz, _, _ = gptq_int4(w, c.group_size, *factor)
    return dequantize_codes(codes, sz, c.group_size, torch.float32)


def relative_error(w: torch.Tensor, imp: torch.Tensor, c: Choice, h: torch.Tensor | None = None,
                   factor=None) -> float:
    """The relative output error of rows w (float32 [R, K]) under encoding c: with a Hessian h
    (float32 [K, K]) ``tr(E h E^T) / tr(W h W^T)``, GPTQ codes when ``factor`` (gptq_factor of a
    Hessian, h's or another's) is given; without h ``sum(imp E^2) / sum(imp W^2)`` (imp: the
    importance of each input, which also weighs the lut4 fit)."""
    gptq = factor is not None and c.kind in (C.KIND_LUT4, C.KIND_INT4) and not c.residual
    d = _gptq(w, imp, c, factor) if gptq else _rtn(w, imp, c)
    e = w - d
    if h is None:
        a = imp[None, :].double()
        e, w64 = e.double(), w.double()
        num, den = float((a * e * e).sum()), float((a * w64 * w64).sum())
    else:  # fp32 products, float64 sums (float64 GEMMs were a third of the estimates' time in a py-spy profile)
        num = float(((e @ h) * e).sum(dtype=torch.float64))
        den = float(((w @ h) * w).sum(dtype=torch.float64))
    return num / den if den > 0 else 0.0


def sample_cols(k: int, cols: int = SAMPLE_COLS) -> torch.Tensor:
    """Input columns the estimates use: all of them up to ``cols``, else ``cols // b`` evenly
    spaced blocks of b = 256 columns (128 where 256 does not divide K), so every candidate group
    stays whole."""
    b = 256 if k % 256 == 0 else 128
    if k <= cols or k % b:
        return torch.arange(k)
    starts = torch.linspace(0, k // b - 1, cols // b).round().long().unique() * b
    return (starts[:, None] + torch.arange(b)[None, :]).reshape(-1)


def sample_rows(n: int, rows: int = SAMPLE_ROWS) -> torch.Tensor:
    """Evenly spaced row indices (all rows when n <= rows)."""
    if n <= rows:
        return torch.arange(n)
    return torch.linspace(0, n - 1, rows).round().long().unique()


def _hull(points: list[tuple[int, float, Choice]]) -> list[tuple[int, float, Choice]]:
    """The lower convex hull of (bytes, damage), cheapest first, damage strictly decreasing."""
    pts = sorted(points, key=lambda p: (p[0], p[1]))
    front = []
    for p in pts:  # Pareto front: more bytes must buy less damage
        if not front or p[1] < front[-1][1]:
            if front and p[0] == front[-1][0]:
                front[-1] = p
            else:
                front.append(p)
    hull: list = []
    for p in front:
        while len(hull) >= 2:
            (b1, d1, _), (b2, d2, _) = hull[-2], hull[-1]
            # drop the middle point when it lies on or above the chord from hull[-2] to p
            if (d2 - d1) * (p[0] - b1) >= (p[1] - d1) * (b2 - b1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def allocate(options: dict[str, list[tuple[int, float, Choice]]], budget_bytes: int) -> dict[str, Choice]:
    """For each linear, one of its (bytes, damage, choice) options: minimum total damage with the
    total bytes within budget (greedy on the convex hulls). Raises BudgetError when even the
    cheapest options exceed the budget."""
    hulls = {n: _hull(o) for n, o in options.items()}
    at = {n: 0 for n in hulls}
    total = sum(h[0][0] for h in hulls.values())
    if total > budget_bytes:
        raise BudgetError(total)
    heap = []

    def push(n):
        h, i = hulls[n], at[n]
        if i + 1 < len(h):
            db, dd = h[i + 1][0] - h[i][0], h[i][1] - h[i + 1][1]
            heapq.heappush(heap, (-dd / db, n, i))

    for n in hulls:
        push(n)
    while heap:
        _, n, i = heapq.heappop(heap)
        if at[n] != i:
            continue
        h = hulls[n]
        db = h[i + 1][0] - h[i][0]
        if total + db > budget_bytes:
            continue  # this step does not fit; a cheaper step of another linear may
        total += db
        at[n] = i + 1
        push(n)
    return {n: hulls[n][at[n]][2] for n in hulls}


def _partial_splits(lin, out: list, importance) -> list:
    """A head's partial splits (headrows.py): at each share of its rows, the damage of the int4
    first plane alone where the second plane is missing and of the split where it is, weighted
    by the share of the gain those rows are estimated to cover (headrows.coverage of the rows'
    mean probabilities ``importance``)."""
    by = {(c.kind, c.group_size, c.residual): d for _, d, c in out}
    extra = []
    for g in sorted({c.group_size for _, _, c in out if c.residual}):
        d0, d1 = by.get((C.KIND_INT4, g, False)), by[(C.KIND_INT4, g, True)]
        if d0 is None:
            continue
        for s in SHARES:
            m = share_rows(s, lin.n)
            if m >= lin.n:
                continue
            cov = coverage(importance, m)
            c = Choice(C.KIND_INT4, g, True, s)
            extra.append((choice_bytes(lin.name, lin.n, lin.k, c), d0 * (1 - cov) + d1 * cov, c))
    return extra


def _options(lin, w: torch.Tensor, x: torch.Tensor | None, importance=None):
    """[(bytes, damage, choice)] of one linear from its sampled rows w and calibration inputs x
    (and for a head, its rows' mean probabilities: the partial splits)."""
    role = role_of(lin.name)
    cols = sample_cols(lin.k)
    if len(cols) < lin.k:
        w = w[:, cols].contiguous()
    h = factor = None
    if x is None:
        imp = torch.ones(len(cols))
    else:  # GPTQ fitted on the first half of the tokens, its error measured on the second (held out)
        xs = x[:, cols] if len(cols) < lin.k else x
        half = max(1, xs.shape[0] // 2)
        fit = gram(xs[:half].contiguous())
        imp = torch.diagonal(fit).clone()
        factor = gptq_factor([fit])
        h = gram(xs[half:].contiguous()) if xs.shape[0] > 1 else gram(xs.contiguous())
    out = []
    for c in candidates(role, lin.k):
        if c.kind != C.KIND_INT8 and c.group_size > len(cols):
            continue
        out.append((choice_bytes(lin.name, lin.n, lin.k, c), relative_error(w, imp, c, h, factor), c))
    if importance is not None:
        out += _partial_splits(lin, out, importance)
    return out


def _forward_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight the probe's forward moves through: the source's own bf16 values, multiplied in
    bf16 (fp32 sums) on CPUs with native bf16, where that GEMM is 1.6-3.5x float32's at these
    shapes (docs/quality.md "Conversion cost"); else float32."""
    from sparkq.runtime.torchrt.layers import prefill_dtype

    return w.to(torch.bfloat16) if prefill_dtype() == torch.bfloat16 else w.float()


def probe(source, spec, srcs, linears, ids, read_rows, bar=None,
          head_importance: dict | None = None) -> tuple[dict[str, list], dict[str, float]]:
    """Each linear's candidates [(bytes, damage, choice)] and the sensitivities that scale them
    (convert/sensitivity.py), from forwards of the unquantized model over ids (None: no
    calibration; damage from the weights alone, unscaled). ``read_rows(lin, r0, r1)`` reads a
    linear's fused source rows. With calibration, the head's rows' mean
    probabilities over the tokens go into ``head_importance`` (name -> float64 [N]) and its
    candidates gain partial splits."""
    from .calib import Calibration
    from .sensitivity import sensitivities

    cal = Calibration(source, spec, srcs, ids) if ids is not None else None
    options = {}
    for lin in linears:
        if lin.kind == C.KIND_BF16 or lin.n % 16:
            continue
        rows = sample_rows(lin.n)
        w = torch.cat([read_rows(lin, int(r), int(r) + 1) for r in rows]).float() if len(rows) < lin.n \
            else read_rows(lin, 0, lin.n).float()
        x = cal.inputs(lin.name) if cal is not None and lin.name != C.ROLE_EMBED else None
        imp = None
        if x is not None and lin.name == C.ROLE_LM_HEAD and lin.k % 32 == 0:
            imp = mean_probability(x, lambda r0, r1: _forward_weight(read_rows(lin, r0, r1)), lin.n)
            if head_importance is not None:
                head_importance[lin.name] = imp
        options[lin.name] = _options(lin, w, x, imp)
        if cal is not None and role_of(lin.name) in C.FORWARD_LINEARS:
            cal.advance(lin.name, _forward_weight(read_rows(lin, 0, lin.n)))
        if bar is not None:
            bar.update(1)
    del cal
    sens = {} if ids is None else sensitivities(source, spec, srcs, linears, ids,
                                                lambda lin, r0, r1: _forward_weight(read_rows(lin, r0, r1)), bar)
    for n in options:
        k = sens.get(n, 1.0)
        options[n] = [(b, k * d, c) for b, d, c in options[n]]
    return options, sens


def spend(linears, budget_bytes: int, options: dict[str, list]) -> tuple[list, dict]:
    """Linears (LinearEntry, kinds as planned) -> the same linears with the budget's encodings,
    and a report (estimates per linear). Linears without options (bf16, the tied embedding)
    keep their planned bytes."""
    from dataclasses import replace

    fixed = sum(choice_bytes(lin.name, lin.n, lin.k, Choice(lin.kind, lin.group_size, lin.residual))
                for lin in linears if lin.name not in options)
    try:
        chosen = allocate(options, budget_bytes - fixed)
    except BudgetError as e:
        raise BudgetError(e.least + fixed) from None
    out, report = [], {}
    for lin in linears:
        c = chosen.get(lin.name)
        if c is not None:
            lin = replace(lin, kind=c.kind, group_size=c.group_size, residual=c.residual,
                          residual_rows=None if c.share is None else share_rows(c.share, lin.n))
            est = next(d for b, d, cc in options[lin.name] if cc == c)
            report[lin.name] = {"choice": c.label, "damage_estimate": est}
        out.append(lin)
    return out, report


def mix(linears) -> dict[str, dict[str, int]]:
    """role -> {encoding: count}: what ``sparkq inspect`` shows."""
    out: dict[str, dict[str, int]] = {}
    for lin in linears:
        d = out.setdefault(role_of(lin.name), {})
        d[lin.encoding] = d.get(lin.encoding, 0) + 1
    return out
