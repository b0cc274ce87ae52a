"""The prompt cache on disk (runtime/promptcache.py, runtime/kvfile.py): a restarted engine reads a
prompt's prefix back instead of prefilling it and answers the same bits; its fault cases (a write
killed half-way, a truncated file, a flipped byte in the header or the payload, another artifact's
files, the size bound); hybrids' recurrent states; the CLI server with the real openai client and
`sparkq chat` across restarts."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import make_chat_llama, make_hybrid
from sparkq.convert.pipeline import Options, convert


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    d = tmp_path_factory.mktemp("pcache")
    src = make_chat_llama(d / "m", layers=2, seed=5)
    (src / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 256}))
    out = {"int4": d / "int4", "lut4": d / "lut4"}
    convert(str(src), str(out["int4"]), Options(progress=False, method="minmax"))
    convert(str(src), str(out["lut4"]), Options(progress=False, method="minmax", kind="lut4"))
    hy = make_hybrid(d / "hy", layers=4, seed=3)
    out["hybrid"] = d / "hyq"
    convert(str(hy), str(out["hybrid"]), Options(progress=False, method="minmax"))
    return out


def _engine(art, disk=None, slots=2, kv="int8", **kw):
    from sparkq.runtime.lite import load
    from sparkq.runtime.serve.engine import Engine
    m = load(str(art), max_model_len=512, kv_budget_mib=8, threads=2, slots=slots, kv_dtype=kv)
    return Engine(m, prefill_slice=16, disk=disk, **kw)


def _disk(d, **kw):
    return {"directory": str(d), "min_tokens": 32, "milestone": 32, "log": kw.pop("log", lambda s: None), **kw}


def _ids(n, seed):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 250, n)]


def _run(art, disk, prompts, n=8, **kw):
    e = _engine(art, disk, **kw)
    try:
        out = [e.generate(list(p), n, ignore_eos=True) for p in prompts]
    finally:
        e.close()  # (the queued writes finish)
    return out, e.load()


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_a_restarted_engine_reads_the_prefix_back_and_answers_the_same(arts, tmp_path, kv):
    """Engine 1 prefills a 100-token system prompt + question and writes it; engine 2 (a new
    process's model: fresh KV cache) gets the same system prompt + another question: it reads the
    shared prefix from the file (whole slices where the prompt GEMM needs them) and answers what an
    engine without the cache answers, bit for bit."""
    system = _ids(100, 1)
    q1, q2 = system + _ids(20, 2), system + _ids(12, 3)
    (a1,), st1 = _run(arts["int4"], _disk(tmp_path), [q1], kv=kv)
    assert a1["cached_tokens"] == 0 and st1["prompt_cache"]["written"] == 1
    files = list(tmp_path.glob("*.sqkv"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))
    (b1, b2), st2 = _run(arts["int4"], _disk(tmp_path), [q2, q1], kv=kv)
    (c1, c2), _ = _run(arts["int4"], None, [q2, q1], kv=kv)
    assert [b1["ids"], b2["ids"]] == [c1["ids"], c2["ids"]] and b2["ids"] == a1["ids"]
    from sparkq.runtime.core import load
    grid = 16 if load().sq_prefill_bf16() else 1  # the engine's reuse grid: its 16-token slices
    assert b1["cached_tokens"] == 100 // grid * grid  # the shared system prompt, from the file
    assert st2["prompt_cache"]["hits"] == 2  # q1 again: the file holds more of it than q2's slot
    assert b2["cached_tokens"] == (len(q1) - 1) // grid * grid
    # neither prompt wrote a file: one held all of q1, and all but 12 (< min_tokens) of q2
    assert st2["prompt_cache"]["written"] == 0 and list(tmp_path.glob("*.sqkv")) == files


def test_fault_cases_are_ignored_with_one_line_and_never_trusted(arts, tmp_path):
    """A flipped payload byte (found when read: the prompt is prefilled), a flipped header byte and
    a truncated file (found when listed), an unfinished write whose process is gone: each one log
    line, the file removed, the answer the uncached one. Another artifact's file is left alone."""
    prompt = _ids(80, 4)
    (want,), _ = _run(arts["int4"], None, [prompt])

    def fresh(d):
        _run(arts["int4"], _disk(d), [prompt[:60] + _ids(5, 9)])
        (f,) = d.glob("*.sqkv")
        return f

    cases = {}
    for case in ("payload", "header", "truncated"):
        d = tmp_path / case
        f = fresh(d)
        raw = bytearray(f.read_bytes())
        if case == "payload":
            raw[-100] ^= 1
        elif case == "header":
            raw[60] ^= 1
        else:
            raw = raw[:len(raw) - 64]
        f.write_bytes(bytes(raw))
        logs = []
        (got,), st = _run(arts["int4"], _disk(d, log=logs.append), [prompt])
        assert got["ids"] == want["ids"] and got["cached_tokens"] == 0, case
        assert len(logs) == 1 and f.name in logs[0], (case, logs)
        cases[case] = logs[0]
        assert not f.exists()
    assert "payload does not match" in cases["payload"] and "header does not match" in cases["header"]
    assert "truncated" in cases["truncated"]
    # another artifact (the same checkpoint as lut4): its own files only, the others left alone
    d = tmp_path / "other"
    f = fresh(d)
    logs = []
    (got,), st = _run(arts["lut4"], _disk(d, log=logs.append), [prompt])
    assert got["cached_tokens"] == 0 and f.exists() and len(logs) == 1 and "another model" in logs[0]
    assert st["prompt_cache"]["hits"] == 0 and len(list(d.glob("*.sqkv"))) == 2  # its own prompt written too
    # a write killed half-way (SIGKILL inside kvfile.write): a temp file, never a cache name
    d = tmp_path / "killed"
    d.mkdir()
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from pathlib import Path
        from sparkq.runtime import kvfile
        real = os.fsync
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        kvfile.write(Path({str(d)!r}) / "x.sqkv", "k", [1, 2], 2, {{"k": np.zeros(1 << 20, np.uint16)}})
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert r.returncode == -signal.SIGKILL
    assert [p.name.endswith(".sqkv.tmp") for p in d.iterdir()] == [True] and not list(d.glob("*.sqkv"))
    logs = []
    (got,), _ = _run(arts["int4"], _disk(d, log=logs.append), [prompt])
    assert got["ids"] == want["ids"] and len(logs) == 1 and "unfinished write" in logs[0]
    assert not list(d.glob("*.tmp")) and len(list(d.glob("*.sqkv"))) == 1


def test_the_directory_is_bounded_least_recently_used_first(arts, tmp_path):
    """Three prompts' files in a directory bounded at about two: the least recently used goes (a
    file read back counts as used); a file larger than the bound is never written."""
    ps = [_ids(64, s) for s in (11, 12, 13)]
    e = _engine(arts["int4"], _disk(tmp_path))
    try:
        e.generate(ps[0], 2, ignore_eos=True)
        e.disk.flush()
        size = next(tmp_path.glob("*.sqkv")).stat().st_size
    finally:
        e.close()
    bound = int(2.5 * size)
    for p in (ps[1], ps[0], ps[2]):  # ps[0] read back (used) before ps[2] is written
        time.sleep(0.05)  # distinct modification times
        _run(arts["int4"], _disk(tmp_path, max_bytes=bound), [p])
    left = {json.loads(f.read_bytes()[48:48 + int.from_bytes(f.read_bytes()[12:16], "little")])["ids"][0]
            for f in tmp_path.glob("*.sqkv")}
    assert left == {ps[0][0], ps[2][0]}  # ps[1] was the least recently used
    _, st = _run(arts["int4"], _disk(tmp_path / "tiny", max_bytes=size // 4), [ps[1]])
    assert st["prompt_cache"]["written"] == 0 and not list((tmp_path / "tiny").glob("*.sqkv"))


def test_a_hybrid_models_states_come_back_at_kept_positions(arts, tmp_path):
    """Qwen3.5-style hybrid (Gated DeltaNet + attention): the file holds the recurrent states at the
    milestones and the last slice boundaries; a restart with a shared 70-token prefix restarts from
    the state at 64 (the last milestone in it) and answers what the uncached engine answers."""
    system = _ids(70, 21)
    q1, q2 = system + _ids(30, 22), system + _ids(9, 23)
    (a1,), _ = _run(arts["hybrid"], _disk(tmp_path), [q1])
    (f,) = tmp_path.glob("*.sqkv")
    (b,), st = _run(arts["hybrid"], _disk(tmp_path), [q2])
    (c,), _ = _run(arts["hybrid"], None, [q2])
    assert b["ids"] == c["ids"] and b["cached_tokens"] == 64 and st["prompt_cache"]["hits"] == 1


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port):
    import http.client
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


def _sparkq():
    return [os.path.join(os.path.dirname(sys.executable), "sparkq")]


def test_cli_server_restart_with_the_openai_client_and_chat(arts, tmp_path):
    """`sparkq serve --prompt-cache DIR`: stopped (SIGINT) and started again, the same long system
    prompt with another question reports its prefix as cached (usage.prompt_tokens_details) and
    answers as a server without the cache does; `sparkq chat --prompt-cache DIR` in two runs: the
    second reads the system prompt back."""
    import openai
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer plainly and cite item {i}." for i in range(8))

    def ask(cache, question):
        port = _free_port()
        cmd = _sparkq() + ["serve", str(arts["int4"]), "--port", str(port), "--parallel", "1", "--max-model-len", "512",
                           "--threads", "2", "--kv-budget-mib", "16", "--model-name", "m"] + (["--prompt-cache", str(cache)] if cache else [])
        p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(240):  # the model loads (and the C core compiles) before the port answers
                if p.poll() is not None or _health(port):
                    break
                time.sleep(0.5)
            assert p.poll() is None, p.communicate()[1]
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            r = c.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])
        finally:
            p.send_signal(signal.SIGINT)
            err = p.communicate(timeout=60)[1]
        assert p.returncode == 0, err
        return r, err

    cache = tmp_path / "cache"
    r1, err = ask(cache, "What is item 3?")
    assert "prompt cache in" in err and r1.usage.prompt_tokens > 256 and r1.usage.prompt_tokens_details.cached_tokens == 0
    assert len(list(cache.glob("*.sqkv"))) == 1
    r2, _ = ask(cache, "And item 7?")
    r3, _ = ask(None, "And item 7?")
    assert r2.choices[0].message.content == r3.choices[0].message.content
    assert r2.usage.prompt_tokens_details.cached_tokens > 256 and r3.usage.prompt_tokens_details.cached_tokens == 0
    # chat: the first run writes its first turn's prompt, the second reads the system prompt back
    cmd = _sparkq() + ["chat", str(arts["int4"]), "--system", system, "--max-new-tokens", "6", "--max-model-len", "512",
                       "--prompt-cache", str(tmp_path / "chat")]
    runs = [subprocess.run(cmd, input=f"{q}\n/exit\n", capture_output=True, text=True, timeout=300)
            for q in ("What is item 3?", "And item 7?")]
    assert all(r.returncode == 0 for r in runs), runs
    assert "read from the prompt cache" not in runs[0].stderr and "read from the prompt cache" in runs[1].stderr
    assert len(list((tmp_path / "chat").glob("*.sqkv"))) == 1  # the second: all but a few tokens were in it


def test_prompt_cache_flags_are_checked(arts, tmp_path):
    """--prompt-cache with --no-prefix-cache, a bad bound, chat on the torch runtime: one line, exit 2."""
    base = _sparkq()
    cases = [(["serve", str(arts["int4"]), "--prompt-cache", str(tmp_path), "--no-prefix-cache"], "--no-prefix-cache"),
             (["serve", str(arts["int4"]), "--prompt-cache", str(tmp_path), "--prompt-cache-mib", "0"], "must be > 0"),
             (["chat", str(arts["int4"]), "--prompt-cache", str(tmp_path), "--torch"], "torch-free runtime")]
    for args, needle in cases:
        r = subprocess.run(base + args, input="", capture_output=True, text=True, timeout=300)
        lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("sparkq: native")]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, r.stderr)
    assert not list(tmp_path.iterdir())
