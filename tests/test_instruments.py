"""sparkq memory / fidelity / bench / synth: accounting and invariants (no timing assertions)."""
import json
import mmap
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, run_cli
from sparkq.runtime import load
from sparkq.runtime.measure.memory import ledger
from sparkq.runtime.procmem import resident_bytes


def test_mincore_residency_follows_touching(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"\0" * (64 * mmap.PAGESIZE))
    s = torch.UntypedStorage.from_file(str(f), shared=False, nbytes=64 * mmap.PAGESIZE)
    t = torch.empty(0, dtype=torch.uint8).set_(s)
    import os
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop it from the page cache
    os.close(fd)
    before = resident_bytes(t.data_ptr(), t.numel())
    t[: 8 * mmap.PAGESIZE].sum()  # touch 8 pages
    after = resident_bytes(t.data_ptr(), t.numel())
    assert after >= before and after >= 8 * mmap.PAGESIZE
    import ctypes
    n = 16 << 20
    mm = mmap.mmap(-1, n)  # fresh anonymous mapping: untouched pages are not resident
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    mm[0] = 1
    assert resident_bytes(addr, n) < n // 2
    mm.write(b"\1" * n)
    assert resident_bytes(addr, n) == n


def test_ledger_arithmetic(tiny_tied_art, tiny_untied, tmp_path):
    from sparkq.convert.pipeline import Options, convert
    from sparkq.formats import Artifact
    for kv in ("bf16", "int8"):
        m = load(str(tiny_tied_art), max_model_len=64, kv_budget_mib=0.5, kv_dtype=kv)
        led = ledger(m)
        cats = led["categories"]
        spec = m.model.spec
        row = 2 * spec.head_dim if kv == "bf16" else spec.head_dim + 2  # int8 codes + one bf16 scale
        per_tok = 2 * spec.layers * spec.kv_heads * row
        assert cats["kv cache"]["bytes"] == m.capacity * per_tok == m.info.kv_bytes
        assert cats["kv cache"]["regions"] == (2 if kv == "bf16" else 4)  # k, v (+ their scales)
    assert cats["rope tables"]["bytes"] == 2 * 64 * spec.head_dim * 2
    art = Artifact.open(tiny_tied_art)
    weights = sum(t.nbytes for n, t in art.infos.items() if not n.startswith("_pad."))
    w_cats = ("int4 weights", "scales/zeros", "embedding/head", "norms")
    assert sum(cats[c]["bytes"] for c in w_cats if c in cats) == weights  # tied head counted once
    assert cats["embedding/head"]["regions"] == 2  # lm_head qweight + scales (embedding is the same)
    assert all(cats[c]["resident_anon"] == 0 for c in w_cats)  # file-backed
    convert(str(tiny_untied), str(tmp_path / "u"), Options(progress=False))
    mu = load(str(tmp_path / "u"), max_model_len=64)
    # untied: both stored, each split by default (qweight, scales_zeros, residual, residual_scales)
    assert ledger(mu)["categories"]["embedding/head"]["regions"] == 8


def test_memory_cli(tiny_tied_art):
    p = run_cli("sparkq", "memory", tiny_tied_art, "--json", "--kv-budget-mib", "1", "--max-model-len", "64")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert [s["stage"] for s in r["stages"]] == ["python", "import torch", "import sparkq", "after load",
                                                  "after warm-up", "after generation"]
    assert r["import_cost_mib"]["torch"] > 20 and r["peak_mib"] >= r["settled_mib"] > 0
    assert r["ledger"]["categories"]["kv cache"]["bytes"] <= 2**20
    bad = run_cli("sparkq", "memory", tiny_tied_art, "--rope-len-from-config", "--max-model-len", "64", "--json")
    r2 = json.loads(bad.stdout)
    assert r2["ledger"]["categories"]["rope tables"]["bytes"] > r["ledger"]["categories"]["rope tables"]["bytes"]
    assert run_cli("sparkq", "memory", tiny_tied_art).returncode == 0


