"""Sample this process's resident memory (RssAnon + RssFile) in a background thread."""
from __future__ import annotations

import threading


def rss_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:", "VmHWM:", "VmRSS:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0])
    return out


class RssSampler:
    """``with RssSampler(0.005) as s: ...`` then ``s.peak_kib`` / ``s.start_kib`` (anon + file),
    ``s.peak_anon_kib`` / ``s.start_anon_kib`` (anonymous only: data, not code pages)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak_kib = 0
        self.start_kib = 0
        self.peak_anon_kib = 0
        self.start_anon_kib = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        r = rss_kib()
        v = r.get("RssAnon", 0) + r.get("RssFile", 0) + r.get("RssShmem", 0)
        self.peak_kib = max(self.peak_kib, v)
        self.peak_anon_kib = max(self.peak_anon_kib, r.get("RssAnon", 0))
        return v

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.start_kib = self.sample()
        self.start_anon_kib = self.peak_anon_kib
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.sample()
        return False
