"""The KV cache at long context, bf16 and int8 (int8 codes + a bf16 scale per position and KV
head): teacher-forced logits through the cache at a few thousand positions against transformers'
fp32 compute (the torch prompt path writes the cache, the C decode step reads it: split-K blocks,
sliding windows, every query-group shape of the kernels), the same in the torch-free runtime (C
prompt path + C decode), the cache contents themselves, and the refusals."""
import numpy as np
import pytest
import torch

from helpers import kernel_builds, make_llama, run_cli
from sparkq.convert.pipeline import Options, convert
from sparkq.runtime import load
from sparkq.runtime.errors import RuntimeUserError

N_PROMPT, N_DECODE = 2500, 24  # 10 attention blocks of 256 keys at the end
# query heads per KV head (G) and head_dim chosen to run each path of csrc/attention.c's decode
# kernel: G <= 3 (bf16: 4 keys per score pass; int8: key pairs), G 4..6 (bf16: 2 keys; int8: one key
# at a time; D % 16 != 0: the 8-wide V tail and the 8-code K tail), G > 8 (two passes of 8) with
# D % 8 != 0 (the portable loops on every build), and a sliding window shorter than the context
# (blocks cut from the window's start, not position 0)
SHAPES = {
    "llama-g2-d32": dict(arch="llama", hidden=128, heads=4, kv_heads=2),
    "qwen3-g6-d24": dict(arch="qwen3", hidden=128, heads=12, kv_heads=2, head_dim=24),
    "llama-g16-d20": dict(arch="llama", hidden=128, heads=16, kv_heads=1, head_dim=20),
    "mistral-g3-window": dict(arch="mistral", hidden=192, heads=6, kv_heads=2, sliding_window=700),
}


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def long_ctx(tmp_path_factory):
    """shape -> (bf16 checkpoint, its int4 artifact, token ids, transformers fp32 logits of the last
    N_DECODE + 1 positions), made once per shape"""
    made = {}

    def get(name):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            src = make_llama(d / "m", max_position_embeddings=4096, seed=3, **SHAPES[name])
            ids = torch.randint(0, 256, (N_PROMPT + N_DECODE,), generator=torch.Generator().manual_seed(2)).tolist()
            out = d / "int4"
            convert(str(src), str(out), Options(progress=False, method="minmax"))
            made[name] = (src, out, ids, _hf_logits(src, ids)[N_PROMPT - 1:])
        return made[name]
    return get


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decode_through_a_long_cache_matches_fp32(shape, kernel_build, long_ctx):
    src, _, ids, ref = long_ctx(shape)
    errs = {}
    for kv in ("bf16", "int8"):
        m = load(str(src), max_model_len=N_PROMPT + N_DECODE + 8, kv_budget_mib=64, kv_dtype=kv)
        assert m.model.fast is not None and m.model.cache.dtype == kv  # the C decode step
        last = m.model.forward(torch.tensor(ids[:N_PROMPT]), 0, last_only=True)  # the torch prompt path writes the cache
        steps = [m.model.forward(torch.tensor(ids[i:i + 1]), i) for i in range(N_PROMPT, N_PROMPT + N_DECODE)]
        ours = torch.cat([last] + steps)
        errs[kv] = _rel(ours, ref)
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9, (kv, errs)
    # bf16 compute (activations, weights, the cache) vs fp32: 0.4-0.7% of the logits' norm; the int8
    # cache 0.8-1.2% (measured on these shapes); a wrong block cut, window or scale: of order 1
    assert errs["bf16"] < 0.02, errs
    assert errs["int8"] < errs["bf16"] * 2 + 0.01, errs


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("shape", ["llama-g2-d32", "mistral-g3-window"])
def test_lite_runtime_long_cache_int8_against_bf16_and_its_own_prompt_path(shape, kernel_build, long_ctx):
    """The torch-free runtime (C prompt path and C decode over an int4 artifact): the int8 cache's
    logits at a few thousand positions next to the bf16 cache's, and decode steps next to the
    prompt path's logits for the same positions."""
    from sparkq.runtime.lite import load as load_lite
    _, art, ids, _ = long_ctx(shape)
    out = {}
    for kv in ("bf16", "int8"):
        m = load_lite(str(art), max_model_len=N_PROMPT + N_DECODE + 8, kv_budget_mib=64, threads=2, kv_dtype=kv)
        hid = m.session.prefill(ids, 0, last_only=False)  # every position through the prompt path
        prompt = np.stack([m.session.head(hid[i]).copy() for i in range(N_PROMPT, N_PROMPT + N_DECODE)])
        m.prefill(ids[:N_PROMPT])
        dec = np.stack([m.step(ids[i], i).copy() for i in range(N_PROMPT, N_PROMPT + N_DECODE)])
        assert np.linalg.norm(dec - prompt) / np.linalg.norm(prompt) < 0.02, kv  # A8 decode vs prompt GEMMs
        out[kv] = dec
    rel = np.linalg.norm(out["int8"] - out["bf16"]) / np.linalg.norm(out["bf16"])
    # measured 1.7-1.9% on these random models (large activations, int4 minmax weights); a wrong
    # scale, block or slot gives errors of order 1
    assert 0 < rel < 0.03, rel
    assert (out["int8"].argmax(-1) == out["bf16"].argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("shape", ["llama-g2-d32", "mistral-g3-window"])
def test_long_decode_bits_do_not_depend_on_the_thread_count(shape, kernel_build, long_ctx):
    """The decode attention's work items (KV head x 256-key block) are cut by position only and
    combined in block order, and each thread takes a run of them: logits at 2,500 positions are
    the same bits on 1, 2 and 3 threads (3: the runs' boundaries fall mid-head), both caches."""
    from sparkq.runtime.lite import load as load_lite
    _, art, ids, _ = long_ctx(shape)
    for kv in ("bf16", "int8"):
        outs = []
        for threads in (1, 2, 3):
            m = load_lite(str(art), max_model_len=N_PROMPT + 8, kv_budget_mib=64, threads=threads, kv_dtype=kv)
            m.prefill(ids[:N_PROMPT - 4])
            outs.append(np.stack([m.step(ids[i], i).copy() for i in range(N_PROMPT - 4, N_PROMPT)]))
        assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
        for o in outs[1:]:
            assert np.array_equal(o, outs[0]), (kv, float(np.abs(o - outs[0]).max()))


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_batched_step_over_long_contexts_keeps_each_sequences_bits(kv, kernel_build, long_ctx):
    """Three sequences of 1, 3 and 10 attention blocks (5, 600 and 2,500 positions) in one
    sq_step_many: their items scheduled together over the threads, each row the bits sq_step
    gives that sequence alone."""
    from sparkq.runtime.lite import load as load_lite
    _, art, ids, _ = long_ctx("llama-g2-d32")
    kw = dict(max_model_len=N_PROMPT + 8, kv_budget_mib=64, threads=2, kv_dtype=kv)
    batch, single = load_lite(str(art), slots=3, **kw), load_lite(str(art), **{**kw, "kv_budget_mib": 64 / 3})
    lens = [5, 600, N_PROMPT]
    offs = [i * batch.slot_elems for i in range(3)]
    for n, off in zip(lens, offs):
        batch.session.prefill(ids[:n], 0, kvoff=off)
    got = batch.session.step_many([ids[n] for n in lens], lens, offs)
    for i, n in enumerate(lens):
        single.prefill(ids[:n])
        assert np.array_equal(got[i], single.step(ids[n], n)), (kv, n)


def test_int8_cache_holds_each_row_within_half_a_step_of_bf16(long_ctx):
    """What the C core writes (prompt path and decode step): per (layer, KV head, position) one
    scale s = bf16(max|row| / 127) and codes within +-127; code * s within s/2 (plus the bf16 row's
    own rounding) of the bf16 cache's row for the same tokens (layer 0: later layers' rows differ
    by what the int8 cache changed below them)."""
    from sparkq.runtime.lite import load as load_lite
    _, art, ids, _ = long_ctx("llama-g2-d32")
    n = 300
    a = load_lite(str(art), max_model_len=n + 8, kv_budget_mib=8, threads=2, kv_dtype="bf16")
    b = load_lite(str(art), max_model_len=n + 8, kv_budget_mib=8, threads=2, kv_dtype="int8")
    for m in (a, b):
        m.prefill(ids[:n - 10])
        for i in range(n - 10, n):
            m.step(ids[i], i)
    assert b.k.dtype == np.int8 and b.k_scale.dtype == np.uint16
    # every cache array starts on a cache line, as the torch runtime's do (numpy's large buffers
    # start 16 bytes past one: a 64-byte row then spans two lines)
    assert all(x.ctypes.data % 64 == 0 for x in (a.k, a.v, b.k, b.v, b.k_scale, b.v_scale))
    for codes, scales, ref in ((b.k, b.k_scale, a.k), (b.v, b.v_scale, a.v)):
        c = codes[0, 0, :, :n].astype(np.float32)
        s = (scales[0, 0, :, :n].astype(np.uint32) << 16).view(np.float32)
        r = (ref[0, 0, :, :n].astype(np.uint32) << 16).view(np.float32)
        assert np.abs(c).max() == 127 and np.all(np.abs(c) <= 127)
        assert np.all(s > 0)
        err = np.abs(c * s[..., None] - r)
        assert np.all(err <= s[..., None] * 0.5 * 1.02 + np.abs(r) * 2 ** -8), err.max()


def test_kv_dtype_sizes_the_budget_and_refuses_beyond_it(long_ctx):
    from sparkq.runtime.lite import load as load_lite
    _, art, ids, _ = long_ctx("llama-g2-d32")
    caps = {kv: load_lite(str(art), max_model_len=4000, kv_budget_mib=1, threads=2, kv_dtype=kv).cap for kv in ("bf16", "int8")}
    # head_dim 32: int8 rows + a 2-byte scale are 34 bytes against bf16's 64
    assert caps["int8"] == int(2**20 // (2 * 2 * 2 * 34)) and caps["bf16"] == int(2**20 // (2 * 2 * 2 * 64))
    m = load_lite(str(art), max_model_len=4000, kv_budget_mib=1, threads=2, kv_dtype="int8")
    with pytest.raises(RuntimeUserError, match=f"capacity of {caps['int8']} tokens.*--kv-budget-mib"):
        m.prefill((ids * 2)[:caps["int8"] + 1])
    with pytest.raises(RuntimeUserError, match="--kv-dtype bf16 or int8"):
        load_lite(str(art), kv_dtype="q4_0")
    p = run_cli("sparkq", "generate", str(art), "hi", "--kv-dtype", "fp16", "--max-new-tokens", "2")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--kv-dtype bf16 or int8" in p.stderr, p.stderr
    p = run_cli("sparkq", "generate", str(art), "hi", "--kv-dtype", "bf16", "--max-new-tokens", "2", "--json")
    assert p.returncode == 0, p.stderr


def test_depth_and_rounding_tools_run(long_ctx, tmp_path):
    """tools/depthbench.py and tools/kvquant.py (the commands docs/long-context.md quotes) report
    what they claim; no timing asserted"""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    _, art, _, _ = long_ctx("llama-g2-d32")
    p = subprocess.run([sys.executable, str(root / "tools" / "depthbench.py"), str(art), "--depth", "300", "--steps", "4",
                        "--threads", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["kv_dtype"] == "int8" and r["step_ms_at_8"] > 0 and r["step_ms_at_300"] > 0 and r["ratio_q1"] <= r["ratio_q3"]
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    p = subprocess.run([sys.executable, str(root / "tools" / "kvquant.py"), str(art), "--corpus", str(tmp_path / "t.txt"),
                        "--tokens", "200", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert {(r["rows"], r["group"]) for r in rows} == {("K", 32), ("V", 32)}  # head_dim 32: one group size
    assert all(0 < r["median_rel_err"] < 0.02 and r["bytes_per_row"] == 34 for r in rows)
    p = subprocess.run([sys.executable, str(root / "tools" / "kvquant.py"), str(art), "--corpus", str(tmp_path / "t.txt"),
                        "--tokens", "200", "--channels", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    ch = json.loads(p.stdout)
    for name in ("K", "V"):  # per layer (2 here): largest channel's range over the median's >= 1, row maxima > 0
        assert len(ch[name]["largest_over_median"]) == 2 and all(r >= 1 for r in ch[name]["largest_over_median"])
        assert all(m > 0 for m in ch[name]["row_max_mean"])


@pytest.mark.parametrize("cache", ["int8", "bf16"])
def test_attention_bench_tool_runs_and_its_builds_agree(cache, tmp_path):
    """tools/attnbench.c (docs/long-context.md's kernel timings) compiles against csrc and runs;
    every build this CPU runs (the runtime's flags for each: portable, AVX2, AVX512) gives the
    portable build's attention output (the checksum of every head's result, index-weighted) on an
    odd-length cache of 2,000+ positions, at head_dim
    40 (an 8-code K tail) and 64 with 5 query heads per KV head (AVX512: the int8 cache's V on
    64 channels per pass, heads in passes of 4)"""
    import re
    import subprocess
    from pathlib import Path
    from sparkq.runtime.core import builds
    root = Path(__file__).resolve().parents[1]
    cc = builds.compiler()
    assert cc, "no C compiler"
    exes = {}
    for name in builds.host_builds():
        exes[name] = tmp_path / name
        p = subprocess.run([cc, "-O2", "-std=c11", "-fopenmp", *builds.BUILDS[name][0], "-I", str(root / "runtime/core/csrc"),
                            str(root / "tools/attnbench.c"), "-o", str(exes[name]), "-lm"], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
    # 2 layers, 2,051 positions (8 full blocks + 3: an odd last key), (query heads, KV heads, head_dim)
    for heads, kv, dim in [(6, 2, 40), (10, 2, 64)]:
        out = {}
        for name, exe in exes.items():
            p = subprocess.run([str(exe), "2", "2051", str(heads), str(kv), str(dim), "1" if cache == "int8" else "0", "0", "3"],
                               capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "2"})
            assert p.returncode == 0, p.stderr
            m = re.search(r"median ([\d.]+) ms per step .* \(checksum (\S+)\)", p.stdout)
            assert m and p.stdout.startswith(f"{cache} cache, 2 layers x {kv} KV heads x 2051 positions, head_dim {dim}, "
                                             f"G {heads // kv}"), p.stdout
            out[name] = float(m.group(2))
        ref = out["scalar"]
        # measured: builds within 4e-7 of each other; one key of 2,051 dropped from V moves it 7e-4
        assert ref != 0 and all(abs(x - ref) <= 1e-5 * abs(ref) for x in out.values()), (dim, out)


def test_products_bench_tool_runs_and_batched_rows_are_single_rows(tmp_path):
    """tools/gemvbench.c (docs/serving.md's per-linear timings) compiles against csrc and runs on
    every build this CPU runs; every token through the batched products (each its own activations;
    one to twenty tokens: partial and several four-token tiles, AVX2's interleaved zero-term table
    and, at 20 x 192 groups, its scalar fallback) gives its result alone bit for bit (a 6144-column
    linear: the AVX512 products' column spans at four tokens, two rows at a time, and an odd last row
    of a partial chunk), and the builds agree with the portable one"""
    import re
    import subprocess
    from pathlib import Path
    from sparkq.runtime.core import builds
    root = Path(__file__).resolve().parents[1]
    cc = builds.compiler()
    assert cc, "no C compiler"
    out = {}
    for name in builds.host_builds():
        exe = tmp_path / name
        p = subprocess.run([cc, "-O2", "-std=c11", "-fopenmp", *builds.BUILDS[name][0], "-I", str(root / "runtime/core/csrc"),
                            str(root / "tools/gemvbench.c"), "-o", str(exe), "-lm"], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        for k, g, n in [(6144, 128, 75), (6144, 32, 80), (6144, 256, 80), (2048, 64, 80), (2048, 256, 80)]:
            checks = []
            for m in (1, 3, 4, 5, 8) + ((20,) if g == 32 else ()):
                p = subprocess.run([str(exe), str(k), str(n), str(g), str(m), "1", "1"], capture_output=True, text=True,
                                   timeout=300, env={"OMP_NUM_THREADS": "2"})
                assert p.returncode == 0, p.stderr
                r = re.search(rf"K={k} N={n} g={g} M={m} copies=1: best .* check (\S+), tokens unlike alone (\d+)$",
                              p.stdout.strip())
                assert r, p.stdout
                assert r.group(2) == "0", (name, k, g, m, p.stdout)
                checks.append(r.group(1))
            assert len(set(checks)) == 1, (name, k, g, checks)
            out[(name, k, g)] = float(checks[0])
    for (name, k, g), v in out.items():
        ref = out[("scalar", k, g)]
        assert ref != 0 and abs(v - ref) <= 1e-4 * abs(ref), (name, k, g, v, ref)


def test_exact_sums_bench_tool_matches_its_scalar_mirror(tmp_path):
    """tools/exactbench.c (docs/notes/performance-history.md "Exact group sums": the cost of exact
    per-group integer sums in the AVX512-VNNI products) compiles against csrc on an AVX512-VNNI
    CPU, and its kernel gives its scalar mirror's bits (the float operations a tile epilogue would
    follow) for one to four tokens, g32 and g128, a half quad at the end (K = 576), 12 of 16
    groups in a batch (K = 1536 g128); bad arguments: exit 2"""
    import re
    import subprocess
    from pathlib import Path
    from sparkq.runtime.core import builds
    if "avx512-vnni" not in builds.host_builds():
        pytest.skip("this CPU cannot run the avx512-vnni build")
    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / "exactbench"
    p = subprocess.run([builds.compiler(), "-O2", "-std=c11", "-fopenmp", *builds.BUILDS["avx512-vnni"][0], "-I",
                        str(root / "runtime/core/csrc"), str(root / "tools/exactbench.c"), "-o", str(exe), "-lm"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    for k, n, g, t in [(2048, 64, 32, 1), (576, 48, 32, 4), (1536, 32, 128, 3), (2048, 48, 128, 2), (1024, 16, 32, 3)]:
        p = subprocess.run([str(exe), str(k), str(n), str(g), str(t), "1", "1"], capture_output=True, text=True,
                           timeout=120, env={"OMP_NUM_THREADS": "2"})
        r = re.search(r"exact vs its mirror: (\d+) rows differ; error vs fp64 a8 (\S+) exact (\S+)", p.stdout)
        assert p.returncode == 0 and r and r.group(1) == "0", (k, g, t, p.stdout, p.stderr)
        assert float(r.group(3)) < 2 * float(r.group(2)), p.stdout  # the same A8 error budget, give or take
    assert subprocess.run([str(exe), "2048", "64", "64"], capture_output=True, timeout=60).returncode == 2
