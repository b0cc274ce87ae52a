"""Builds against each other on one linear: the decode product (sq_linear_f32, one token) and the
W4A8 prompt GEMM (sq_linear_batch, M tokens), int4 and lut4, random codes, in interleaved rounds,
each build's best (a burst of load on a shared machine then slows one round of every build).

    python tools/buildbench.py --builds avx2,avx2-vnni --threads 1 --rounds 15
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builds", default="avx2,avx2-vnni", help="the first is the baseline")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--g", type=int, default=128)
    ap.add_argument("--m", type=int, default=128, help="prompt tokens")
    a = ap.parse_args(argv)
    from sparkq.runtime import core
    from sparkq.runtime.core import abi
    from sparkq.runtime.core.lib import kind_code

    libs = {b: core.load(b) for b in a.builds.split(",")}
    rng = np.random.default_rng(0)
    K, N, G = a.k, a.n, a.g
    q = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    sz = ((np.abs(rng.standard_normal((K // G, N, 2), dtype=np.float32)) * 0.01).view(np.uint32) >> 16).astype(np.uint16)
    lut = np.sort(rng.integers(-127, 128, (N, 16), dtype=np.int8), axis=1)
    xs = {M: rng.standard_normal((M, K), dtype=np.float32) for M in (1, a.m)}
    ys = {M: np.empty((M, N), dtype=np.float32) for M in (1, a.m)}
    best = {}
    for _ in range(a.rounds):
        for b, lib in libs.items():
            lib.sq_set_threads(a.threads)
            for kind in ("int4", "lut4"):
                L = abi.SqLinear(q.ctypes.data, sz.ctypes.data, None, kind_code(lib, kind), N, K, G, None, None,
                                 lut.ctypes.data if kind == "lut4" else None, None)
                for M, reps in ((1, 200), (a.m, 5)):
                    x, y = xs[M], ys[M]
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        if M == 1:
                            lib.sq_linear_f32(ctypes.byref(L), x.ctypes.data, y.ctypes.data)
                        else:
                            lib.sq_linear_batch(ctypes.byref(L), x.ctypes.data, 0, M, y.ctypes.data, None)
                    t = (time.perf_counter() - t0) / reps
                    best[b, kind, M] = min(best.get((b, kind, M), float("inf")), t)
    print(f"K={K} N={N} g{G}, {a.threads} thread(s), best of {a.rounds} interleaved rounds")
    for kind in ("int4", "lut4"):
        for M in (1, a.m):
            base = best[next(iter(libs)), kind, M]
            cells = [f"{b} {best[b, kind, M] * 1e3:.3f} ms ({2 * M * K * N / best[b, kind, M] / 1e9:.0f} GOPS, "
                     f"{base / best[b, kind, M]:.2f}x)" for b in libs]
            print(f"{kind} M={M}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