def test_fidelity_of_reference_against_itself(tiny_tied, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    p = run_cli("sparkq", "fidelity", tiny_tied, "--reference", tiny_tied, "--corpus", corpus,
                "--tokens", "200", "--window", "64", "--new-tokens", "8", "--kv-dtype", "bf16", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    tf = r["teacher_forced"]
    assert tf["top1_agreement"] == 1.0 and tf["kl_mean"] == 0.0 and tf["tokens"] == 200
    assert tf["ppl_artifact"] == tf["ppl_reference"]
    assert r["greedy"]["identical"] == r["greedy"]["prompts"] == 12
    # the artifact side on its default (int8) cache against the bf16 one: the cache alone, small
    p = run_cli("sparkq", "fidelity", tiny_tied, "--reference", tiny_tied, "--corpus", corpus,
                "--tokens", "200", "--window", "64", "--new-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert (r["kv_dtype"], r["reference_kv_dtype"]) == ("int8", "bf16")
    assert 0 < r["teacher_forced"]["kl_mean"] < 0.01, r["teacher_forced"]


def test_fidelity_int4_vs_reference(tiny_tied, tiny_tied_art, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Some held-out text for measuring. " * 40)
    p = run_cli("sparkq", "fidelity", tiny_tied_art, "--reference", tiny_tied, "--corpus", corpus,
                "--tokens", "128", "--window", "64", "--new-tokens", "4")
    assert p.returncode == 0, p.stderr
    assert "KL(ref || artifact)" in p.stdout and "saturate" in p.stdout and "(prefill auto)" in p.stdout
    p = run_cli("sparkq", "fidelity", tiny_tied_art, "--reference", tiny_tied, "--corpus", tmp_path / "nope.txt")
    assert p.returncode == 2 and "no such file" in p.stderr
    p = run_cli("sparkq", "fidelity", tiny_tied_art, "--reference", tiny_tied, "--corpus", corpus, "--prefill", "fp8")
    assert p.returncode == 2 and "--prefill 'fp8'" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_synth_convert_bench(tmp_path):
    p = run_cli("sparkq", "synth", tmp_path / "s", "--shape", "smollm2-135m", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert 130e6 < s["parameters"] < 140e6
    assert run_cli("spark-convert", tmp_path / "s", tmp_path / "q", "--quiet", "--method", "minmax").returncode == 0
    p = run_cli("sparkq", "bench", tmp_path / "q", "--passes", "1", "--pp", "32", "--tg", "4", "--depth", "40",
                "--arm", "nodeq=prefill_dequant=0", "--arm", "passive=OMP_WAIT_POLICY=PASSIVE", "--arm", "lite=lite=1",
                "--arm", "bf16kv=lite=1,kv_dtype=bf16", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert set(r["arms"]) == {"control", "nodeq", "passive", "lite", "bf16kv"} and r["depth"] == 40
    # the KV cache's element type per arm, and its real bytes (head_dim 64: 66 bytes a row against 128)
    assert {n: a["kv_dtype"] for n, a in r["arms"].items()} == {**{n: "int8" for n in r["arms"]}, "bf16kv": "bf16"}
    assert r["arms"]["bf16kv"]["kv_budget_mib"] / r["arms"]["lite"]["kv_budget_mib"] == pytest.approx(128 / 66, rel=0.01)
    for a in r["arms"].values():
        for m in ("load_s", "ttft_s", "pp_tok_s", "tg_tok_s", "peak_rss_mib", "settled_rss_mib", "run_peak_rss_mib",
                  "after_run_rss_mib"):
            assert a[m]["median"] > 0 and a[m]["min"] <= a[m]["median"] <= a[m]["max"]
        assert a["decode_bytes_per_token"] > 60e6 and 0 < a["decode_pct_of_ceiling"]
        assert a["peak_rss_mib"]["median"] >= a["settled_rss_mib"]["median"]
        assert a["run_peak_rss_mib"]["median"] >= a["after_run_rss_mib"]["median"]
        # the memory bound: the weights file (~83 MiB here) + the arm's KV budget + 150 MiB
        w = sum(f.stat().st_size for f in (tmp_path / "q").glob("*.safetensors")) / 2**20
        assert a["rss_bound_mib"] == pytest.approx(w + a["kv_budget_mib"] + 150) and 0 < a["kv_budget_mib"] < 10
    assert r["arms"]["control"]["ratio_to_control"]["tg_tok_s"] == 1.0 and r["read_ceiling_gb_s"] > 0
    # a probe before each arm's run; each arm's % of ceiling from its own probes
    assert len(r["read_ceiling"]["values"]) == r["passes"] * len(r["arms"])
    assert all(len(a["read_ceiling"]["values"]) == r["passes"] for a in r["arms"].values())
    assert r["arms"]["passive"]["env"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    # prompts through sq_prefill by default; --prefill kernel (prefill_dequant=0) keeps the torch model
    assert r["arms"]["control"]["prefill_path"] == "c", r["arms"]["control"]
    assert r["arms"]["nodeq"]["prefill_path"].startswith("torch (--prefill kernel/dequant"), r["arms"]["nodeq"]
    # the torch-free runtime: same weights and KV, no torch (~200 MiB) in the process
    lite, ctl = r["arms"]["lite"], r["arms"]["control"]
    assert "no torch" in lite["decode_path"] and lite["decode_bytes_per_token"] == ctl["decode_bytes_per_token"]
    assert lite["run_peak_rss_mib"]["max"] < ctl["run_peak_rss_mib"]["max"] - 100, (lite, ctl)
    assert lite["run_peak_rss_mib"]["max"] <= lite["rss_bound_mib"], lite
    bad = run_cli("sparkq", "bench", tmp_path / "q", "--arm", "x=bogus=1")
    assert bad.returncode == 2 and "bogus" in bad.stderr


def test_plot_option(tiny_tied_art, tmp_path):
    import importlib.util
    png = tmp_path / "m.png"
    p = run_cli("sparkq", "memory", tiny_tied_art, "--max-model-len", "64", "--plot", png)
    if importlib.util.find_spec("matplotlib") is None:
        assert p.returncode == 2 and "pip install matplotlib" in p.stderr
    else:
        assert p.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gemmbench_runs(tmp_path):
    """The prefill-product benchmark (tools/gemmbench.py, docs/performance.md) runs and reports every
    arm: dequantize + torch GEMM, each prompt build this CPU runs (amx, avx512-bf16, avx512-vnni;
    elsewhere the native one), and on AMX CPUs the tile GEMM forced at any row count."""
    from sparkq.runtime import core
    if core.compiler() is None:
        pytest.skip("no C compiler")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gemmbench.py"), "--shape", "128,48,64", "--rows", "40",
                        "--rounds", "1", "--reps", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    (r,) = json.loads(p.stdout)
    assert (r["k"], r["n"], r["group"], r["rows"]) == (128, 48, 64, 40)
    assert r["dequant_gops"] > 0 and r["dequant_dtype"] in ("float32", "bfloat16")
    from sparkq.runtime.core.builds import PROMPT_BUILDS
    want = [b for b in PROMPT_BUILDS if b in core.host_builds()] or [core.resolve_variant("native")]
    assert r["builds"] == want and all(r[f"{b}_gops"] > 0 and r[f"{b}_ratio"] > 0 for b in want)
    assert ("tiles_gops" in r) == ("amx" in want)


def test_bench_ratios_pair_the_arms_of_a_pass():
    """vs control / vs llama.cpp: the median of same-pass ratios, not a ratio of medians (a box
    that slows down in one pass slows every arm of it)."""
    from sparkq.runtime.measure.bench import paired_ratio
    a, b = {"tg": {"values": [10.0, 30.0, 40.0]}}, {"tg": {"values": [5.0, 40.0, 20.0]}}
    assert paired_ratio(a, b, "tg") == 2.0  # ratios 2, 0.75, 2 (medians: 30 / 20 = 1.5)
    assert paired_ratio(a, {"tg": {"values": [5.0, 0.0, 20.0]}}, "tg") is None
