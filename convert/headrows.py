"""Which rows of a split head get the second plane (a *partial* split, formats/constants.py).

A head row is one token's logit; a logit's error costs KL in proportion to that token's
probability (KL(p || q) ~ 1/2 Var_p(delta) for small logit errors delta), and a few thousand
tokens carry nearly all of it: on Qwen2.5-Coder-1.5B the top 1% of 151,936 rows by mean
probability hold 86% of the mass on the bundled calibration text, the top 6.25% 97.8%. So the
residual plane goes to the rows of the largest mean next-token probability under the source
model itself, over the budget probe's calibration tokens; the rest keep the int4 first plane.

The budget (convert/budget.py) prices a partial split at ``share`` of the rows by the share of
``p ** COVERAGE_EXP`` its rows cover, p the rows' mean probability over the probe's tokens:
the probability mass itself (exponent 1) over-counts what the plane buys on other text (on the
example, the top 5 / 10 / 20% of rows hold 87 / 93 / 97% of the calibration text's mass, but
gave 50 / 57 / 70% of the full split's KL gain on held-out text); the exponent is fitted to those
three gains on a validation slice of wikitext-2 (chars 200k-300k, disjoint from the fidelity
text, as GPTQ_DAMP was chosen): docs/quality.md "Partial split head".
"""
from __future__ import annotations

import numpy as np
import torch

SHARES = (1 / 32, 1 / 16, 1 / 8, 1 / 4)  # the fractions of a head's rows the budget may give the second plane
COVERAGE_EXP = 0.6  # least squares over 0.5 / 0.55 / 0.6 / 0.65 (0.0229 / 0.0059 / 0.0051 / 0.0198)
LOGIT_BYTES = 64 << 20  # float32 logits per row block (tokens x rows)


def share_rows(share: float, n: int) -> int:
    """Rows a partial split at ``share`` covers (at least one, at most n)."""
    return int(min(n, max(1, round(share * n))))


def mean_probability(x: torch.Tensor, rows, n: int) -> np.ndarray:
    """Each head row's mean next-token probability (float64 [N]) over the positions x (final-normed
    hidden states [T, K]). ``rows(r0, r1)`` gives head rows [r0, r1) (bf16 or float32: x is
    multiplied in that dtype, fp32 sums). Two passes over the rows in blocks: each position's
    log-sum-exp, then the probabilities; no [T, N] buffer."""
    t = x.shape[0]
    block = max(256, LOGIT_BYTES // (4 * t))
    lse = torch.full((t,), -float("inf"), dtype=torch.float64)
    for r0 in range(0, n, block):
        w = rows(r0, min(n, r0 + block))
        lg = (x.to(w.dtype) @ w.T).float()
        lse = torch.logaddexp(lse, torch.logsumexp(lg, dim=1).double())
        del lg
    lse32 = lse.float()[:, None]
    out = np.zeros(n)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        w = rows(r0, r1)
        p = (x.to(w.dtype) @ w.T).float().sub_(lse32).exp_()  # in place: one [T, block] buffer
        out[r0:r1] = p.sum(0, dtype=torch.float64).numpy() / t
        del p
    return out


def top_rows(importance: np.ndarray, m: int) -> np.ndarray:
    """The m rows of the largest importance (ties: the lower row), ascending."""
    order = np.lexsort((np.arange(len(importance)), -importance))
    return np.sort(order[:m])


def coverage(importance: np.ndarray, m: int) -> float:
    """What the second plane on the m most probable rows is estimated to buy, as a share of the
    full split's gain: their share of ``importance ** COVERAGE_EXP``."""
    q = np.power(np.clip(importance, 0.0, None), COVERAGE_EXP)
    total = float(q.sum())
    return float(q[top_rows(importance, m)].sum()) / total if total > 0 else 0.0


def row_map(rows: np.ndarray, n: int) -> np.ndarray:
    """The residual_map tensor (int32 [N]) of a partial split over ``rows`` (ascending)."""
    mp = np.full(n, -1, dtype=np.int32)
    mp[rows] = np.arange(len(rows), dtype=np.int32)
    return mp
