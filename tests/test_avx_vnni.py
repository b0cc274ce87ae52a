"""The avx2-vnni build (AVX2 + AVX-VNNI: one VEX vpdpbusd where avx2 pairs maddubs + madd, vpdpwssd
in the int8 cache's attention) against the avx2 build. maddubs never saturates on these operands
(the unsigned side is <= 128: 4-bit codes, |lut4 levels| <= 127, |int8 weights| <= 128), so both
compute the same int32 sums: the same bits in every product kind, the prompt GEMM, whole decode
steps, batched steps and prompts. The bit tests run where the CPU has avx_vnni (Alder Lake and
later client CPUs, Sapphire Rapids); elsewhere they are a visible skip and only the compile runs."""
import ctypes
import platform
import sys

import numpy as np
import pytest
import torch

import test_kernels as TK
from helpers import make_llama
from sparkq.runtime import core as K_

LACKS = K_.missing_features("avx2-vnni") + K_.missing_features("avx2")
needs_vnni = pytest.mark.skipif(bool(LACKS), reason=f"this CPU cannot run the avx2-vnni build (lacks {', '.join(LACKS)})")
x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 build")
# the VNNI build under test: avx2-vnni itself, and avx2-vnni-evex (its code with the EVEX instruction,
# a tests-only build) where the CPU has AVX512-VNNI but maybe no AVX-VNNI
VNNI = [pytest.param(b, id=b, marks=[pytest.mark.skipif(bool(lacks), reason=f"this CPU cannot run the {b} build "
                                                                         f"(lacks {', '.join(lacks)})")])
        for b in ("avx2-vnni", "avx2-vnni-evex") for lacks in [K_.missing_features(b) + K_.missing_features("avx2")]]


def _extremes(kind):
    """lut4 rows of levels +-127 only and int8 rows of -128 / 127: the largest products maddubs meets."""
    L, w, b, keep = TK._lut4(64, 576, 64, seed=3) if kind == "lut4" else TK._int8(40, 160, seed=3)
    q = keep[2] if kind == "lut4" else keep[0]
    gen = torch.Generator().manual_seed(4)
    ext = torch.where(torch.rand(q.shape, generator=gen) < 0.5, -127, 127) if kind == "lut4" else \
        torch.where(torch.rand(q.shape, generator=gen) < 0.5, -128, 127)
    q.copy_(ext.to(torch.int8))
    return L, keep


CASES = {**{k: (lambda f=f: (lambda r: (r[0], r[3]))(f())) for k, f in TK.CASES.items() if k != "bf16"},
         "lut4-levels-127": lambda: _extremes("lut4"), "int8-minus-128": lambda: _extremes("int8")}


@x86
@pytest.mark.parametrize("build", ["avx2-vnni", "avx2-vnni-evex"])
def test_vnni_builds_compile_and_are_what_they_name(build):
    """-mavxvnni compiles on any x86 host (gcc >= 11, clang >= 12); running it needs avx_vnni."""
    path, _ = K_.build(build)
    assert path.is_file()
    if not K_.missing_features(build):
        assert K_.load(build).sq_simd() == K_.EXPECT[build][0] == 4


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("vnni", VNNI)
def test_products_and_prompt_gemm_give_avx2_bits(vnni, case):
    L, keep = CASES[case]()
    out = {}
    for b in ("avx2", vnni):
        lib = TK._lib(b)
        xs = [torch.randn(L.k, generator=torch.Generator().manual_seed(s)) * (1 + 9 * (s == 2)) for s in range(3)]
        got = [TK._run(lib, L, x) for x in xs]
        for M in (13, 40):  # token tiles and a tail; 40: the W4A8 prompt GEMM from K = 384
            X = torch.randn(M, L.k, generator=torch.Generator().manual_seed(M))
            Y = torch.empty(M, L.n)
            assert lib.sq_linear_batch(ctypes.byref(L), X.data_ptr(), 0, M, Y.data_ptr(), None) == 0
            got.append(Y)
        out[b] = got
    for i, (a, v) in enumerate(zip(out["avx2"], out[vnni])):
        assert torch.equal(a, v), (case, i, (a - v).abs().max().item())


