"""The C core (runtime/core/csrc/) against references, on every build this CPU runs.

The builds (runtime/core/builds.py BUILDS): ``amx`` (AVX512-VNNI products, prompts on AMX tiles:
also tests/test_amx.py), ``avx512-bf16`` (AVX512-VNNI products, AVX512-BF16 prompt GEMM), ``avx512-vnni`` (the same, prompts through the W4A8 GEMM), ``avx2``, ``scalar``
(portable C) and ``exact`` (portable, fp32 activations: no A8). Tests parametrized with
``kernel_builds()`` run once per ISA build, ids naming it; a build this CPU cannot run is a
visible skip. The W4A8 error budget the runtime promises: one product's relative error against
fp64 on the same weights below 1% (activations int8 per 8 columns; measured 0.57-0.65% with an
outlier channel, 0.87-1.2% when the scales were per 32 columns), a whole model's held-out KL
against fp32 compute on the same weights below 0.005 (test_runtime.py), logits within 2.5x of
bf16 compute's error (test_families.py).
"""
import ctypes

import pytest
import torch

from helpers import kernel_builds, make_llama, run_cli
from sparkq.convert.pipeline import Options, convert
from sparkq.formats.layout import ROWS32, dequantize_codes, pack_rows

K_ = pytest.importorskip("sparkq.runtime.core")
if K_.compiler() is None:  # the runtime then falls back to torch (tested below in a child without one)
    pytest.skip("no C compiler on this machine", allow_module_level=True)


