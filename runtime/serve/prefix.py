"""The prefix cache's two operations (engine.py): how much of a prompt a slot's kept prompt-path
positions already hold, and copying such positions from one slot to another."""
from __future__ import annotations

import numpy as np


def shared_prefix(have: list[int], n: int, ids: list[int], grid: int) -> int:
    """Prompt tokens of ids among the first n of have (a slot's prompt, n of its positions written
    by the prompt path), cut to whole slices of grid tokens; never the last one of ids (its logits
    start the answer)."""
    n = min(n, len(ids) - 1)
    if n <= 0:
        return 0
    diff = np.flatnonzero(np.asarray(have[:n]) != np.asarray(ids[:n]))
    n = int(diff[0]) if diff.size else n
    return n // grid * grid


def copy_positions(model, src: int, dst: int, a: int, b: int) -> None:
    """positions a..b-1 of KV slot src into slot dst, in every layer (K, V and an int8 cache's
    scales: LiteModel's [layers, slots, kv_heads, cap(, head_dim)] arrays)"""
    for arr in (model.k, model.v, model.k_scale, model.v_scale):
        if arr is not None:
            arr[:, dst, :, a:b] = arr[:, src, :, a:b]
