"""Untrusted artifacts and interrupted work: fuzzing, SIGKILL at many points, shared pages."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_artifact import mutate, run_case
from helpers import make_llama, run_cli
from sparkq.formats import Artifact
from sparkq.formats import constants as C
from sparkq.runtime import RuntimeUserError, load


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory):
    from sparkq.convert.pipeline import Options, convert
    d = tmp_path_factory.mktemp("fuzz")
    src = make_llama(d / "src", hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=320)
    convert(str(src), str(d / "art"), Options(progress=False))
    return d / "art"


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_fuzz_mutated_artifacts_fail_typed_or_load_verified(fuzz_base, tmp_path_factory, seed):
    art = tmp_path_factory.mktemp("case") / "a"
    shutil.copytree(fuzz_base, art)
    mutate(random.Random(seed), art)
    assert run_case(art) in ("error", "ok")  # anything else raises: a finding
    shutil.rmtree(art.parent)


def test_bit_flip_caught_by_verify_load(fuzz_base, tmp_path):
    art = tmp_path / "a"
    shutil.copytree(fuzz_base, art)
    info = Artifact.open(art).infos["layers.0.gate_up.qweight"]
    with open(art / C.WEIGHTS_FILE, "r+b") as f:
        f.seek(info.start + 3)
        b = f.read(1)
        f.seek(info.start + 3)
        f.write(bytes([b[0] ^ 4]))
    load(str(art))  # without verify the flip is not noticed (by design: verify costs a full read)
    with pytest.raises(RuntimeUserError, match="layers.0.gate_up.qweight"):
        load(str(art), verify=True)


def test_config_inconsistent_with_tensors(fuzz_base, tmp_path):
    for key, val, want in (("num_hidden_layers", 3, "linears"), ("intermediate_size", 256, "manifest"),
                           ("vocab_size", 10**9, "out of range"), ("hidden_size", "64", "integer")):
        art = tmp_path / key
        shutil.copytree(fuzz_base, art)
        cfg = json.loads((art / "config.json").read_text())
        cfg[key] = val
        (art / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(RuntimeUserError, match=want):
            load(str(art))


def test_huge_declared_shape_allocates_nothing(fuzz_base, tmp_path):
    import struct
    art = tmp_path / "a"
    shutil.copytree(fuzz_base, art)
    raw = (art / C.WEIGHTS_FILE).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    h["lm_head.qweight"]["shape"] = [2**39, 2**39]
    hb = json.dumps(h).encode()
    hb += b" " * ((-(8 + len(hb))) % 64)  # keep the data section aligned: only the shape is wrong
    (art / C.WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    with pytest.raises(RuntimeUserError, match="lm_head.qweight"):
        load(str(art))


def _convert_cmd(src, out):
    return [str(Path(sys.executable).parent / "spark-convert"), str(src), str(out), "--quiet", "--force", "--method", "minmax"]


def test_sigkill_at_10_points(tmp_path):
    """SIGKILL a conversion at 10 points spread over its run: OUT is absent or a complete artifact
    that verifies (here: the previous good one, replaced only by an atomic rename), and the
    next run cleans the dead run's temp dir."""
    src = make_llama(tmp_path / "src", hidden=512, inter=1024, layers=6, heads=8, kv_heads=4, vocab=4096)
    out = tmp_path / "out"
    t = time.perf_counter()
    subprocess.run(_convert_cmd(src, out), check=True)
    full = time.perf_counter() - t
    shutil.rmtree(out)
    outcomes = {"absent": 0, "complete": 0}
    for i in range(10):
        if i == 5:  # second half: an older complete OUT exists and --force replaces it
            subprocess.run(_convert_cmd(src, out), check=True)
        p = subprocess.Popen(_convert_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(full * (0.05 + 0.9 * (i % 5) / 5 + 0.09 * (i // 5)))  # the halves kill at interleaved points
        p.send_signal(signal.SIGKILL)
        p.wait()
        if out.exists():
            assert Artifact.open(out).verify() is None
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
    assert outcomes["absent"] + outcomes["complete"] == 10
    leftovers = [x for x in tmp_path.iterdir() if ".sparkq-tmp-" in x.name]
    subprocess.run(_convert_cmd(src, out), check=True)
    assert Artifact.open(out).verify() is None
    assert not [x for x in tmp_path.iterdir() if ".sparkq-tmp-" in x.name], leftovers
    print("kill outcomes", outcomes, "leftover temp dirs before the next run:", len(leftovers))


HOLD = r"""
import sys, time
from sparkq.runtime import load
m = load(sys.argv[1], kv_budget_mib=4)
m.generate("hello there", max_new_tokens=4)
print("ready", flush=True)
time.sleep(60)
"""


def _file_pss_rss(pid: int, path: str) -> tuple[int, int]:
    pss = rss = 0
    cur = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" not in parts[0]:
                cur = len(parts) >= 6 and parts[5] == path
            elif cur and parts[0] == "Pss:":
                pss += int(parts[1])
            elif cur and parts[0] == "Rss:":
                rss += int(parts[1])
    return pss, rss


def test_two_processes_share_weight_pages(example_art):
    wpath = os.path.realpath(example_art / C.WEIGHTS_FILE)
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, str(example_art)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        (pss0, rss0), (pss1, rss1) = (_file_pss_rss(p.pid, wpath) for p in procs)
        roll = [open(f"/proc/{p.pid}/smaps_rollup").read() for p in procs]
        print("weights mapping: pss", pss0, pss1, "rss", rss0, rss1, "KiB")
        assert rss0 > 50 * 1024 and rss1 > 50 * 1024  # each maps (most of) the 71 MiB of weights
        # shared pages: each process is charged about half of what it maps
        assert pss0 < 0.6 * rss0 and pss1 < 0.6 * rss1
        assert all("Pss:" in r for r in roll)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_limits_clear_errors(tiny_tied_art, tmp_path):
    m = load(str(tiny_tied_art), max_model_len=32)
    for kw, want in ((dict(max_new_tokens=0), "at least 1"), (dict(max_new_tokens=-5), "at least 1"),
                     (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(RuntimeUserError, match=want):
            m.generate("ab", **kw)
    with pytest.raises(RuntimeUserError, match="empty prompt"):
        m.generate("")
    m.tokenizer.chat_template = "{{ messages[0].content }}{{ unknown_var }}"
    with pytest.raises(RuntimeUserError, match="unknown_var"):
        m.generate("hi", chat=True)
    for args, want in ((["--max-model-len", "100000"], "max_position_embeddings"), (["--max-new-tokens", "0"], "at least 1"),
                       (["--max-model-len", "0"], "positive")):
        p = run_cli("sparkq", "generate", tiny_tied_art, "hello", *args)
        assert p.returncode == 2 and want in p.stderr and p.stderr.count("\n") == 1, p.stderr
