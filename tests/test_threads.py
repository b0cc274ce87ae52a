"""Threads that yield when another program takes a core (runtime/core/threads.py), and the C core's
outputs, the same bits at any thread count, so a count that changes mid-generation changes no token."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import kernel_builds, make_llama
from sparkq.runtime.core import threads as T


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """A default conversion (GPTQ, the split head: its refinement too) of a model whose products
    span many work-stealing blocks"""
    from sparkq.convert.pipeline import Options, convert
    d = tmp_path_factory.mktemp("threads")
    src = make_llama(d / "src", hidden=256, inter=768, layers=2, heads=4, kv_heads=2, vocab=512, tied=True)
    convert(str(src), str(d / "q"), Options(progress=False))
    return d / "q"


def _outputs(art, n):
    from sparkq.runtime.lite import load
    m = load(str(art), threads=n, max_model_len=512, kv_budget_mib=8, slots=3, kv_dtype="int8")
    s = m.session
    assert s.gov.pinned == (n is not None) and (n is None or s.gov.threads() == n)  # None: adaptive, a call per chunk
    ids = [(7 * i + 3) % 500 for i in range(300)]  # > one 256-key attention block: the split over keys
    out = {"prefill": s.prefill(ids[:290], 0, last_only=False, chunk=96).copy()}
    out["steps"] = np.stack([s.step(ids[j], j).copy() for j in range(290, 300)])
    offs = [i * m.slot_elems for i in range(3)]
    for i, o in enumerate(offs[1:]):
        s.prefill(ids[:40 + 100 * i], 0, kvoff=o)
    out["step_many"] = s.step_many([5, 6, 7], [300, 40, 140], offs).copy()
    out["head"] = s.head(out["prefill"][-1]).copy()
    return out


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_every_output_is_the_same_bits_at_any_thread_count(art, kernel_build):
    one = _outputs(art, 1)
    for n in (2, 3, None):
        other = _outputs(art, n)
        for k, v in one.items():
            assert np.array_equal(v, other[k]), (k, n)


class FakeProc:
    """run_delay_ns / idle_ticks driven by the test: per window, threads' worth of waiting and idle cores"""

    def __init__(self, monkeypatch, cpus=2):
        self.t, self.delay, self.idle, self.total, self.cpus = 0.0, 0, 0, 0, cpus
        monkeypatch.setattr(T.time, "monotonic", lambda: self.t)
        monkeypatch.setattr(T, "run_delay_ns", lambda: self.delay)
        monkeypatch.setattr(T, "idle_ticks", lambda cpus: (self.idle, self.total))
        self.others = 0  # other programs' runnable threads at the first call
        monkeypatch.setattr(T, "runnable_others", lambda: self.others)

    def window(self, waiting: float, idle_cores: float, dt: float = 0.1):
        self.t += dt
        self.delay += int(waiting * dt * 1e9)
        self.total += int(100 * dt * self.cpus)
        self.idle += int(100 * dt * idle_cores)


def test_governor_drops_a_thread_while_its_threads_wait_and_adds_it_back_when_cores_idle(monkeypatch):
    f = FakeProc(monkeypatch, cpus=4)
    monkeypatch.setattr(T, "_cpus", lambda: {0, 1, 2, 3})
    g = T.Governor(4)  # the first readings
    assert g.threads() == 4  # the first call: no other program runnable
    for want in (3, 2, 1, 1):  # a busy machine: one thread fewer per window, down to one
        f.window(waiting=0.8, idle_cores=0.0, dt=1.01 * T.WINDOW)
        assert g.threads() == want
    f.window(waiting=0.0, idle_cores=0.2, dt=1.01 * T.UP_WINDOW)  # the other programs still hold the cores
    assert g.threads() == 1
    f.window(waiting=0.0, idle_cores=1.5, dt=T.WINDOW / 2)  # within a window: no new reading, no change
    assert g.threads() == 1
    f.window(waiting=0.0, idle_cores=1.5, dt=1.01 * T.WINDOW)  # idle, but not yet for UP_WINDOW
    assert g.threads() == 1
    for want in (2, 3, 4, 4):  # the cores free again, one thread more per UP_WINDOW
        f.window(waiting=0.0, idle_cores=1.5, dt=1.01 * T.UP_WINDOW)
        assert g.threads() == want
    f.window(waiting=0.1, idle_cores=0.0, dt=1.01 * T.WINDOW)  # a quiet machine's background waits: kept
    assert g.threads() == 4 and (g.changes, g.low) == (6, 1)


