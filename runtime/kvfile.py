"""The prompt cache's file: a prompt prefix's KV cache (and recurrent states) for one model setup.

    MAGIC (8) | version u32 | header length u32 | sha256 of the header (32) | header (JSON, UTF-8)
    | zero padding to a 64-byte boundary | payload (arrays, each at a 64-byte offset)

The header names the model setup it belongs to (``key``: promptcache.py derives it from the
artifact's manifest digest, the KV dtype, the C-core build and the prompt path's slicing), the
prompt's token ids, the positions it holds (``n``), every array (name, dtype, shape, offset and
length in the payload) and the payload's sha256. A reader trusts nothing it has not checked: the
header by its digest when the file is listed (``read_header``), the payload by its digest when it
is used (``read_payload``). Writers write a temp name in the same directory and rename it, so a
killed write leaves a temp file (``TEMP_SUFFIX``), never a file under a cache name.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"SPARKQKV"
VERSION = 1
SUFFIX = ".sqkv"  # a complete file
TEMP_SUFFIX = ".sqkv.tmp"  # a write in progress (or killed): <name>.<pid>.sqkv.tmp
ALIGN = 64
_FIXED = struct.Struct("<8sII32s")  # magic, version, header length, header sha256

# header keys
K_KEY, K_IDS, K_N, K_ARRAYS, K_PAYLOAD_SHA, K_STATES = "key", "ids", "n", "arrays", "payload_sha256", "states"
A_NAME, A_DTYPE, A_SHAPE, A_OFFSET, A_NBYTES = "name", "dtype", "shape", "offset", "nbytes"
DTYPES = ("uint16", "int8", "float32")  # bf16 bits, int8 codes, recurrent states


class KVFileError(Exception):
    """A file that is not a complete, intact prompt-cache file (the message says what is wrong)."""


def _pad(n: int) -> int:
    return -n % ALIGN


def write(path: Path, key: str, ids: list[int], n: int, arrays: dict[str, np.ndarray],
          states: dict[int, list[str]] | None = None, chunk: int = 1 << 24) -> tuple[dict, int]:
    """Write arrays (name -> array) for the first n of ids atomically to path; returns (its header,
    the payload's offset), as read_header gives them.
    ``states``: recurrent-state position -> the names of the arrays holding that state."""
    descs, off = [], 0
    for name, a in arrays.items():
        if a.dtype.name not in DTYPES:
            raise ValueError(f"{name}: dtype {a.dtype} is not one of {DTYPES}")
        descs.append({A_NAME: name, A_DTYPE: a.dtype.name, A_SHAPE: list(a.shape), A_OFFSET: off, A_NBYTES: a.nbytes})
        off += a.nbytes + _pad(a.nbytes)
    h = hashlib.sha256()
    for a in arrays.values():
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        h.update(bytes(_pad(a.nbytes)))
    fields = {K_KEY: key, K_IDS: [int(t) for t in ids], K_N: int(n), K_ARRAYS: descs, K_PAYLOAD_SHA: h.hexdigest(),
              K_STATES: {str(p): v for p, v in (states or {}).items()}}
    header = json.dumps(fields, separators=(",", ":")).encode()
    head = _FIXED.pack(MAGIC, VERSION, len(header), hashlib.sha256(header).digest()) + header
    head += bytes(_pad(len(head)))
    tmp = path.with_name(f"{path.name[:-len(SUFFIX)]}.{os.getpid()}{TEMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for a in arrays.values():
                flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                for i in range(0, flat.size, chunk):
                    f.write(flat[i:i + chunk].data)
                f.write(bytes(_pad(a.nbytes)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return fields, len(head)


def read_header(path: Path) -> tuple[dict, int]:
    """(header, payload offset) of a file, its header checked against its digest; KVFileError."""
    try:
        with open(path, "rb") as f:
            fixed = f.read(_FIXED.size)
            if len(fixed) < _FIXED.size:
                raise KVFileError("shorter than its fixed header (truncated)")
            magic, version, hlen, digest = _FIXED.unpack(fixed)
            if magic != MAGIC:
                raise KVFileError("not a sparkq prompt-cache file (bad magic)")
            if version != VERSION:
                raise KVFileError(f"file version {version}, this sparkq reads {VERSION}")
            if hlen > 64 << 20:
                raise KVFileError(f"header length {hlen} is implausible")
            raw = f.read(hlen)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise KVFileError(f"cannot read it ({e.strerror})") from None
    if len(raw) < hlen:
        raise KVFileError("truncated in its header")
    if hashlib.sha256(raw).digest() != digest:
        raise KVFileError("its header does not match its digest (a corrupted byte)")
    try:
        header = json.loads(raw)
        start = _FIXED.size + hlen + _pad(_FIXED.size + hlen)
        end = max((a[A_OFFSET] + a[A_NBYTES] + _pad(a[A_NBYTES]) for a in header[K_ARRAYS]), default=0)
        for a in header[K_ARRAYS]:
            if a[A_DTYPE] not in DTYPES or int(np.prod(a[A_SHAPE])) * np.dtype(a[A_DTYPE]).itemsize != a[A_NBYTES]:
                raise KVFileError(f"array {a[A_NAME]!r} has a bad dtype or shape")
        if not isinstance(header[K_KEY], str) or not isinstance(header[K_IDS], list) or header[K_N] > len(header[K_IDS]):
            raise KVFileError("its header lacks a key, token ids or a valid length")
    except (ValueError, KeyError, TypeError) as e:
        raise KVFileError(f"its header is malformed ({e})") from None
    if size != start + end:
        raise KVFileError(f"{size} bytes where its header says {start + end} (truncated or extended)")
    return header, start


def read_payload(path: Path, header: dict, start: int) -> dict[str, np.ndarray]:
    """The file's arrays (name -> read-only array over a mapping of the file), after its payload
    matched its digest; KVFileError otherwise."""
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise KVFileError(f"cannot map it ({e})") from None
    payload = mm[start:]
    if hashlib.sha256(payload).hexdigest() != header[K_PAYLOAD_SHA]:
        raise KVFileError("its payload does not match its digest (a corrupted byte)")
    return {a[A_NAME]: payload[a[A_OFFSET]:a[A_OFFSET] + a[A_NBYTES]].view(a[A_DTYPE]).reshape(a[A_SHAPE])
            for a in header[K_ARRAYS]}
