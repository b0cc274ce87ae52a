"""What a unit of relative output error costs at each linear, in KL: the bit budget's damage scale.

The budget (convert/budget.py) estimates each candidate encoding's relative output error
``tr(E H E^T) / tr(W H W^T)``. What that error costs depends on where the linear sits and what
it feeds: an error in an early layer runs through every later one. The first scale was the share
of the residual stream each linear writes (its gain); measured on Qwen2.5-Coder-1.5B by restoring
groups of a converted model's linears to bf16, the KL each group cost was 2-24x its gain-weighted
estimate, the first layers' and qkv's most, the head's least (docs/quality.md "Sensitivity").

So the probe measures the scale on the source model: a linear's weight is replaced by its int4
round-to-nearest (a 4-bit error's structure: per-group scales, not isotropic noise), the rest of
the model runs on, and the mean KL of the next-token distribution against the clean run over its
relative output error there is that linear's sensitivity. Every role of ``LAYERS`` sampled layers
(the first and the last among them) is measured, each in its own sequence of one forward whose
batch grows (``sensitivities``); the layers between take the linear interpolation of their role's
values. The head and an untied embedding are measured too. Against that restore measurement the
measured-over-estimated ratios went from 2.2-24 to 0.27-0.49 (rounding's errors cost ~3x GPTQ's
per unit, alike for every linear GPTQ converts).
"""
from __future__ import annotations

import numpy as np
import torch
from sparkq.formats import constants as C
from sparkq.formats.kinds import role_of

TOKENS = 128  # calibration tokens of the forward (the first window's); 256 moved the values ~10%, about their noise
LAYERS = 8  # layers sampled per role, the first and last among them; the rest interpolated
HEAD_BLOCK = 4096  # head rows per product ([S*t, HEAD_BLOCK] float32 transients)


def sampled_layers(layers: int) -> list[int]:
    return sorted({int(round(v)) for v in np.linspace(0, layers - 1, min(layers, LAYERS))})


