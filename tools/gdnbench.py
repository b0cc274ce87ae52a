"""The Gated DeltaNet mixer's own time (csrc/gdn.c ``sq_mix``: conv, delta-rule state, gated
norm; the products around it excluded) per layer, for one decode token and for a prompt chunk, at a
model shape's DeltaNet geometry, on each build (docs/performance.md "Hybrid models").

``python tools/gdnbench.py [--shape qwen3.5-2b] [--builds amx,avx2,scalar] [--threads 2] [--tokens 512]``
prints per build: us per decode token per layer and ms per prompt chunk per layer (medians of 7),
and the shape's DeltaNet layer count.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
from sparkq.convert.synth import SHAPES
from sparkq.formats.recipe import recipe_for_config
from sparkq.formats.spec import ModelSpec
from sparkq.runtime import core
from sparkq.runtime.core import abi


def layer(spec):
    g = spec.gdn
    rng = np.random.default_rng(0)
    bufs = {"conv_w": (rng.standard_normal((g.conv_dim, g.conv_kernel)) * 0.3).astype(np.float32),
            "a_log": np.full(g.v_heads, 0.5, np.float32), "dt_bias": np.full(g.v_heads, -3.0, np.float32),
            "gnorm": np.ones(g.v_dim, np.float32), "conv_state": np.zeros((g.conv_dim, g.conv_kernel - 1), np.float32),
            "rec_state": np.zeros((g.v_heads, g.k_dim, g.v_dim), np.float32)}
    m = abi.SqModel()
    m.layers, m.heads, m.kv_heads, m.cap, m.head_dim = 1, 1, 1, 1, 8
    m.lin_k_heads, m.lin_v_heads, m.lin_k_dim, m.lin_v_dim, m.conv_k = g.k_heads, g.v_heads, g.k_dim, g.v_dim, g.conv_kernel
    m.beta_scale, m.gnorm_eps = g.beta_scale, g.norm_eps
    L = abi.SqLayer()
    L.mixer = abi.MIXERS["gdn"]
    for k, v in bufs.items():
        setattr(L, k, v.ctypes.data)
    m.layer = ctypes.pointer(L)
    return m, L, bufs


def timed(lib, m, L, g, t, reps):
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((t, g.conv_dim)).astype(np.float32)
    zba = rng.standard_normal((t, g.value_dim + 2 * g.v_heads)).astype(np.float32)
    out = np.empty((t, g.value_dim), np.float32)
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if lib.sq_mix(ctypes.byref(m), ctypes.byref(L), 0, qkv.ctypes.data, zba.ctypes.data, t, out.ctypes.data):
            raise SystemExit("sq_mix failed")
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3.5-2b", choices=[s for s in SHAPES if "qwen3.5" in s])
    ap.add_argument("--builds", default=",".join(core.host_builds()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args(argv)
    cfg = SHAPES[a.shape]
    spec = ModelSpec.from_recipe(cfg, recipe_for_config(cfg))
    n = sum(mx == "gdn" for mx in spec.mixers)
    print(f"{a.shape}: {n} DeltaNet layers of {spec.layers}; {a.threads} threads")
    for b in a.builds.split(","):
        lib = core.load(b)
        lib.sq_set_threads(a.threads)
        m, L, keep = layer(spec)
        one = timed(lib, m, L, spec.gdn, 1, 201)
        chunk = timed(lib, m, L, spec.gdn, a.tokens, 7)
        print(f"  {b:12s} decode {one * 1e6:7.1f} us/layer ({one * n * 1e3:5.2f} ms a token)   "
              f"prompt {chunk * 1e3:7.2f} ms/layer per {a.tokens} tokens ({chunk * n / a.tokens * 1e3:5.3f} ms a token)")


if __name__ == "__main__":
    main()
