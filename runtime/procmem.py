"""Process memory accounting shared by the converter and the runtime's instruments.

``rss_kib`` reads /proc/self/status, ``rollup_kib`` /proc/PID/smaps_rollup (PSS),
``RssSampler`` samples in a background thread (peak vs settled), ``resident_bytes``
asks mincore(2) which pages of an address range are resident.
"""
from __future__ import annotations

import threading


def rollup_kib(pid: int | str = "self") -> dict[str, int]:
    """Rss, Pss, Pss_Anon, Pss_File, ... in KiB from /proc/PID/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                out[parts[0][:-1]] = int(parts[1])
    return out


_libc = None


def resident_bytes(addr: int, length: int) -> int:
    """Bytes of [addr, addr+length) whose pages are resident (mincore(2); whole pages)."""
    import ctypes
    import mmap

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if length <= 0:
        return 0
    page = mmap.PAGESIZE
    start = addr - addr % page
    end = addr + length
    npages = (end - start + page - 1) // page
    vec = (ctypes.c_ubyte * npages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(npages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in bytes(vec)) * page


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
