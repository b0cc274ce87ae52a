"""The tile model (csrc/tile_model.c), the tile GEMM over it on every build, the amx build's
hardware tiles against both (AMX hosts), and ``native`` chosen by measurement (core/native.py)."""
import ctypes
import json

import numpy as np
import pytest
import torch

from helpers import kernel_builds

K_ = pytest.importorskip("sparkq.runtime.core")
if K_.compiler() is None:
    pytest.skip("no C compiler on this machine", allow_module_level=True)

AMX = [pytest.param("amx", marks=pytest.mark.skipif(bool(K_.missing_features("amx")),
                                                    reason=f"this CPU cannot run the amx build (lacks "
                                                           f"{', '.join(K_.missing_features('amx'))})"))]


def _bf16_bits(a: np.ndarray) -> np.ndarray:  # round to nearest even, as the tiles' inputs are
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _f32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def _tile_op(lib, op, a, b, c, hw):
    c = c.copy()
    assert lib.sq_tile_op(op, a.ctypes.data, b.ctypes.data, c.ctypes.data, hw) == 0
    return c


def _dpbusd_ref(a, b, c):
    s = c.astype(np.int64) + np.einsum("mkj,knj->mn", a.reshape(16, 16, 4).astype(np.int64),
                                       b.reshape(16, 16, 4).astype(np.int64))
    return ((s + 2**31) % 2**32 - 2**31).astype(np.int32)  # int32 sums wrap


