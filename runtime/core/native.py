"""``native`` by measurement: where this CPU runs several builds whose prompt GEMMs differ (amx,
avx512-bf16, avx512-vnni: the same decode products), time each one's prompt products once and
keep the fastest.

The timing is one int4 and one lut4 linear (K = N = 2048, g128, random codes) over MEASURE_M
tokens through ``sq_linear_batch``, best of MEASURE_REPS, in the threads a session would use. The
result goes to ``native-<hash>.json`` beside the builds (the hash: the sources, compiler and CPU
flags, as the builds' own; a wheel's prebuilt libraries need no compiler: their manifest's sources
and compiler), written to a temp name and renamed, so it is measured once per machine and sources.
``sparkq bench`` and ``generate --json`` name the build that ran.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time

import numpy as np

from .builds import KernelUnavailable, cache_dir, compiler, cpu_flags, fingerprint, manifest, prebuilt

MEASURE_M, MEASURE_K, MEASURE_N, MEASURE_G, MEASURE_REPS = 128, 2048, 2048, 128, 3
MEASURE_ROUNDS = 3  # interleaved rounds over the candidates
_CHOSEN: dict[tuple, str] = {}  # (cache dir, candidates) -> build: resolved once per process


def choice_path(candidates: list[str]):
    """The record's file: keyed by the sources, the candidates, this CPU's flags and the compiler,
    or where a wheel ships every candidate prebuilt, by its libraries' sources and compiler (no
    compiler needed)."""
    if all(prebuilt(b) for b in candidates):
        import hashlib

        m = manifest()
        key = " ".join(["prebuilt", m["sources"], str(m.get("compiler")), *candidates, cpu_flags()])
        return cache_dir() / f"native-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set $CC or install gcc)")
    return cache_dir() / f"native-{fingerprint(cc, ['native', *candidates])}.json"


def prompt_seconds(lib) -> float:
    """Seconds for the timing's two linears (int4 and lut4) on one library, best of the reps."""
    from . import abi
    from .lib import kind_code

    rng = np.random.default_rng(0)
    K, N, G, M = MEASURE_K, MEASURE_N, MEASURE_G, MEASURE_M
    q = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    sz = (np.abs(rng.standard_normal((K // G, N, 2), dtype=np.float32)) * 0.01).view(np.uint32) >> 16
    sz = sz.astype(np.uint16)
    lut = np.sort(rng.integers(-100, 100, (N, 16), dtype=np.int8), axis=1)
    x = rng.standard_normal((M, K), dtype=np.float32)
    y = np.empty((M, N), dtype=np.float32)
    total = 0.0
    for kind in ("int4", "lut4"):
        L = abi.SqLinear(q.ctypes.data, sz.ctypes.data, None, kind_code(lib, kind), N, K, G, None, None,
                         lut.ctypes.data if kind == "lut4" else None, None)
        best = float("inf")
        for _ in range(MEASURE_REPS + 1):  # the first warms the caches and the thread pool
            t0 = time.perf_counter()
            if lib.sq_linear_batch(ctypes.byref(L), x.ctypes.data, 0, M, y.ctypes.data, None):
                raise MemoryError("the C core could not allocate the timing's buffers")
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


def measured_native(candidates: list[str]) -> str:
    """The fastest of ``candidates`` for prompts on this machine (measured once, then cached; the
    record's hash costs a compiler call, so a process resolves it once)."""
    key = (str(cache_dir()), tuple(candidates))
    if key in _CHOSEN:
        return _CHOSEN[key]
    path = choice_path(candidates)
    try:
        saved = json.loads(path.read_text())
        if saved.get("build") in candidates:
            _CHOSEN[key] = saved["build"]
            return saved["build"]
    except (OSError, ValueError, AttributeError):
        pass
    from concurrent.futures import ThreadPoolExecutor

    from . import builds
    from .lib import load

    with ThreadPoolExecutor(max_workers=max(1, min(len(candidates), os.cpu_count() or 1))) as pool:
        for f in [pool.submit(builds.library, b) for b in candidates]:  # compile the candidates side by side
            try:
                f.result()
            except KernelUnavailable:
                pass  # load() below says why, for that build
    seconds, refused, libs = {}, {}, {}
    for b in candidates:
        try:
            libs[b] = load(b, fallback=False)
        except KernelUnavailable as e:  # e.g. the kernel refused the AMX tile state
            refused[b] = str(e)
            print(f"sparkq: native build: {b} skipped ({e})", file=sys.stderr)
    # the candidates in interleaved rounds, each its best: a burst of load on a shared machine then
    # slows one round of every candidate, not all of one (measured on the Xeon: while a test suite
    # ran beside it, one-after-another timing took amx 0.032 s and avx512-vnni 0.0088 s, and cached
    # vnni; quiet, 0.0019 and 0.0061)
    for _ in range(MEASURE_ROUNDS):
        for b, lib in libs.items():
            seconds[b] = min(seconds.get(b, float("inf")), prompt_seconds(lib))
    if not seconds:
        raise KernelUnavailable(f"no build of {', '.join(candidates)} loads here: {'; '.join(refused.values())}")
    best = min(seconds, key=seconds.get)
    record = {"build": best, "seconds": seconds, "refused": refused,
              "measure": {"m": MEASURE_M, "k": MEASURE_K, "n": MEASURE_N, "g": MEASURE_G, "kinds": ["int4", "lut4"],
                          "rounds": MEASURE_ROUNDS}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)
    _CHOSEN[key] = best
    return best


def native_record(candidates: list[str]) -> dict | None:
    """The cached measurement behind ``native`` (None before it is made)."""
    try:
        return json.loads(choice_path(candidates).read_text())
    except (OSError, ValueError):
        return None