def rtn_error(w: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """W - its int4 round-to-nearest (min/max per group of 128, 64 or 32 columns), float32; a
    block of rows at a time (the transients stay small)."""
    n, k = w.shape
    g = next((g for g in (128, 64, 32) if k % g == 0), k)
    out = torch.empty(n, k)
    for r0 in range(0, n, rows):
        wf = w[r0:r0 + rows].float().view(-1, k // g, g)
        lo, hi = wf.amin(-1, keepdim=True), wf.amax(-1, keepdim=True)
        s = ((hi - lo) / 15).clamp_min(1e-12)
        out[r0:r0 + rows] = (wf - ((wf - lo) / s).round_().clamp_(0, 15).mul_(s).add_(lo)).view(-1, k)
    return out


def _kls(x: torch.Tensor, t: int, spec, head_rows, n: int, head_seq: int) -> tuple[list[float], float]:
    """Mean KL of each sequence's next-token distribution against sequence 0's (x: final-normed
    states [S*t, K], float32), where sequence ``head_seq`` multiplies the head's int4
    round-to-nearest instead of its weight; and the relative output error that made. Two passes
    over the head's rows, the log-sum-exps, then sum_v p0 (l0 - l): no [S*t, N] buffer."""
    s = x.shape[0] // t
    lse = torch.full((s * t,), -float("inf"), dtype=torch.float64)
    acc = torch.zeros(t, s, dtype=torch.float64)
    h = slice(head_seq * t, (head_seq + 1) * t)
    errs = []  # the rounded head's share of each block's products, kept from the first pass
    num = den = 0.0
    for second in (False, True):
        for b, r0 in enumerate(range(0, n, HEAD_BLOCK)):
            w = head_rows(r0, min(n, r0 + HEAD_BLOCK))
            y = (x.to(w.dtype) @ w.T).float()
            if not second:
                errs.append(x[h] @ rtn_error(w).T)
                num += float(errs[b].pow(2).sum(dtype=torch.float64))
                den += float(y[h].pow(2).sum(dtype=torch.float64))
            y[h] -= errs[b]
            if spec.final_softcap:
                y = torch.tanh(y / spec.final_softcap) * spec.final_softcap
            if not second:
                lse = torch.logaddexp(lse, torch.logsumexp(y, dim=1).double())
                continue
            p0 = (y[:t] - lse[:t, None].float()).exp()  # [t, B]
            for j in range(1, s):  # sum_v p0 (l0 - l_j), the difference taken first (float32 sums of it)
                acc[:, j] += (p0 * (y[:t] - y[j * t:(j + 1) * t])).sum(1, dtype=torch.float64)
    kl = (acc.T.reshape(-1) - lse[:t].repeat(s) + lse).view(s, t).mean(1)
    return kl.tolist(), (num / den if den > 0 else 0.0)


PROXY = {C.ROLE_SSM_IN: C.ROLE_QKV, C.ROLE_SSM_OUT: C.ROLE_O}  # roles not probed -> the probed role taken for them


def sensitivities(source, spec, srcs, linears, ids: torch.Tensor, weight, bar=None) -> dict[str, float]:
    """name -> KL per unit of relative output error for every linear in ``linears`` (LinearEntry,
    file order; the tied head's value adds the embedding's). ``weight(lin, r0, r1)`` gives a
    linear's rows as the probe's forward multiplies them; ``ids``: calibration windows [S, T],
    of which the first TOKENS tokens are used; ``bar`` advances once per layer linear and at the end.

    One forward over a batch that grows: sequence 0 is the clean model, the embedding's sequence
    starts from its rounded rows, and at each sampled layer four copies of the clean stream join,
    each with one of the layer's linears rounded; at the head one more copy of the clean states
    multiplies the rounded head. Every weight is read once (the head twice)."""
    from .calib import Calibration

    ids = ids.reshape(-1)[:TOKENS].view(1, -1)
    t = ids.shape[1]
    layer_lins = [l for l in linears if role_of(l.name) in C.FORWARD_LINEARS]
    head = next(l for l in linears if l.name == C.ROLE_LM_HEAD)
    embed = next((l for l in linears if l.name == C.ROLE_EMBED), head if spec.tied else None)
    picks = sampled_layers(spec.layers)
    cal = Calibration(source, spec, srcs, ids)
    seq_of: dict[str, int] = {}
    rel: dict[str, float] = {}
    if embed is not None:  # the embedding's rows of these tokens, rounded
        uniq, inv = ids.reshape(-1).unique(return_inverse=True)
        rows = torch.cat([weight(embed, int(r), int(r) + 1) for r in uniq]).float()[inv]
        e = rtn_error(rows) * (cal.x.norm() / rows.norm())  # in the stream's units (embed_scale)
        rel[C.ROLE_EMBED] = float(e.pow(2).sum(dtype=torch.float64) / cal.x.pow(2).sum(dtype=torch.float64))
        seq_of[C.ROLE_EMBED] = cal.extend(cal.x - e)
    for lin in layer_lins:
        i, role = int(lin.name.split(".")[1]), role_of(lin.name)
        if role == C.ROLE_QKV and i in picks:  # four copies of the clean stream join
            first = cal.extend(cal.x[:t].repeat(len(C.LAYER_LINEARS), 1))
            for j, r in enumerate(C.LAYER_LINEARS):
                seq_of[f"layers.{i}.{r}"] = first + j
        cal.inputs(lin.name)
        w = weight(lin, 0, lin.n)
        if lin.name in seq_of:
            cal.set_error(lin.name, seq_of[lin.name], rtn_error(w))
        cal.advance(lin.name, w)
        if bar is not None:
            bar.update(1)
    rel.update(cal.rel_error)
    seq_of[C.ROLE_LM_HEAD] = cal.seqs
    x = cal.final_states()
    del cal
    kls, rel[C.ROLE_LM_HEAD] = _kls(torch.cat([x, x[:t]]), t, spec, lambda r0, r1: weight(head, r0, r1), head.n,
                                    seq_of[C.ROLE_LM_HEAD])
    if bar is not None:
        bar.update(1)
    sens = {n: (kls[j] / rel[n] if rel.get(n, 0.0) > 0 else 0.0) for n, j in seq_of.items()}
    out = {n: sens[n] for n in (C.ROLE_LM_HEAD, C.ROLE_EMBED) if n in sens}
    for lin in layer_lins:
        role = PROXY.get(role_of(lin.name), role_of(lin.name))  # (a parallel branch's: as the attention's)
        out[lin.name] = float(np.interp(int(lin.name.split(".")[1]), picks, [sens[f"layers.{i}.{role}"] for i in picks]))
    if spec.tied and C.ROLE_EMBED in out:  # one matrix: its errors cost at the head and at the embedding
        out[C.ROLE_LM_HEAD] += out.pop(C.ROLE_EMBED)
    return out