def _int4(n, k, g, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    sz = torch.stack([torch.rand(k // g, n, generator=gen) * 0.02 + 0.002,
                      torch.randn(k // g, n, generator=gen) * 0.02], -1).to(torch.bfloat16).contiguous()
    q = torch.from_numpy(pack_rows(codes.numpy(), ROWS32, n))
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    w = dequantize_codes(codes, sz, g, torch.float64)
    keep = (q, sz, b)
    return K_.SqLinear(q.data_ptr(), sz.data_ptr(), b.data_ptr() if b is not None else None, 0, n, k, g), w, b, keep


def _lut4(n, k, g, seed=0):
    """A lut4 linear: rows32 codes, per-group (scale, zero), each row's 16 ascending int8 levels
    (one row with a level of -127 and one of 127: the extremes the products must hold)."""
    from sparkq.formats.layout import dequantize_codes_lut

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    sz = torch.stack([torch.rand(k // g, n, generator=gen) * 0.002 + 0.0002,
                      torch.randn(k // g, n, generator=gen) * 0.02], -1).to(torch.bfloat16).contiguous()
    levels = torch.sort(torch.randint(-127, 128, (n, 16), generator=gen), dim=1).values.to(torch.int8)
    levels[0, 0], levels[-1, -1] = -127, 127
    levels = levels.contiguous()
    q = torch.from_numpy(pack_rows(codes.numpy(), ROWS32, n))
    w = dequantize_codes_lut(codes, sz, levels, g, torch.float64)
    L = K_.SqLinear(q.data_ptr(), sz.data_ptr(), None, 3, n, k, g, None, None, levels.data_ptr())
    return L, w, None, (q, sz, levels)


def _int8(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    s = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    w = q.double() * s.double()[:, None]
    return K_.SqLinear(q.data_ptr(), s.data_ptr(), None, 1, n, k, 0), w, None, (q, s)


def _bf16(n, k, seed=0):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)
    return K_.SqLinear(w.data_ptr(), None, None, 2, n, k, 0), w.double(), None, (w,)


CASES = {  # name -> builder; shapes cover the 4-row blocks, their remainders and both int4 code paths
    "int4-g32": lambda: _int4(80, 96, 32),           # g32, K % 64 = 32: natural activation order (portable loop)
    "int4-g32-paired": lambda: _int4(48, 576, 32),   # g32 paired: a 64-column step spans two groups
    "int4-g32-chunks": lambda: _int4(32, 4416, 32),  # 138 groups: two column chunks of the prompt GEMM
    "int4-g64": lambda: _int4(48, 576, 64),          # paired AVX2 path, one pair per group
    "int4-g128-bias": lambda: _int4(64, 256, 128, bias=True),
    "int4-g128-blocks": lambda: _int4(1041, 256, 128),  # prefill GEMM: 2 row blocks, odd tail row
    "int4-g64-chunks": lambda: _int4(32, 4416, 64),  # 34.5 VNNI steps: two column chunks, a half step
    "int4-g256-chunks": lambda: _int4(48, 8448, 256),  # 66 VNNI steps, two per group, three chunks
    "int4-g64-many-groups": lambda: _int4(32, 16448, 64),  # 257 groups: the AVX2 products on AVX512 too
    "lut4-g32": lambda: _lut4(80, 96, 32),          # lut4: the same code paths as int4, levels by shuffle
    "lut4-g32-paired": lambda: _lut4(48, 576, 32),
    "lut4-g32-chunks": lambda: _lut4(32, 4416, 32),
    "lut4-g64": lambda: _lut4(48, 576, 64),
    "lut4-g128-blocks": lambda: _lut4(1041, 256, 128),
    "lut4-g64-chunks": lambda: _lut4(32, 4416, 64),
    "lut4-g256-chunks": lambda: _lut4(48, 8448, 256),
    "lut4-g64-many-groups": lambda: _lut4(32, 16448, 64),
    "int8": lambda: _int8(83, 160),                  # 83 rows: one-row tail
    "bf16": lambda: _bf16(37, 72),                   # K not a multiple of 8: scalar tail
}


def _lib(variant):
    return K_.load(variant)


def _run(lib, L, x):
    y = torch.empty(L.n)
    assert lib.sq_linear_f32(ctypes.byref(L), x.data_ptr(), y.data_ptr()) == 0
    return y


SIMD = [b for b in K_.ISA_BUILDS if b != "scalar"]


@pytest.mark.parametrize("build", kernel_builds())
def test_each_build_is_what_it_names(build):
    """A build's products and prompt GEMM are the ones its name says (a compiler that ignored a
    flag would otherwise test one ISA twice and another never), and ``native`` is the most
    capable build this CPU runs."""
    lib = _lib(build)
    assert (lib.sq_simd(), lib.sq_prefill_bf16(), lib.sq_prefill_amx()) == K_.EXPECT[build]
    # native: a build this CPU runs (which one, where several prompt GEMMs compete: test_amx.py)
    assert K_.resolve_variant("native") in (K_.host_builds() if K_.host_builds()[0] != "scalar" else ["native"])


def test_unknown_or_unrunnable_build_is_refused(monkeypatch):
    monkeypatch.setenv("SPARKQ_KERNEL", "avx9")
    with pytest.raises(K_.KernelUnavailable, match="not a build; choose native, off or one of"):
        K_.load()
    from sparkq.runtime.core import builds as B
    monkeypatch.setattr(B, "cpu_flags", lambda: "flags : fpu sse2 avx avx2 fma")  # an AVX2-only CPU
    monkeypatch.setenv("SPARKQ_KERNEL", "avx512-vnni")
    with pytest.raises(K_.KernelUnavailable, match="cannot run the avx512-vnni build .*lacks avx512f"):
        K_.load()
    assert K_.host_builds() == ["avx2", "scalar"] and K_.resolve_variant("native") == "avx2"


def test_a_mistyped_build_is_one_line_exit_2_in_every_command(tiny_tied, tiny_tied_art, tmp_path):
    """SPARKQ_KERNEL naming no build is the user's error, never a silent switch to the torch path:
    the torch runtime (generate --torch) and the converter (its GPTQ runs in the C core) stop in
    one line with exit 2, and the converter writes nothing."""
    from helpers import run_cli

    bad = {"SPARKQ_KERNEL": "avx9"}
    p = run_cli("sparkq", "generate", tiny_tied_art, "hi", "--torch", "--max-new-tokens", "2", env=bad)
    assert p.returncode == 2 and "SPARKQ_KERNEL='avx9' is not a build" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    out = tmp_path / "conv"
    p = run_cli("spark-convert", tiny_tied, out, "--quiet", env=bad)
    assert p.returncode == 2 and "is not a build" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("build", kernel_builds())
@pytest.mark.parametrize("case", sorted(CASES))
def test_products_match_fp64_within_the_a8_budget(case, build):
    L, w, b, keep = CASES[case]()
    x = torch.randn(L.k, generator=torch.Generator().manual_seed(9))
    x[3] = 25.0  # an outlier channel, as LLM activations have
    ref = w @ x.double() + (b.double() if b is not None else 0)
    out = {v: _run(_lib(v), L, x).double() for v in {build, "scalar", "exact"}}
    rel = {v: ((y - ref).norm() / ref.norm()).item() for v, y in out.items()}
    assert rel["exact"] < 1e-5, rel
    budget = 1e-5 if case == "bf16" else 0.01  # bf16 linears multiply fp32 activations
    assert rel[build] < budget, rel
    # the SIMD and portable builds do the same integer arithmetic: equal up to float summation order
    assert ((out[build] - out["scalar"]).norm() / ref.norm()).item() < 1e-5, (case, build)


@pytest.mark.parametrize("build", kernel_builds())
def test_work_stealing_products_equal_for_every_thread_count(build):
    """Decode products split rows by work stealing (each thread's own contiguous range first,
    then the back of the others'): every row written once, by the same code whichever thread
    runs it, so the outputs are bit-identical for any thread count (1 thread: one range, no
    stealing; 3 and 5 threads on this 2-core machine preempt each other, so blocks really are
    stolen)."""
    lib = _lib(build)
    cases = [_int4(4096, 512, 128), _int4(1040, 576, 64), _int8(2000, 256)]
    try:
        for L, w, b, keep in cases:
            x = torch.randn(L.k, generator=torch.Generator().manual_seed(4))
            ref = None
            for threads in (1, 2, 3, 5):
                lib.sq_set_threads(threads)
                for _ in range(4):
                    y = torch.full((L.n,), float("nan"))
                    assert lib.sq_linear_f32(ctypes.byref(L), x.data_ptr(), y.data_ptr()) == 0
                    ref = y if ref is None else ref
                    assert torch.equal(y, ref), (L.n, L.k, threads)
    finally:
        lib.sq_set_threads(torch.get_num_threads())


@pytest.mark.parametrize("build", kernel_builds("avx512-bf16"))
@pytest.mark.parametrize("case", ["int4-g64", "int4-g128-bias", "int4-g128-blocks", "int4-g32", "int4-g64-chunks",
                                  "int4-g256-chunks", "int4-g32-paired"])
def test_bf16_gemm_matches_bf16_compute_on_the_dequantized_weights(case, build):
    """From 32 tokens on, AVX512-BF16 CPUs dequantize int4 row blocks to bf16 and multiply with
    vdpbf16ps: equal, up to fp32 summation order, to bf16 activations x bf16-rounded dequantized
    weights in fp64 (measured 5e-8..1e-6 relative), and ~2.5x closer to the fp64 product than
    the W4A8 GEMM of the avx512-vnni build (bf16 rounding of both sides, 2.3e-3, against int8
    activations per 8 columns)."""
    lib, a8lib = _lib(build), _lib("avx512-vnni")
    L, w, b, keep = CASES[case]()
    for M in (32, 37, 64):  # 37: a partial token tile
        X = torch.randn(M, L.k, generator=torch.Generator().manual_seed(M))
        X[:, 3] = 25.0  # an outlier channel
        Y = torch.full((M, L.n), float("nan"))
        assert lib.sq_linear_batch(ctypes.byref(L), X.data_ptr(), 0, M, Y.data_ptr(), None) == 0
        ref = X.bfloat16().double() @ w.float().bfloat16().double().t()
        assert ((Y.double() - ref).norm() / ref.norm()).item() < 1e-5
        exact = X.double() @ w.t()
        e_bf16 = ((Y.double() - exact).norm() / exact.norm()).item()
        Y8 = torch.empty(M, L.n)
        assert a8lib.sq_linear_batch(ctypes.byref(L), X.data_ptr(), 0, M, Y8.data_ptr(), None) == 0
        e_a8 = ((Y8.double() - exact).norm() / exact.norm()).item()
        assert e_bf16 < 0.005 and e_bf16 < e_a8, (e_bf16, e_a8)
        Xb = X.bfloat16()  # bf16 in, bf16 out (no fp32 buffer given): the same products, rounded like torch
        Yb = torch.empty(M, L.n, dtype=torch.bfloat16)
        assert lib.sq_linear_batch(ctypes.byref(L), Xb.data_ptr(), 1, M, None, Yb.data_ptr()) == 0
        assert torch.equal(Yb, Y.bfloat16())
        if M == 64:  # a token's result does not depend on its token tile (other slices of >= 32 tokens)
            for lo, hi in ((0, 32), (5, 42), (30, 64)):
                part = torch.empty(hi - lo, L.n)
                assert lib.sq_linear_batch(ctypes.byref(L), X[lo:hi].contiguous().data_ptr(), 0, hi - lo,
                                           part.data_ptr(), None) == 0
                assert torch.equal(part, Y[lo:hi]), (lo, hi)


@pytest.mark.parametrize("case", ["int4-g64", "int4-g128-bias", "int4-g128-blocks", "int4-g32", "int8", "int4-g64-chunks",
                                  "int4-g256-chunks", "int4-g64-many-groups", "lut4-g32", "lut4-g64", "lut4-g128-blocks",
                                  "lut4-g64-chunks", "lut4-g256-chunks", "lut4-g64-many-groups", "int4-g32-paired",
                                  "int4-g32-chunks", "lut4-g32-paired", "lut4-g32-chunks"])
@pytest.mark.parametrize("build", kernel_builds())
def test_batch_equals_single_products_and_dequant(case, build):
    """The prompt GEMM (below 32 tokens: W4A8 on every build) against one product per token, and
    each token's result independent of the token tile it falls in (13 tokens: tiles and a tail),
    so a prompt gives the same bits whole or in chunks."""
    L, w, b, keep = CASES[case]()
    lib = _lib(build)
    X = torch.randn(13, L.k, generator=torch.Generator().manual_seed(2))  # 13: 4 tiles of 3 tokens + 1
    Y = torch.empty(13, L.n)
    assert lib.sq_linear_batch(ctypes.byref(L), X.data_ptr(), 0, 13, Y.data_ptr(), None) == 0
    # bf16 in, bf16 out: the same products on the bf16-rounded input, rounded like torch
    Xb, Yb, scratch = X.to(torch.bfloat16), torch.empty(13, L.n, dtype=torch.bfloat16), torch.empty(13, L.n)
    Xr, Yr = Xb.float(), torch.empty(13, L.n)
    assert lib.sq_linear_batch(ctypes.byref(L), Xb.data_ptr(), 1, 13, scratch.data_ptr(), Yb.data_ptr()) == 0
    assert lib.sq_linear_batch(ctypes.byref(L), Xr.data_ptr(), 0, 13, Yr.data_ptr(), None) == 0
    assert torch.equal(Yb, Yr.to(torch.bfloat16))
    Yn = torch.empty(13, L.n, dtype=torch.bfloat16)  # bf16 out without a caller's fp32 buffer
    assert lib.sq_linear_batch(ctypes.byref(L), Xb.data_ptr(), 1, 13, None, Yn.data_ptr()) == 0
    assert torch.equal(Yn, Yb)
    assert lib.sq_linear_batch(ctypes.byref(L), Xb.data_ptr(), 1, 13, None, None) == -2  # nowhere to write
    single = torch.stack([_run(lib, L, X[t].contiguous()) for t in range(13)])
    if b is not None:  # the batch kernel leaves the bias to its caller
        single -= b.float()
    assert torch.allclose(Y, single, rtol=1e-5, atol=1e-5 * single.abs().max().item())
    for lo, hi in ((0, 1), (1, 4), (4, 11), (11, 13), (12, 13)):  # other tilings of the same tokens
        part = torch.empty(hi - lo, L.n)
        assert lib.sq_linear_batch(ctypes.byref(L), X[lo:hi].contiguous().data_ptr(), 0, hi - lo, part.data_ptr(),
                                   None) == 0
        assert torch.equal(part, Y[lo:hi]), (lo, hi)
    if L.kind in (0, 3):  # int4, lut4
        out = torch.empty(L.n - 16, L.k)
        assert lib.sq_dequant_rows(ctypes.byref(L), 16, L.n, out.data_ptr()) == 0
        assert torch.allclose(out.double(), w[16:], atol=1e-6)
        assert lib.sq_dequant_rows(ctypes.byref(L), 0, L.n + 1, out.data_ptr()) == -1  # out of range refused


def _gemma3_exact(tmp_path, monkeypatch):
    """A gemma3 artifact with every recipe feature the C core implements, loaded on the exact build."""
    from sparkq.runtime import load

    src = make_llama(tmp_path / "g3", arch="gemma3", layers=6, sliding_window=8, head_dim=48, query_pre_attn_scalar=40,
                     final_logit_softcapping=30.0)
    out = tmp_path / "g3-int4"
    # int8 head: the error budgets below were measured with it. A split head's embedding rows
    # have full fp32 mantissas, so the C core's bf16 rounding of them (as the torch runtime's
    # rows) adds more than the int8 grid's, which bf16 often holds exactly: max ratio 1.28 vs
    # 0.79 here (0.90 against a reference with the same bf16 rows). tests/test_split_head.py
    # covers that head.
    convert(str(src), str(out), Options(progress=False, method="minmax", head="int8"))
    monkeypatch.setenv("SPARKQ_KERNEL", "exact")
    return load(str(out), max_model_len=64, kv_dtype="bf16")  # up to the bf16 cache (int8: test_kvcache.py)


def test_whole_step_exact_build_matches_fp32_reference(tmp_path, monkeypatch):
    """Every recipe feature the C step implements (gemma3: q/k norms, (1+w) norms, sandwich
    norms, embedding scale, GELU, sliding + full layers with two RoPE tables, attention scale,
    final softcap), with fp32 activations: equal to an fp32 forward of the same weights up
    to the bf16 KV cache."""
    from helpers import dequant_reference

    q = _gemma3_exact(tmp_path, monkeypatch)
    assert q.info.extra["decode_path"].startswith("c (exact"), q.info.extra
    t = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1))
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    ratios = []
    for i in range(len(t)):  # every position through the C step, from an empty cache
        y = q.model.forward(t[i:i + 1], i)[0]
        ratios.append(((y - b32[i]).abs().max() / (b16[i] - b32[i]).abs().max()).item())
    # what remains is the bf16 KV cache and bf16 embedding rows: well under bf16 compute's error
    # (measured: max 0.79, median 0.42; a wrong feature gives ratios far above 1)
    assert max(ratios) < 0.9 and sorted(ratios)[len(ratios) // 2] < 0.6, ratios


def test_prefill_exact_build_matches_fp32_reference(tmp_path, monkeypatch):
    """sq_prefill (prompts through the C core) with fp32 activations: every gemma3 feature (as
    the step test above; the 24-token prompt is 3x the sliding window) equal to an fp32 forward
    of the same weights up to the bf16 KV cache; in chunks and continued from a later position
    it gives the same logits as in one piece."""
    from helpers import dequant_reference

    q = _gemma3_exact(tmp_path, monkeypatch)
    assert q.model.prefill_off is None
    calls = []
    real = K_.Session.prefill
    monkeypatch.setattr(K_.Session, "prefill", lambda self, *a: calls.append(a[1:]) or real(self, *a))
    t = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1))
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    y = q.model.forward(t, 0, last_only=False)
    assert calls == [(0, False)]  # the C prefill ran
    ratios = ((y - b32).abs().amax(-1) / (b16 - b32).abs().amax(-1)).tolist()
    # measured max 0.81, median 0.42, as the decode steps above (a wrong mask or feature is far above 1)
    assert max(ratios) < 0.9 and sorted(ratios)[len(ratios) // 2] < 0.6, ratios
    q.model.fast.prefill_chunk = 5  # chunks of 5 tokens: windows cross chunk edges
    assert torch.allclose(q.model.forward(t, 0, last_only=False), y, rtol=1e-5, atol=1e-5)
    a, b = q.model.forward(t[:11], 0, last_only=False), q.model.forward(t[11:], 11, last_only=False)
    assert torch.allclose(torch.cat([a, b]), y, rtol=1e-5, atol=1e-5)
    # last_only: the last position's logits from the C head (sq_head), as close to fp32 as the rest
    last = q.model.forward(t, 0, last_only=True)[0]
    assert ((last - b32[-1]).abs().max() / (b16[-1] - b32[-1]).abs().max()).item() < 0.9


def _w4a8_prompt(fast, n=30, seed=2):
    """Token ids of an n-token prompt whose products take the W4A8 GEMM on this build: the
    session's prefill chunk is set below the build's W4A16 threshold (sq_w4a16_min_m: 32 on
    avx512-bf16, so 30 tokens are one chunk; 16 on amx: chunks of 15). Returns (ids, chunk)."""
    thr = fast.lib.sq_w4a16_min_m()
    fast.prefill_chunk = min(K_.PREFILL_CHUNK, thr - 1) if thr else K_.PREFILL_CHUNK
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)), fast.prefill_chunk


def _c_and_torch_prefill_errors(q, t):
    """The C prefill's logits of tokens t from position 0, and per position (sorted) the max error
    of the C and the torch prefill against fp32 compute on the dequantized weights, in units of
    bf16 compute's error."""
    from helpers import dequant_reference

    m = q.model
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    c = m.forward(t, 0, last_only=False)
    m.c_prefill = False  # the torch prefill in the C prefill's chunks: the same products per chunk size
    step = m.fast.prefill_chunk if m.fast is not None else len(t)
    ref = torch.cat([m.forward(t[i:i + step], i, last_only=False) for i in range(0, len(t), step)])
    m.c_prefill = True

    def err(y):
        return ((y - b32).abs().amax(-1) / (b16 - b32).abs().amax(-1)).sort().values

    return c, err(c), err(ref)


@pytest.mark.parametrize("kind", ["int4", "lut4"])
@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_g32_prompts_go_through_the_c_core(tmp_path, kernel_build, kind):
    """g32 linears (the bit budget's pick for its most sensitive linears) pair in the SIMD
    products (a scale per 128-bit lane): the prompt goes through sq_prefill, not the torch
    prefill, no further from fp32 compute than the torch prefill, and equal up to summation
    order to one decode step per token (the bounds of the test below). On an AVX512-BF16 CPU the
    int4 prompt (40 tokens: from 32 on) takes the bf16 GEMM instead, so there the decode steps
    agree within test_bf16_prefill_of_a_whole_model_is_closer_to_fp32_than_w4a8's budget."""
    from sparkq.runtime import load

    src = make_llama(tmp_path / "m", hidden=128, inter=384, layers=2)
    out = tmp_path / "q"
    convert(str(src), str(out), Options(progress=False, method="minmax", group_size=32, kind=kind))
    q = load(str(out), max_model_len=64, kv_dtype="bf16")  # the budgets below are the bf16 cache's
    m = q.model
    assert {lin.g for name, lin in m.lin.items() if name.startswith("layers.")} == {32}
    assert m.prefill_off is None and q.info.extra["prefill_path"] == "c"
    t = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
    c, ec, et = _c_and_torch_prefill_errors(q, t)  # measured (avx2, int4): C median 1.12 max 1.90; torch 1.43, 2.71
    assert ec[len(ec) // 2] < 1.6 and ec[-1] < 2.5 and ec[len(ec) // 2] <= et[len(et) // 2], (ec, et)
    steps = torch.cat([m.forward(t[i:i + 1], i) for i in range(len(t))])
    rel = ((c - steps).abs().amax(-1) / steps.abs().amax(-1)).sort().values
    if (kind == "int4" or m.fast.lib.sq_prefill_amx()) and m.fast.lib.sq_prefill_bf16():  # W4A16 prompts
        # measured (avx512-bf16): median 1.6%, max 3.1%; the amx build takes lut4 to its tile GEMM too
        assert rel[len(rel) // 2] < 0.04 and rel[-1] < 0.1, rel
    else:
        assert rel[len(rel) // 2] < 1e-4 and rel[-1] < 0.03, rel


# head_dim 24: the AVX512 prefill's P.V on 16 columns, then 8; 64 and 128: the AVX512 decode
# attention (its AVX512 kernel on 16 lanes, 32 V columns per pass)
@pytest.mark.parametrize("heads,head_dim", [(4, None), (8, 24), (4, 64), (2, 128)])
@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_prefill_agrees_with_torch_path_whole_in_chunks_and_decode_steps(tmp_path, kernel_build, heads, head_dim):
    """The C prefill (AVX2: paired GEMM in tiles of 4 tokens, score tiles of 4 keys x 8 queries;
    AVX512: 16 queries, P.V on 16 columns; 30 prompt tokens in chunks below the W4A16 GEMMs'
    thresholds (one chunk; 15 on the amx build), so W4A8 on every build) on a sliding-window model: no further from fp32 compute than the torch prefill;
    the same bits whole or in chunks; equal, up to summation order, to decode steps through the
    same cache."""
    from sparkq.runtime import load

    src = make_llama(tmp_path / "m", arch="mistral", layers=3, sliding_window=8, heads=heads, head_dim=head_dim)
    out = tmp_path / "m-int4"
    convert(str(src), str(out), Options(progress=False, method="minmax"))
    q = load(str(out), max_model_len=64, kv_dtype="bf16")  # the budgets below are the bf16 cache's
    m = q.model
    assert m.prefill_off is None and m.layer_cfg[0].window == 8
    assert (m.fast.lib.sq_simd(), m.fast.lib.sq_prefill_bf16(), m.fast.lib.sq_prefill_amx()) == K_.EXPECT[kernel_build]
    t, chunk = _w4a8_prompt(m.fast, 30, seed=2)
    # both W4A8 on the same weights; the torch path also rounds to bf16 between the products
    # (measured medians: C 1.24, torch 1.48; max 2.06 and 2.56; test_families' budget is 2.5)
    c, ec, et = _c_and_torch_prefill_errors(q, t)
    assert ec[len(ec) // 2] < 1.6 and ec[-1] < 2.5 and ec[len(ec) // 2] <= et[len(et) // 2], (ec, et)
    assert torch.equal(m.forward(t, 0, last_only=False), c)  # deterministic; the cache holds the C prefill's K/V
    # chunks of 7 (the window is 8: later chunks see keys from p0 - 7 on, through the fp32 key copy)
    # and a prompt continued from a later position: every token's products, norms and attention
    # are computed in the same order whatever its place in a chunk, so the logits are the same
    # bits (docs/correctness.md: AVX2 token tiles once summed tail tokens in another order, which
    # moved int8 codes and shifted chunked prompts by 0.4-0.9%)
    m.fast.prefill_chunk = 7
    try:
        assert torch.equal(m.forward(t, 0, last_only=False), c)
    finally:
        m.fast.prefill_chunk = chunk
    assert torch.equal(torch.cat([m.forward(t[:13], 0, last_only=False), m.forward(t[13:], 13, last_only=False)]), c)
    k0, v0 = m.cache.k.clone(), m.cache.v.clone()
    steps = []
    for i in range(len(t)):  # each decode step over the cache the prefill wrote
        m.cache.k.copy_(k0), m.cache.v.copy_(v0)
        steps.append(m.forward(t[i:i + 1], i))
    steps = torch.cat(steps)
    rel = ((c - steps).abs().amax(-1) / steps.abs().amax(-1)).sort().values
    # the same fp32 arithmetic in another order (GEMM tiles vs GEMV, attention tiles): a
    # last-bit difference can still move one int8 activation code, which shifts that position by
    # about one quantization step (from one shared cache: median 1e-6, max 0.0065 measured; chained
    # steps would carry such a shift into every later position)
    assert rel[len(rel) // 2] < 1e-4 and rel[-1] < 0.03, rel
    from sparkq.runtime.errors import RuntimeUserError
    with pytest.raises(RuntimeUserError, match="exceed the max_model_len capacity of 64"):
        m.forward(t, 40)  # 40 + 30 tokens: refused before any K/V is written
    assert torch.equal(m.forward(t, 0, last_only=False), c)


@pytest.mark.parametrize("kernel_build", kernel_builds("amx", "avx512-bf16"), indirect=True)
def test_bf16_prefill_of_a_whole_model_is_closer_to_fp32_than_w4a8(tmp_path, kernel_build, monkeypatch):
    """A 48-token prompt on an AVX512-BF16 CPU: every int4 product of the C prefill goes through
    the bf16 GEMM (on the amx build: the tile GEMM). Against fp32 compute on the same weights it is no further off than the W4A8
    prefill of the avx512-vnni build (the bf16 prefill rounds activations to bf16 instead of int8;
    measured, in units of bf16 compute's error: median 0.73, max 1.03, against W4A8 1.24 and 1.92),
    and decode steps over the cache it wrote (W4A8 products) agree within the W4A8 budget
    (measured: median 1.5%, max 2.5% of the largest logit)."""
    from helpers import dequant_reference
    from sparkq.runtime import load

    src = make_llama(tmp_path / "m", layers=3)
    out = tmp_path / "m-int4"
    convert(str(src), str(out), Options(progress=False, method="minmax"))
    q = load(str(out), max_model_len=64, kv_dtype="bf16")  # the budgets below are the bf16 cache's
    m = q.model
    assert m.prefill_off is None and m.fast.lib.sq_prefill_bf16()
    t = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3))
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    c = m.forward(t, 0, last_only=False)
    k0, v0 = m.cache.k.clone(), m.cache.v.clone()
    monkeypatch.setenv("SPARKQ_KERNEL", "avx512-vnni")
    a8 = load(str(out), max_model_len=64, kv_dtype="bf16").model.forward(t, 0, last_only=False)

    def err(y):  # per position: max error against fp32 compute, in units of bf16 compute's error
        return ((y - b32).abs().amax(-1) / (b16 - b32).abs().amax(-1)).sort().values

    ec, ea = err(c), err(a8)
    assert ec[len(ec) // 2] <= ea[len(ea) // 2] and ec[-1] < 2.5, (ec, ea)
    steps = []
    for i in range(len(t)):
        m.cache.k.copy_(k0), m.cache.v.copy_(v0)
        steps.append(m.forward(t[i:i + 1], i))
    rel = ((c - torch.cat(steps)).abs().amax(-1) / c.abs().amax(-1)).sort().values
    assert rel[len(rel) // 2] < 0.04 and rel[-1] < 0.1, rel


@pytest.mark.parametrize("build", kernel_builds(*SIMD))
def test_simd_and_scalar_steps_agree_and_positions_are_checked(tiny_tied_art, monkeypatch, build):
    from sparkq.runtime import load
    from sparkq.runtime.errors import RuntimeUserError

    models = {}
    for v in (build, "scalar"):
        monkeypatch.setenv("SPARKQ_KERNEL", v)
        models[v] = load(str(tiny_tied_art), max_model_len=32, kv_dtype="bf16").model
        with pytest.raises(RuntimeUserError, match="beyond the KV cache"):
            models[v].forward(torch.tensor([5]), models[v].cache.capacity)
    nat, sca = models[build], models["scalar"]
    assert nat.fast.lib.sq_simd() == K_.EXPECT[build][0] and sca.fast.lib.sq_simd() == 0
    ids = torch.tensor([5, 70, 200, 9, 31, 2, 150, 77])
    nat.forward(ids[:2], 0)
    d = []
    for i in range(2, 8):  # each step from the same cache
        sca.cache.k.copy_(nat.cache.k), sca.cache.v.copy_(nat.cache.v)
        a, b = nat.forward(ids[i:i + 1], i), sca.forward(ids[i:i + 1], i)
        d.append(((a - b).abs().max() / b.abs().max()).item())
    # the same integer arithmetic, float sums in another order: steps agree to ~1e-6, but a
    # last-bit difference can move an activation across a rounding boundary (an int8 code),
    # which shifts that step by about one quantization step (measured <= 1%)
    d.sort()
    assert d[len(d) // 2] < 1e-4 and d[-1] < 0.03, d


@pytest.mark.parametrize("kind,g", [("int4", 32), ("lut4", 32), ("int4", 64)])
@pytest.mark.parametrize("build", kernel_builds(*SIMD))
def test_simd_products_of_rows_ending_in_half_a_quad_agree_with_scalar(tmp_path, monkeypatch, build, kind, g):
    """Rows of K % 128 == 64 columns (hidden 192, intermediate 320; the example's 576): the AVX512
    products (quad order, g32 and g64) end in a 64-column half step whose weight scales are one
    group's (g64) or two (g32). Each SIMD build's decode steps agree with the portable build's from
    the same cache, and its prompt (30 tokens in W4A8-sized chunks: the W4A8 GEMM on every build) with its own decode
    steps over the cache the prompt wrote, up to summation order (the bounds of the test above; a
    prompt against another build's prompt would compare two caches: one int8 code moved early
    shifts every later position)."""
    from sparkq.runtime import load

    src = make_llama(tmp_path / "m", hidden=192, inter=320, layers=2, heads=6, kv_heads=2, seed=4)
    out = tmp_path / "q"
    convert(str(src), str(out), Options(progress=False, method="minmax", group_size=g, kind=kind))
    models = {}
    for v in (build, "scalar"):
        monkeypatch.setenv("SPARKQ_KERNEL", v)
        models[v] = load(str(out), max_model_len=64, kv_dtype="bf16").model
    nat, sca = models[build], models["scalar"]
    assert {lin.g for name, lin in nat.lin.items() if name.startswith("layers.")} == {g}
    t, _ = _w4a8_prompt(nat.fast, 30, seed=7)
    c = nat.forward(t, 0, last_only=False)
    k0, v0 = nat.cache.k.clone(), nat.cache.v.clone()
    steps, d = [], []
    for i in range(len(t)):  # each step from the cache the prompt wrote, on both builds
        nat.cache.k.copy_(k0), nat.cache.v.copy_(v0), sca.cache.k.copy_(k0), sca.cache.v.copy_(v0)
        x, y = nat.forward(t[i:i + 1], i), sca.forward(t[i:i + 1], i)
        steps.append(x)
        d.append(((x - y).abs().max() / y.abs().max()).item())
    d.sort()
    assert d[len(d) // 2] < 1e-4 and d[-1] < 0.03, d
    rel = ((c - torch.cat(steps)).abs().amax(-1) / c.abs().amax(-1)).sort().values
    assert rel[len(rel) // 2] < 1e-4 and rel[-1] < 0.03, rel


def test_build_cache_is_keyed_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKQ_CACHE", str(tmp_path))
    path, secs = K_.build("scalar")
    assert path.parent == tmp_path / "kernels" and path.exists() and secs > 0
    again, secs2 = K_.build("scalar")
    assert again == path and secs2 == 0.0  # cached
    assert not [p for p in path.parent.iterdir() if p != path]  # no temp files left


def test_no_compiler_refuses_rows32_and_runs_bf16_through_torch(tiny_tied, tiny_tied_art, tmp_path):
    """No cc/gcc/clang: a rows32 artifact (whose torch fallback crawled at 0.16 tok/s on the example)
    is refused in one line naming what to install, on either runtime; a bf16 checkpoint still runs,
    through torch, with one warning and the C path's tokens."""
    code = """
import json, sys
from sparkq.runtime import load
m = load(sys.argv[1], max_model_len=32)
out = list(m.stream_ids([5, 70, 200], max_new_tokens=5, stop_ids=[]))
print(json.dumps({"path": m.info.extra["decode_path"], "ids": out}))
"""
    env = {"PATH": str(tmp_path), "CC": "", "SPARKQ_CACHE": str(tmp_path / "empty")}
    import json
    import os
    import subprocess
    import sys
    run = lambda target, e=None: subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True,  # noqa: E731
                                                text=True, env={**os.environ, **(e or {})}, timeout=600)
    p = run(tiny_tied, env)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["path"] == "torch (C decode core unavailable)" and "no C compiler found" in p.stderr
    assert p.stderr.count("C decode path unavailable") == 1
    with_c = run(tiny_tied)
    assert with_c.returncode == 0, with_c.stderr
    c = json.loads(with_c.stdout.strip().splitlines()[-1])
    assert c["path"].startswith("c (") and c["ids"] == r["ids"]
    for flag in ("--torch", "--lite"):
        bad = run_cli("sparkq", "generate", tiny_tied_art, "hi", flag, env=env)
        assert bad.returncode == 2 and "install a C compiler" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    off = run_cli("sparkq", "generate", tiny_tied_art, "hi", "--torch", env={"SPARKQ_KERNEL": "off"})
    assert off.returncode == 2 and "unset SPARKQ_KERNEL" in off.stderr and len(off.stderr.strip().splitlines()) == 1


def test_package_ships_the_source():
    names = {p.name for p in K_.sources()}
    assert {"sq.c", "sq_abi.h", "sq_simd.h", "gemv.c"} <= names
    assert _lib("native").sq_abi() == K_.ABI


@pytest.mark.parametrize("build", kernel_builds())
def test_c_core_matches_the_aten_kernel_on_the_same_codes(build):
    """The same codes packed twice: rows32 through the C core, torch's layout for this CPU
    through `_weight_int4pack_mm_for_cpu` (the fallback, and the reference the issue names).
    Both within the W4A8 budget of fp64, and of each other."""
    from sparkq.formats.layout import host_layout

    n, k, g = 96, 256, 128
    L, w, _, keep = _int4(n, k, g, seed=4)
    codes_sz = keep[1]
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)  # the codes _int4 drew (same seed)
    assert torch.equal(keep[0], torch.from_numpy(pack_rows(codes.numpy(), ROWS32, n)))
    aten_packed = torch.from_numpy(pack_rows(codes.numpy(), host_layout(), n)).view(n, k // 2)
    x = torch.randn(k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x[None], aten_packed, g, codes_sz)[0].double()
    c = _run(_lib(build), L, x.float()).double()
    ref = w @ x.double()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(aten, ref) < 0.01 and rel(c, ref) < 0.02 and rel(c, aten) < 0.02, (rel(aten, ref), rel(c, ref), rel(c, aten))


def test_abi_mirror_is_checked_against_the_library():
    """The ctypes mirror must match the library's own description of its structs: a library that
    laid a field out elsewhere is refused, naming the struct."""
    from sparkq.runtime.core import abi

    lib = _lib("native")
    _, kinds, structs = abi.parse_desc(lib.sq_abi_desc().decode())
    assert kinds == {"int4": 0, "int8": 1, "bf16": 2, "lut4": 3}
    assert structs["sq_model"] == abi._mirror(abi.SqModel) and structs["sq_linear"] == abi._mirror(abi.SqLinear)

    class Moved:  # the library as it would be with sq_model.eps one field later
        def sq_abi(self):
            return abi.ABI

        def sq_abi_desc(self):
            at = abi.SqModel.eps.offset
            return lib.sq_abi_desc().replace(f"eps@{at}".encode(), f"eps@{at + 8}".encode())

    with pytest.raises(K_.KernelUnavailable, match="struct sq_model is laid out as"):
        abi.check(Moved(), "libx.so")


def test_failed_workspace_allocation_frees_what_it_took():
    """sq_work_new with an impossible KV capacity returns NULL, having freed the buffers it had
    allocated (400 failures leave RSS flat; before the fix 200 of them left 7.6 MiB resident)."""
    from sparkq.runtime.procmem import rss_kib

    lib = _lib("native")
    m = K_.SqModel()
    m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.inter, m.vocab = 1, 4096, 32, 8, 128, 8192, 256
    m.cap = 1 << 50  # scores: heads x cap floats
    assert not lib.sq_work_new(ctypes.byref(m))
    before = rss_kib()["RssAnon"]
    for _ in range(400):
        assert not lib.sq_work_new(ctypes.byref(m))
    assert rss_kib()["RssAnon"] - before < 4096, (before, rss_kib()["RssAnon"])


@pytest.mark.parametrize("build", kernel_builds())
def test_glu_activations_match_their_definitions(build):
    """Each build's GLU (the steps' pointwise act(gate) * up: SiLU, GELU-tanh, exact GELU; relu2) against
    float64 definitions; the SIMD exact GELU's erf (Abramowitz-Stegun 7.1.26, 1.5e-7) lanes and the
    scalar tail (erff) both covered, tails of +-40 where exp(-z^2) underflows included."""
    import math
    lib = _lib(build)
    I = 4099  # SIMD lanes and a scalar tail
    g = torch.cat([torch.linspace(-40, 40, 2000), torch.randn(I - 2000, generator=torch.Generator().manual_seed(3)) * 3])
    u = torch.randn(I, generator=torch.Generator().manual_seed(4))
    gu = torch.cat([g, u]).float().contiguous()
    gd, ud = g.double(), u.double()
    want = {0: gd / (1 + torch.exp(-gd)) * ud,
            1: 0.5 * gd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gd + 0.044715 * gd ** 3))) * ud,
            2: 0.5 * gd * (1 + torch.erf(gd / math.sqrt(2))) * ud}
    for act, ref in want.items():
        out = torch.empty(I)
        assert lib.sq_glu(act, gu.data_ptr(), I, out.data_ptr()) == 0
        # relative 2e-5, plus fp32's cancellation in 1 + erf / 1 + tanh where the result is tiny
        bound = 2e-5 * ref.abs() + 1e-6 * (gd.abs() + 1) * ud.abs()
        assert ((out.double() - ref).abs() <= bound).all(), (act, ((out.double() - ref).abs() / bound).max())
    out = torch.empty(I)  # relu2 (Nemotron-H): relu(u)^2 of one row, no gate
    assert lib.sq_glu(3, g.float().contiguous().data_ptr(), I, out.data_ptr()) == 0
    assert torch.equal(out, torch.relu(g.float()).square())
    assert lib.sq_glu(4, gu.data_ptr(), I, torch.empty(I).data_ptr()) == -1
