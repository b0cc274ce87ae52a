"""Artifact fuzzing: mutate a valid small artifact and load it as a stranger's download.

Every case must end in sparkq's own typed error (one line) or in a successful load that
passes ``verify`` and runs a forward pass: never a crash, a hang, or another exception.

    python tests/fuzz_artifact.py --cases 10000      # `make fuzz`
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

WEIGHTS, MANIFEST, CONFIG = "model.sparkq.safetensors", "sparkq.json", "config.json"
WEIRD = [0, -1, 1, 7, 63, 64, 2**31, 2**40, 2**63, -2**63, 1.5, "64", None, [], {}, True, "avx9000", ""]


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _mutate_value(rng: random.Random, v):
    r = rng.random()
    if r < 0.4:
        return rng.choice(WEIRD)
    if isinstance(v, int) and not isinstance(v, bool):
        return v + rng.choice([-64, -2, -1, 1, 2, 64, v])
    if isinstance(v, list) and v:
        v = list(v)
        i = rng.randrange(len(v))
        v[i] = _mutate_value(rng, v[i])
        return v
    return rng.choice(WEIRD)


def _mutate_json_obj(rng: random.Random, d: dict, depth: int = 0):
    if not isinstance(d, dict) or not d:
        return
    k = rng.choice(sorted(d, key=str))
    r = rng.random()
    if r < 0.15:
        del d[k]
    elif isinstance(d[k], dict) and depth < 3 and r < 0.7:
        _mutate_json_obj(rng, d[k], depth + 1)
    else:
        d[k] = _mutate_value(rng, d[k])


def mutate(rng: random.Random, art: Path) -> str:
    kind = rng.choice(["header_json", "header_bytes", "data_bytes", "truncate", "manifest", "config",
                       "json_syntax", "delete_file", "extend"])
    w = art / WEIGHTS
    if kind == "header_json":
        h, data = _header(w)
        if rng.random() < 0.2:
            h[f"bogus{rng.randrange(9)}"] = {"dtype": "U8", "shape": [rng.choice([1, 2**40])], "data_offsets": [0, 1]}
        else:
            _mutate_json_obj(rng, h)
        _write_header(w, h, data)
    elif kind == "header_bytes":
        raw = bytearray(w.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(8 + n)] ^= 1 << rng.randrange(8)
        w.write_bytes(bytes(raw))
    elif kind == "data_bytes":
        raw = bytearray(w.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(8 + n, len(raw))] ^= 1 << rng.randrange(8)
        w.write_bytes(bytes(raw))
    elif kind == "truncate":
        f = art / rng.choice([WEIGHTS, WEIGHTS, MANIFEST, CONFIG, "tokenizer.json"])
        raw = f.read_bytes()
        f.write_bytes(raw[: rng.randrange(len(raw))])
    elif kind in ("manifest", "config"):
        f = art / (MANIFEST if kind == "manifest" else CONFIG)
        d = json.loads(f.read_text())
        for _ in range(rng.randint(1, 3)):
            _mutate_json_obj(rng, d)
        f.write_text(json.dumps(d))
    elif kind == "json_syntax":
        f = art / rng.choice([MANIFEST, CONFIG, "tokenizer_config.json"])
        raw = f.read_bytes()
        i = rng.randrange(len(raw))
        f.write_bytes(raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:])
    elif kind == "delete_file":
        (art / rng.choice([WEIGHTS, MANIFEST, CONFIG, "tokenizer.json"])).unlink()
    elif kind == "extend":
        with open(w, "ab") as f:
            f.write(bytes(rng.randrange(256) for _ in range(rng.choice([1, 64, 4096]))))
    return kind


class Hang(Exception):
    pass


def _alarm(*_):
    raise Hang()


def run_case(art: Path) -> str:
    """'error' (a typed one-line error) or 'ok' (loaded, verified, ran); raises otherwise."""
    from sparkq.runtime import RuntimeUserError, load

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        m = load(str(art), verify=True, max_model_len=32, kv_budget_mib=1)
        m.logits([1, 2, 3])
        if m.tokenizer is not None:
            m.generate("ab", max_new_tokens=2)
        return "ok"
    except RuntimeUserError as e:
        msg = str(e)
        assert msg and "\n" not in msg, repr(msg)
        return "error"
    finally:
        signal.alarm(0)


def fuzz(base: Path, cases: int, seed: int = 0, report=None) -> Counter:
    counts: Counter = Counter()
    with tempfile.TemporaryDirectory() as td:
        for i in range(cases):
            rng = random.Random(seed * 1_000_003 + i)
            art = Path(td) / f"case{i}"
            shutil.copytree(base, art)
            kind = mutate(rng, art)
            try:
                outcome = run_case(art)
            except Exception as e:  # anything but our typed error is a finding
                raise AssertionError(f"case {i} (seed {seed}, {kind}): {e.__class__.__name__}: {e}") from e
            counts[(kind, outcome)] += 1
            shutil.rmtree(art)
            if report and (i + 1) % 500 == 0:
                report(i + 1, counts)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import make_llama

    from sparkq.convert.pipeline import Options, convert

    with tempfile.TemporaryDirectory() as td:
        src = make_llama(Path(td) / "src", hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=320)
        base = Path(td) / "art"
        convert(str(src), str(base), Options(progress=False))
        t0 = time.time()
        counts = fuzz(base, args.cases, args.seed,
                      report=lambda n, c: print(f"{n} cases, {time.time() - t0:.0f} s", file=sys.stderr, flush=True))
    total = sum(counts.values())
    print(f"fuzz: {total} cases, seed {args.seed}, {time.time() - t0:.0f} s; no crash, hang or untyped exception")
    print(f"  {'mutation':14} {'typed error':>12} {'loaded+verified':>16}")
    for kind in sorted({k for k, _ in counts}):
        print(f"  {kind:14} {counts[(kind, 'error')]:>12} {counts[(kind, 'ok')]:>16}")
    print(f"  {'total':14} {sum(v for (k, o), v in counts.items() if o == 'error'):>12} "
          f"{sum(v for (k, o), v in counts.items() if o == 'ok'):>16}")


if __name__ == "__main__":
    main()