@pytest.mark.parametrize("kind,kv", [("int4", "int8"), ("lut4", "bf16")])
@pytest.mark.parametrize("vnni", VNNI)
def test_whole_steps_batched_steps_and_prompts_give_avx2_bits(tmp_path, monkeypatch, vnni, kind, kv):
    """A model through the torch-free runtime on both builds: prompts (a 40-token one: the prompt
    GEMM), decode steps and the batched step (sq_step_many: the four-token products) give the same
    logits bit for bit; the int8 KV cache's attention takes vpdpwssd on avx2-vnni."""
    from sparkq.convert.pipeline import Options, convert
    from sparkq.runtime.lite import load as load_lite

    src = make_llama(tmp_path / "m", hidden=192, inter=448, layers=2, heads=6, kv_heads=2, seed=6)
    art = tmp_path / "q"
    convert(str(src), str(art), Options(progress=False, method="minmax", kind=kind, head="int8"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (40, 5, 9)]
    logits = {}
    for b in ("avx2", vnni):
        monkeypatch.setenv("SPARKQ_KERNEL", b)
        m = load_lite(str(art), max_model_len=64, kv_budget_mib=4, slots=len(prompts), kv_dtype=kv)
        assert m.session.lib.sq_simd() == K_.EXPECT[b][0]
        offs = [i * m.slot_elems for i in range(len(prompts))]
        got = [np.array(m.session.prefill(p, 0, kvoff=o)) for p, o in zip(prompts, offs)]
        for step in range(3):  # batched steps, four-token products over three sequences
            got.append(np.array(m.session.step_many([7 + step + i for i in range(len(prompts))],
                                                    [len(p) + step for p in prompts], offs)))
        one = load_lite(str(art), max_model_len=64, kv_budget_mib=4, slots=1, kv_dtype=kv).session
        one.prefill(prompts[0])
        got += [np.array(one.step(7 + s, len(prompts[0]) + s)) for s in range(3)]  # single decode steps
        logits[b] = got
    for i, (a, v) in enumerate(zip(logits["avx2"], logits[vnni])):
        assert np.array_equal(a, v), (i, float(np.abs(a - v).max()))


def test_native_on_an_avx_vnni_cpu_without_avx512_is_avx2_vnni(monkeypatch):
    from sparkq.runtime.core import builds as B

    monkeypatch.delenv("SPARKQ_KERNEL", raising=False)
    monkeypatch.setattr(B, "cpu_flags", lambda: "flags : fpu sse2 avx avx2 fma avx_vnni")  # Alder Lake
    assert B.host_builds() == ["avx2-vnni", "avx2", "scalar"] and B.resolve_variant() == "avx2-vnni"


@needs_vnni
def test_native_falls_back_when_its_build_fails_to_compile(monkeypatch, capsys):
    """A compiler that cannot build native's choice (gcc 10 and -mavxvnni) gives the next build
    this CPU runs, in one line; a build the user names fails as it is."""
    from sparkq.runtime.core import lib as Lib

    real = Lib.library

    def failing(v):
        if v == "avx2-vnni":
            raise K_.KernelUnavailable("cc: error: unrecognized command-line option '-mavxvnni'")
        return real(v)

    monkeypatch.setattr(Lib, "library", failing)
    monkeypatch.setattr(Lib, "_LIBS", {})
    monkeypatch.setattr(Lib, "resolve_variant", lambda v=None: v or "avx2-vnni")
    monkeypatch.delenv("SPARKQ_KERNEL", raising=False)
    lib = Lib.load()
    assert Lib.build_name(lib) == "avx2" and lib.sq_simd() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sparkq: the avx2-vnni build failed (cc: error: unrecognized command-line option '-mavxvnni'); "
                   "using the avx2 build"], err
    monkeypatch.setattr(Lib, "_LIBS", {})  # (a process that fell back keeps the fallback under both names)
    with pytest.raises(K_.KernelUnavailable, match="mavxvnni"):
        Lib.load("avx2-vnni")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
