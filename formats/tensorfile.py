"""A safetensors file whose every tensor starts on a 64-byte boundary.

Layout (standard safetensors): ``u64 little-endian header length | JSON header | data``.
We control alignment ourselves: the JSON header is padded with spaces so the data
section starts at a multiple of ``ALIGNMENT``, and where a tensor's size would leave the
next one unaligned a ``_pad.I`` uint8 tensor fills the gap (safetensors requires the
data section to be covered contiguously, so padding is a named tensor, not a hole).
The file therefore opens with the ``safetensors`` library as well as with our reader.

The reader validates everything before any byte of tensor data is used: header length
against the file size, JSON shape, dtype names, shape x dtype = byte length, offsets
inside the file, contiguity (no overlap, no hole), and alignment.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from math import prod

from . import constants as C

MAX_HEADER_BYTES = 64 << 20


class TensorFileError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _nbytes(dtype: str, shape) -> int:
    return prod(shape) * C.DTYPE_BYTES[dtype]


def plan_layout(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str], align: bool = True):
    """Header dict and data-section size for tensors written in the given order (``align`` False: no
    padding tensors, a plain checkpoint other tools read)."""
    header: dict = {"__metadata__": dict(metadata)}
    off = 0
    npad = 0
    for name, dtype, shape in entries:
        if align and off % C.ALIGNMENT:
            gap = C.ALIGNMENT - off % C.ALIGNMENT
            header[f"{C.PAD_PREFIX}{npad}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [off, off + gap]}
            npad += 1
            off += gap
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    return header, off


def encode_header(header: dict) -> bytes:
    raw = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
    total = 8 + len(raw)
    pad = (-total) % C.ALIGNMENT
    raw += b" " * pad
    return struct.pack("<Q", len(raw)) + raw


class TensorFileWriter:
    """Writes tensors sequentially, in planned order, hashing each one (sha256).

    The bytes reach the file in whole, aligned STAGE-byte writes (the last one excepted): Linux
    (ext4, 6.18 here) then caches the file in 2 MiB folios, which the runtime's
    MADV_HUGEPAGE mapping maps with PMD entries (docs/performance.md "Memory"); the
    same bytes written in unaligned pieces of tensor size were cached in small folios. One
    staging buffer of STAGE bytes is the only extra memory."""

    STAGE = 4 << 20

    def __init__(self, path: str, entries, metadata: dict[str, str], align: bool = True):
        self.header, self.data_size = plan_layout(entries, metadata, align)
        self.order = [e[0] for e in entries]
        self.head = encode_header(self.header)
        self.f = open(path, "wb", buffering=0)
        self.stage = bytearray()
        self.fpos = 0  # bytes handed to the file
        self._out(self.head)
        self.pos = 0  # within data section
        self.next = 0
        self.digests: dict[str, str] = {}
        self._cur = None

    def begin(self, name: str):
        if self._cur is not None:
            raise RuntimeError(f"tensor {self._cur[0]} not finished")
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise RuntimeError(f"tensor {name} written out of planned order")
        s, e = self.header[name]["data_offsets"]
        if s > self.pos:
            self._out(b"\0" * (s - self.pos))
            self.pos = s
        self._cur = (name, e, hashlib.sha256())

    def write(self, data) -> None:
        name, end, h = self._cur
        mv = memoryview(data).cast("B")
        if self.pos + mv.nbytes > end:
            raise RuntimeError(f"tensor {name}: more bytes than its shape holds")
        h.update(mv)
        self._out(mv)
        self.pos += mv.nbytes

    def _out(self, mv) -> None:
        """Stage bytes; write every whole STAGE-aligned piece."""
        mv = memoryview(mv).cast("B")
        while mv.nbytes:
            room = self.STAGE - (self.fpos + len(self.stage)) % self.STAGE
            take = min(room, mv.nbytes)
            if not self.stage and take == self.STAGE:  # aligned and whole: no copy
                self._write_all(mv[:take])
                self.fpos += take
            else:
                self.stage += mv[:take]
                if take == room:
                    self._write_all(memoryview(self.stage))
                    self.fpos += len(self.stage)
                    self.stage = bytearray()
            mv = mv[take:]

    def _write_all(self, mv) -> None:
        while mv.nbytes:
            n = self.f.write(mv)
            mv = mv[n:]

    def end(self) -> str:
        name, end, h = self._cur
        if self.pos != end:
            raise RuntimeError(f"tensor {name}: {end - self.pos} bytes missing")
        self.digests[name] = h.hexdigest()
        self._cur = None
        self.next += 1
        return self.digests[name]

    def put(self, name: str, data) -> str:
        self.begin(name)
        self.write(data)
        return self.end()

    def close(self) -> None:
        if self.next != len(self.order):
            raise RuntimeError(f"{len(self.order) - self.next} planned tensors were not written")
        if self.stage:
            self._write_all(memoryview(self.stage))
            self.fpos += len(self.stage)
            self.stage = bytearray()
        os.fsync(self.f.fileno())
        self.f.close()


def read_header(path: str, *, require_alignment: bool = True):
    """Validate a safetensors file's header against the file; returns (infos, metadata).

    Never allocates in proportion to a declared size before checking it against the
    file size.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise TensorFileError(f"{path}: file is {size} bytes, too short for a safetensors header; the file is truncated, re-download or re-convert it")
            (hlen,) = struct.unpack("<Q", first)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise TensorFileError(f"{path}: header length {hlen} exceeds the file ({size} bytes); the file is truncated or corrupt")
            raw = f.read(hlen)
    except OSError as e:
        raise TensorFileError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TensorFileError(f"{path}: header is not valid JSON ({e.__class__.__name__}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: header is not a JSON object; the file is corrupt")
    data_start = 8 + hlen
    data_size = size - data_start
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TensorFileError(f"{path}: __metadata__ must map strings to strings")
    infos: dict[str, TensorInfo] = {}
    for name, ent in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(ent, dict):
            raise TensorFileError(f"{where}: entry is not an object")
        dtype, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if dtype not in C.DTYPE_BYTES:
            raise TensorFileError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise TensorFileError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise TensorFileError(f"{where}: bad data_offsets {offs!r}")
        s, e = offs
        if not 0 <= s <= e <= data_size:
            raise TensorFileError(f"{where}: data_offsets {offs} outside the data section ({data_size} bytes); the file is truncated or corrupt")
        if _nbytes(dtype, shape) != e - s:
            raise TensorFileError(f"{where}: {dtype}{shape} needs {_nbytes(dtype, shape)} bytes but offsets span {e - s}")
        if require_alignment and not name.startswith(C.PAD_PREFIX) and (data_start + s) % C.ALIGNMENT:
            raise TensorFileError(f"{where}: not {C.ALIGNMENT}-byte aligned; re-convert with spark-convert")
        infos[name] = TensorInfo(name, dtype, tuple(shape), data_start + s, e - s)
    pos = data_start
    for t in sorted(infos.values(), key=lambda t: (t.start, t.nbytes)):
        if t.start != pos:
            kind = "overlaps the previous tensor" if t.start < pos else "leaves a hole before it"
            raise TensorFileError(f"{path}: tensor {t.name!r} {kind}; the file is corrupt")
        pos = t.start + t.nbytes
    if pos != size:
        raise TensorFileError(f"{path}: tensors cover {pos} of {size} bytes; the file is truncated or has trailing data")
    return infos, meta