def test_the_first_call_starts_on_the_cores_other_programs_leave(monkeypatch):
    f = FakeProc(monkeypatch, cpus=4)
    monkeypatch.setattr(T, "_cpus", lambda: {0, 1, 2, 3})
    for others, want in ((0, 4), (1, 3), (3, 1), (9, 1)):
        f.others = others
        g = T.Governor(4)
        assert (g.threads(), g.low) == (want, want)
    f.others = 2
    g = T.Governor(4, pinned=True)
    assert g.threads() == 4


def test_a_prompt_takes_every_thread_and_more_beside_other_programs_where_layers_are_large(monkeypatch):
    f = FakeProc(monkeypatch, cpus=2)
    monkeypatch.setattr(T, "_cpus", lambda: {0, 1})
    big, small = T.Governor(2, oversubscribe=True), T.Governor(2)
    assert (big.prompt_threads(), small.prompt_threads()) == (2, 2)  # quiet: every thread
    f.others = 1
    assert big.prompt_threads() == 2 * T.OVERSUB  # large layers: more threads take a larger share
    assert small.prompt_threads() == 1  # small layers: the cores the other program leaves
    assert T.Governor(2, pinned=True, oversubscribe=True).prompt_threads() == 2  # --threads N: N


def test_a_pinned_count_never_moves(monkeypatch):
    f = FakeProc(monkeypatch)
    g = T.Governor(2, pinned=True)
    for _ in range(4):
        f.window(waiting=2.0, idle_cores=0.0)
        assert g.threads() == 2
    assert T.Governor(1).pinned  # one thread: nothing to adapt


def test_the_real_signals_are_read():
    assert T.run_delay_ns() >= 0
    idle, total = T.idle_ticks(T._cpus())
    assert 0 <= idle <= total and total > 0


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_a_generation_beside_busy_programs_runs_on_fewer_threads_then_returns(art):
    """Spinning programs on every CPU: the decode loop's count drops below the maximum; once they
    stop, it returns to it. (Behaviour, not speed: the counts, each within a few seconds.)"""
    from sparkq.runtime.lite import load
    m = load(str(art), max_model_len=512, kv_budget_mib=8)
    s = m.session
    if s.gov.max < 2:
        pytest.skip("one CPU: nothing to adapt")
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(len(T._cpus()))]
    try:
        low, t0, pos = s.gov.max, time.monotonic(), 0
        s.prefill([1, 2, 3], 0)
        while time.monotonic() - t0 < 20 and low == s.gov.max:
            s.step(5, 3 + pos % 400)
            pos += 1
            low = min(low, s.gov.n)
        assert low < s.gov.max, "the count never dropped with every CPU busy"
    finally:
        for p in spin:
            p.kill()
            p.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20 and s.gov.n < s.gov.max:
        s.step(5, 3 + pos % 400)
        pos += 1
    assert s.gov.n == s.gov.max, "the count did not return once the cores were free"


def test_a_conversion_is_the_same_bytes_whatever_thread_count_a_session_left(tmp_path):
    """The converter's C calls run on one fixed count (convert/ccore.py): a governed session in the same
    process that last ran on fewer threads does not change a conversion's bytes (some converter
    reductions give other bits at another count)."""
    from sparkq.convert.pipeline import Options, convert
    from sparkq.runtime import core
    src = make_llama(tmp_path / "s", seed=2)
    lib, out = core.load(), []
    for n in (2, 1):
        lib.sq_set_threads(n)  # what a session's last call leaves
        convert(str(src), str(tmp_path / f"o{n}"), Options(progress=False))
        out.append((tmp_path / f"o{n}" / "model.sparkq.safetensors").read_bytes())
    assert out[0] == out[1]


@pytest.mark.parametrize("env, want", [({}, "10000"), ({"GOMP_SPINCOUNT": "123"}, "123"),
                                       ({"OMP_WAIT_POLICY": "passive"}, None)])
def test_barrier_spins_are_short_unless_the_user_chose(env, want):
    """libgomp's spin before a waiting thread sleeps (lib.py SPINCOUNT), set before the core loads,
    never over the user's own choice."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = ("import os; from sparkq.runtime import core; lib = core.try_load(); "
            "print(os.environ.get('GOMP_SPINCOUNT') if lib is not None else 'no core')")
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    got = out.stdout.strip()
    if got == "no core":
        pytest.skip("no C core on this machine")
    assert got == str(want)
