"""How many threads the next C call runs on (``Governor``): the configured count while the process's
threads get their cores, one fewer at a time while another program takes cores, back up while cores
sit idle. ``--threads N`` (``pinned``) keeps N.

Signals, read between two C calls (never inside one), at most every ``WINDOW`` seconds:
- down: the kernel's run-delay of this process's threads (``/proc/self/task/*/schedstat``, field 2:
  time runnable but waiting for a CPU). A thread that lost its core waits there while the others
  spin at the step's barriers; ``WAIT_DOWN`` threads' worth of waiting per second drops one thread.
- first call: as many threads as cores that other programs' runnable threads leave
  (``/proc/loadavg``), so a first long prompt does not start on taken cores;
- up: idle time of the CPUs this process may run on (``/proc/stat``, idle + iowait; steal is
  not idle) over ``UP_WINDOW``: ``IDLE_UP`` idle cores' worth adds one thread back.

Nothing else depends on the count: every C output is the same bits at any thread count
(tests/test_threads.py), so a count that changes mid-generation changes no token.
"""
from __future__ import annotations

import os
import time

WINDOW = 0.02      # s between run-delay readings (~40 us each: 0.2% of the window)
WAIT_DOWN = 0.3    # threads' worth of run-delay per second that drops one thread
UP_WINDOW = 0.2    # s of idle time behind a step up (/proc/stat counts in 10 ms ticks)
IDLE_UP = 0.6      # idle cores' worth over UP_WINDOW that adds one thread back
# weights per layer (parameters) from which a prompt runs on more threads than cores while other
# programs take some (prompt_threads); measured on 2 cores beside one spinner: the Qwen3-1.7B shape
# (50M a layer) 146 tok/s on 4 threads vs 126 on 1, SmolLM2-135M (4M) ~1250 on 4 vs ~1600 on 1
OVERSUB_PARAMS = 16e6
# a prompt's threads per configured thread beside other programs (large layers): measured there,
# 2 cores, one spinner, pp512 on 2/4/6/8 threads 132/142/156/167 tok/s (0.52x-0.65x of quiet), two
# spinners 4/6/8 threads 133/148/154: 6 threads keep more of the quiet speed than llama.cpp's
# default keeps (0.58x / 0.46x) while the other programs keep a seventh of the CPUs (one spinner)
OVERSUB = 3


def _cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _task_files(name: str):
    """The contents (bytes) of /proc/self/task/*/NAME, one per thread of this process (a thread that
    ended meanwhile is skipped); OSError where /proc is not there."""
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/{name}", "rb") as f:
                yield f.read()
        except OSError:
            continue


def run_delay_ns() -> int:
    """Summed run-delay (ns) of this process's threads, or -1 where schedstat is unreadable."""
    try:
        return sum(int(b.split()[1]) for b in _task_files("schedstat"))
    except (OSError, IndexError, ValueError):
        return -1


def _runnable_own() -> int:
    """This process's threads runnable right now (state R in /proc/self/task/*/stat)"""
    return sum(b.rsplit(b")", 1)[1].split()[0] == b"R" for b in _task_files("stat"))


def runnable_others() -> int:
    """Threads of other programs runnable right now: /proc/loadavg's running count less this
    process's own (its tokenizer's pool may still be running); the median of five reads, so a
    passing thread, or one of ours changing state between the two reads, is not counted. 0 if
    unreadable."""
    def running() -> int:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    try:
        got = sorted(running() - _runnable_own() for _ in range(5))
    except (OSError, IndexError, ValueError):
        return 0
    return max(0, got[2])


def idle_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(idle + iowait, all) clock ticks of these CPUs since boot (/proc/stat), None if unreadable."""
    idle = total = 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu") or line[3:4] == b" ":
                    continue
                parts = line.split()
                if int(parts[0][3:]) in cpus:
                    v = [int(x) for x in parts[1:9]]
                    idle += v[3] + v[4]
                    total += sum(v)
    except (OSError, ValueError):
        return None
    return idle, total


class Governor:
    """The thread count of one runtime's C calls (``threads()`` before each call)."""

    def __init__(self, threads: int, pinned: bool = False, oversubscribe: bool = False):
        self.max = self.n = self.low = max(1, int(threads))
        self.oversubscribe = oversubscribe  # prompt_threads: more threads than cores while others run
        self.pinned = pinned or self.max == 1
        self.cpus = _cpus()
        self.changes = 0  # how often the count moved; low: the fewest it ran (the stats line)
        self._wait = self._idle = None  # the last (time, run-delay) reading; (time, idle ticks) behind a step up
        self._first = not self.pinned
        if not self.pinned:
            self._wait = (time.monotonic(), run_delay_ns())
            self._idle = (self._wait[0], idle_ticks(self.cpus))

    def _set(self, n: int, now: float) -> None:
        self.n, self.changes, self.low = n, self.changes + 1, min(self.low, n)
        self._idle = (now, idle_ticks(self.cpus))  # idle time counts from the change

    def threads(self) -> int:
        if self.pinned:
            return self.n
        now = time.monotonic()
        if self._first:  # the first call (a whole prompt, often): as many threads as cores no other program runs on
            self._first = False
            n = max(1, min(self.max, len(self.cpus) - runnable_others()))
            if n < self.n:
                self._set(n, now)
            self._wait = (now, run_delay_ns())
            return self.n
        if now - self._wait[0] < WINDOW:
            return self.n
        last, self._wait = self._wait, (now, run_delay_ns())
        if last[1] < 0 or self._wait[1] < 0:
            return self.n
        waiting = (self._wait[1] - last[1]) / 1e9 / (now - last[0])  # threads' worth of waiting for a CPU
        if waiting >= WAIT_DOWN and self.n > 1:
            self._set(self.n - 1, now)
        elif self.n < self.max and now - self._idle[0] >= UP_WINDOW:
            cur, before = idle_ticks(self.cpus), self._idle[1]
            self._idle = (now, cur)
            if cur and before and cur[1] > before[1] and \
                    (cur[0] - before[0]) / (cur[1] - before[1]) * len(self.cpus) >= IDLE_UP:
                self._set(self.n + 1, now)
        return self.n

    def prompt_threads(self) -> int:
        """A prompt's count. Quiet: every thread. While other programs' threads are runnable:
        OVERSUB times the configured count for a model whose layers are large enough
        (``oversubscribe``), else the cores the others leave. A prompt's products hand out small
        blocks to whichever thread is free, and a thread that waits at a barrier soon sleeps
        (lib.py: GOMP_SPINCOUNT), so extra threads take a larger share of the CPUs from the other
        programs, but each barrier may wait for a thread the scheduler has just set aside: a small
        layer's barriers come too often for that to pay (docs/performance.md "A busy machine")."""
        if self.pinned:
            return self.n
        others = runnable_others()
        if not others:
            return self.max
        return OVERSUB * self.max if self.oversubscribe else max(1, min(self.max, len(self.cpus) - others))

    def after_prompt(self) -> None:
        """A prompt's call ended: the next run-delay window starts here (a prompt's threads wait for
        each other's wake-ups, which says nothing of other programs)."""
        if not self.pinned:
            self._wait = (time.monotonic(), run_delay_ns())