def _int8_tiles(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    b = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    c = rng.integers(-2**31, 2**31, (16, 16), dtype=np.int64).astype(np.int32)
    a[0], b[:, :4] = 255, -128  # the extremes: 64 x 255 x -128 per row and column pair
    return a, b, c


def _bf16_tiles(seed):
    rng = np.random.default_rng(seed)
    a = _bf16_bits(rng.standard_normal((16, 32)) * np.exp(rng.standard_normal((16, 32)) * 2))
    b = _bf16_bits(rng.standard_normal((16, 32)) * np.exp(rng.standard_normal((16, 32)) * 2))
    c = (rng.standard_normal((16, 16)) * 10).astype(np.float32)
    return a, b, c


def _bf16_ref(a, b, c):
    """fp64 sums of the tile's products and the bound on fp32 rounding: 33 additions of at most
    sum |terms| each, 2^-24 relative"""
    af, bf = _f32(a).astype(np.float64).reshape(16, 16, 2), _f32(b).astype(np.float64).reshape(16, 16, 2)
    terms = np.einsum("mki,kni->mnki", af, bf)
    ref = c.astype(np.float64) + terms.sum((2, 3))
    bound = (np.abs(c.astype(np.float64)) + np.abs(terms).sum((2, 3))) * 33 * 2.0**-24
    return ref, bound


@pytest.mark.parametrize("build", kernel_builds())
def test_tile_model_instructions_against_numpy(build):
    """Over the model, on every build: TDPBUSD (unsigned x signed bytes, four per dword, int32
    sums that wrap) equals numpy's integer product exactly; TDPBF16PS equals the fp64 sums within
    fp32 rounding of its 32 additions."""
    lib = K_.load(build)
    for seed in range(3):
        a, b, c = _int8_tiles(seed)
        assert np.array_equal(_tile_op(lib, 0, a, b, c, 0), _dpbusd_ref(a, b, c))
        a, b, c = _bf16_tiles(seed)
        ref, bound = _bf16_ref(a, b, c)
        assert (np.abs(_tile_op(lib, 1, a, b, c, 0) - ref) <= bound).all()
    with pytest.raises(AssertionError):  # an unknown op is refused, not run
        _tile_op(lib, 2, a, b, c, 0)
    if build != "amx":
        assert lib.sq_tile_op(0, a.ctypes.data, b.ctypes.data, c.ctypes.data, 1) == -3  # no hardware tiles here


@pytest.mark.parametrize("build", AMX)
def test_amx_instructions_against_the_model(build):
    """The hardware tiles: TDPBUSD gives the model's bits; TDPBF16PS the fp64 sums within the same
    rounding bound (the hardware's sums are closer to fp64 than the SDM's pair-by-pair order the
    model follows: measured 137-179 of 256 lanes differ from every order tried, in the last bits)."""
    lib = K_.load(build)
    assert lib.sq_prefill_amx() == 1
    for seed in range(5):
        a, b, c = _int8_tiles(seed)
        assert np.array_equal(_tile_op(lib, 0, a, b, c, 1), _tile_op(lib, 0, a, b, c, 0))
        a, b, c = _bf16_tiles(seed)
        ref, bound = _bf16_ref(a, b, c)
        assert (np.abs(_tile_op(lib, 1, a, b, c, 1) - ref) <= bound).all()


def _linear(lib, kind, n, k, g, seed):
    from sparkq.formats import constants as C

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    sz = torch.stack([torch.rand(k // g, n, generator=gen) * 0.02 + 0.002,
                      torch.randn(k // g, n, generator=gen) * 0.02], -1).to(torch.bfloat16).contiguous()
    lut = torch.sort(torch.randint(-127, 128, (n, 16), generator=gen), dim=1).values.to(torch.int8).contiguous()
    cl = K_.CLinear(C.KIND_LUT4 if kind == "lut4" else C.KIND_INT4, n, k, g, q, sz, lut=lut if kind == "lut4" else None)
    L = K_.linear_struct(lib, cl)
    w = torch.empty(n, k)
    assert lib.sq_dequant_rows(ctypes.byref(L), 0, n, w.data_ptr()) == 0
    return L, w, cl


# (N, K, G, M): token tiles in pairs and alone (M = 16, 35, 47), row blocks with a tail (N = 48,
# 80, 1041), every group size, the 2 x 2 C tiles over a long K, and token chunks (K = 6144: 160
# tokens a chunk, so M = 170 is a whole chunk and a part one of one tile)
SHAPES = [(64, 256, 64, 16), (48, 128, 32, 35), (80, 384, 128, 1), (96, 512, 256, 47), (1041, 256, 128, 20),
          (64, 2048, 128, 33), (32, 6144, 128, 170)]


def _gemm_ref(x, w):
    xb, wb = torch.from_numpy(_f32(_bf16_bits(x.numpy()))), torch.from_numpy(_f32(_bf16_bits(w.numpy())))
    return xb.double() @ wb.double().T


@pytest.mark.parametrize("build", kernel_builds())
@pytest.mark.parametrize("kind", ["int4", "lut4"])
def test_tile_gemm_over_the_model_is_the_bf16_product(build, kind):
    """sq_gemm_tiles over the tile model, on every build: the tile GEMM's blocking, dequantization
    tables, activation tiles and transposed stores give the fp64 product of the bf16-rounded
    activations and bf16-rounded dequantized weights, to fp32 rounding (measured at most 1.5e-6
    of the largest output, K = 2048)."""
    lib = K_.load(build)
    for i, (n, k, g, m) in enumerate(SHAPES):
        L, w, _keep = _linear(lib, kind, n, k, g, i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i))
        y = torch.full((m, n), float("nan"))
        assert lib.sq_gemm_tiles(ctypes.byref(L), x.data_ptr(), m, y.data_ptr(), 0) == 0
        ref = _gemm_ref(x, w)
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (n, k, g, m, err)


@pytest.mark.parametrize("build", AMX)
@pytest.mark.parametrize("kind", ["int4", "lut4"])
def test_amx_gemm_against_the_model_and_the_dispatch(build, kind):
    """The amx build: the hardware tile GEMM (AVX512 staging: vpermw tables, 16 x 16 transposes)
    agrees with the model's within fp32 rounding; sq_linear_batch takes it from 16 tokens (the
    same bits), and below that the W4A8 GEMM (the avx512-vnni build's bits)."""
    lib, vnni = K_.load(build), K_.load("avx512-vnni")
    for i, (n, k, g, m) in enumerate(SHAPES + [(64, 256, 64, 15)]):
        L, w, cl = _linear(lib, kind, n, k, g, i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i))
        y = {hw: torch.full((m, n), float("nan")) for hw in (0, 1)}
        for hw in (0, 1):
            assert lib.sq_gemm_tiles(ctypes.byref(L), x.data_ptr(), m, y[hw].data_ptr(), hw) == 0
        ref = _gemm_ref(x, w)
        scale = ref.abs().max()
        assert float((y[1].double() - ref).abs().max() / scale) < 1e-5
        assert float((y[1] - y[0]).abs().max() / scale) < 1e-5
        yb = torch.full((m, n), float("nan"))
        assert lib.sq_linear_batch(ctypes.byref(L), x.data_ptr(), 0, m, yb.data_ptr(), None) == 0
        if m >= 16:
            assert torch.equal(yb, y[1])
            ybf = torch.empty(m, n, dtype=torch.bfloat16)  # the bf16 output: the fp32 result rounded
            assert lib.sq_linear_batch(ctypes.byref(L), x.data_ptr(), 0, m, None, ybf.data_ptr()) == 0
            assert torch.equal(ybf, yb.to(torch.bfloat16))
        else:
            Lv, ya8 = K_.linear_struct(vnni, cl), torch.empty(m, n)
            assert vnni.sq_linear_batch(ctypes.byref(Lv), x.data_ptr(), 0, m, ya8.data_ptr(), None) == 0
            assert torch.equal(yb, ya8)


class _FakeLib:
    pass


def test_native_is_the_measured_fastest_and_cached(tmp_path, monkeypatch, capsys):
    """measured_native times each candidate once, keeps the fastest, records the times beside the
    builds and reuses that record; a candidate that will not load (the kernel refused the tile
    state) is skipped with one line on stderr."""
    from sparkq.runtime.core import lib as L
    from sparkq.runtime.core import native

    monkeypatch.setenv("SPARKQ_CACHE", str(tmp_path))
    times = {"amx": 0.5, "avx512-bf16": 0.2, "avx512-vnni": 0.3}
    libs = {}

    def fake_load(b, fallback=True):
        assert not fallback  # a refused build must fail its timing, not time another build
        libs[b] = _FakeLib()
        libs[b].name = b
        return libs[b]

    from sparkq.runtime.core import builds as B

    built = []
    monkeypatch.setattr(B, "build", lambda b: built.append(b) or (tmp_path / b, 0.0))  # no compiler run here
    monkeypatch.setattr(L, "load", fake_load)
    monkeypatch.setattr(native, "prompt_seconds", lambda lib: times[lib.name])
    cands = list(times)
    assert native.measured_native(cands) == "avx512-bf16"
    rec = json.loads(native.choice_path(cands).read_text())
    assert rec["build"] == "avx512-bf16" and rec["seconds"] == times and rec["refused"] == {}
    assert sorted(built) == sorted(cands)  # each candidate compiled (side by side) before the timing
    monkeypatch.setattr(native, "prompt_seconds", lambda lib: 1 / 0)  # the record is used: nothing is timed
    assert native.measured_native(cands) == "avx512-bf16"
    monkeypatch.setattr(native, "_CHOSEN", {})  # a new process: from the record on disk
    assert native.measured_native(cands) == "avx512-bf16"

    other = ["amx", "avx512-vnni"]  # another candidate set, another record; amx refused
    monkeypatch.setattr(native, "prompt_seconds", lambda lib: times[lib.name])

    def refusing(b, fallback=True):
        if b == "amx":
            raise K_.KernelUnavailable("the kernel refused this process the AMX tile state")
        return fake_load(b, fallback)

    monkeypatch.setattr(L, "load", refusing)
    assert native.measured_native(other) == "avx512-vnni"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sparkq: native build: amx skipped (the kernel refused this process the AMX tile state)"]
    assert json.loads(native.choice_path(other).read_text())["refused"] == {
        "amx": "the kernel refused this process the AMX tile state"}


def test_native_on_this_cpu_is_a_prompt_build_measured_here():
    """On this CPU: where it runs several prompt builds, native is the one its record measured
    fastest; else the most capable build."""
    from sparkq.runtime.core import native
    from sparkq.runtime.core.builds import PROMPT_BUILDS

    cands = [b for b in K_.host_builds() if b in PROMPT_BUILDS]
    nat = K_.resolve_variant("native")
    if len(cands) < 2:
        best = K_.host_builds()[0]
        assert nat == (best if best != "scalar" else "native")
        return
    rec = native.native_record(cands)
    assert rec is not None and nat == rec["build"] == min(rec["seconds"], key=rec["seconds"].get)


@pytest.mark.parametrize("build", AMX)
def test_refused_tile_state_falls_back_in_one_line(build, monkeypatch, capsys):
    """Where the kernel refuses the tile state (sq_amx_init -1), loading the amx build gives the best
    other build this CPU runs with one line on stderr; the native measurement, which must not time
    one build under another's name, gets the error instead."""
    import ctypes as ct

    from sparkq.runtime.core import lib as L

    real = ct.CDLL

    def refusing(path, *a, **kw):
        lib = real(path, *a, **kw)
        if "sq-amx-" in str(path):
            lib.sq_amx_init = lambda: -1
        return lib

    monkeypatch.setattr(L, "_LIBS", {})
    monkeypatch.setattr(L.ctypes, "CDLL", refusing)
    other = next(b for b in K_.host_builds() if b != "amx")
    lib = L.load("amx")
    assert L.build_name(lib) == other and lib.sq_prefill_amx() == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"sparkq: the kernel refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM); using the {other} build"]
    monkeypatch.setattr(L, "_LIBS", {})
    with pytest.raises(K_.KernelUnavailable, match=f"refused .*; choose SPARKQ_KERNEL={other}"):
        L.load("amx", fallback=False)
