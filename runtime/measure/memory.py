"""``sparkq memory``: where the bytes are, and how high the process peaks before it settles.

Run as a fresh child process (``python .../runtime/measure/memory.py '<json args>'``, as a script so
the package is not imported before the first stage) so the
process view starts from a bare interpreter: stages are measured after ``import torch``,
after ``import sparkq.runtime``, after load, after warm-up and after a generation; a
sampler thread records RssAnon/RssFile every few ms through load and warm-up (peak vs
settled). The ledger counts each distinct memory region once (tied/aliased tensors share
one) and asks mincore(2) how much of it is resident, split file-backed / anonymous.
"""
from __future__ import annotations

import json
import os
import sys
import time


def _file_ranges() -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[5]))
    return out


def model_regions(loaded) -> list[tuple[str, str, object]]:
    """(category, name, tensor) for every buffer the model holds."""
    from sparkq.runtime.torchrt.weights import DenseLinear, Int4Linear, Int8Linear

    m = loaded.model
    out = []
    for name, lin in m.lin.items():
        head = name in ("lm_head", "embed")
        if name == "ple_embed":  # Gemma 4's per-layer input table: one row read per token
            out += [("per-layer inputs", f"{name}.{s}", getattr(lin, a)) for s, a in (("qweight", "qweight"), ("scales", "scales"))
                    if getattr(lin, a, None) is not None] if isinstance(lin, Int8Linear) else \
                [("per-layer inputs", f"{name}.weight", lin.weight)] if isinstance(lin, DenseLinear) else []
            if isinstance(lin, (Int8Linear, DenseLinear)):
                continue
        if isinstance(lin, Int4Linear):
            out.append(("embedding/head" if head else "int4 weights", f"{name}.qweight", lin.qweight))
            out.append(("embedding/head" if head else "scales/zeros", f"{name}.scales_zeros", lin.scales_zeros))
            if getattr(lin, "levels", None) is not None:
                out.append(("embedding/head" if head else "scales/zeros", f"{name}.levels", lin.levels))
            if lin.residual is not None:
                out.append(("embedding/head" if head else "int4 weights", f"{name}.residual", lin.residual))
                out.append(("embedding/head" if head else "scales/zeros", f"{name}.residual_scales", lin.rscales))
            if getattr(lin, "rmap", None) is not None:
                out.append(("embedding/head" if head else "scales/zeros", f"{name}.residual_map", lin.rmap))
        elif isinstance(lin, Int8Linear):
            out.append(("embedding/head" if head else "int8 weights", f"{name}.qweight", lin.qweight))
            out.append(("embedding/head" if head else "scales/zeros", f"{name}.scales", lin.scales))
        elif isinstance(lin, DenseLinear):
            out.append(("embedding/head" if head else "bf16 weights", f"{name}.weight", lin.weight))
    for name, t in m.norms.items():
        out.append(("norms", name, t))
    for name in ("k", "v", "k_scale", "v_scale"):  # (per-layer head dims: a tensor per layer)
        t = getattr(m.cache, name)
        out += [("kv cache", f"kv.{name}{j}", x) for j, x in enumerate(t)] if isinstance(t, list) else \
            [("kv cache", f"kv.{name}", t)] if t is not None else []
    for i, st in enumerate(m.state):  # a hybrid model's recurrent layers: fixed per sequence, besides the KV cache
        for name, t in (st or {}).items():
            out.append(("recurrent state", f"layers.{i}.{name}", t))
    for i, r in enumerate(m.ropes):
        out += [("rope tables", f"rope{i}.cos", r.cos), ("rope tables", f"rope{i}.sin", r.sin)]
    scratch = next((lin.scratch for lin in m.lin.values() if isinstance(lin, Int4Linear)), None)
    if scratch is not None and scratch.buf.numel():
        out.append(("scratch", "prefill scratch", scratch.buf))
    return out


def ledger(loaded) -> dict:
    from sparkq.runtime.procmem import resident_bytes

    files = _file_ranges()
    seen: set[tuple[int, int]] = set()
    cats: dict[str, dict] = {}
    for cat, _name, t in model_regions(loaded):
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        if (ptr, n) in seen or n == 0:
            continue  # tied / aliased: counted once
        seen.add((ptr, n))
        res = min(n, resident_bytes(ptr, n))  # whole pages: clamp regions sharing a page
        file_backed = any(a <= ptr and ptr + n <= b for a, b, _ in files)
        c = cats.setdefault(cat, {"regions": 0, "bytes": 0, "resident": 0, "resident_file": 0, "resident_anon": 0})
        c["regions"] += 1
        c["bytes"] += n
        c["resident"] += res
        c["resident_file" if file_backed else "resident_anon"] += res
    total = {k: sum(c[k] for c in cats.values()) for k in ("regions", "bytes", "resident", "resident_file", "resident_anon")}
    return {"categories": cats, "total": total}


def _proc_kib(path: str) -> dict[str, int]:
    # read here, not through sparkq.runtime.procmem: the first stages must not import sparkq/torch
    out = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                out[parts[0][:-1]] = int(parts[1])
    return out


def _stage(name: str, stages: list) -> None:
    r, p = _proc_kib("/proc/self/status"), _proc_kib("/proc/self/smaps_rollup")
    stages.append({"stage": name, "rss_anon_mib": r.get("RssAnon", 0) / 1024, "rss_file_mib": r.get("RssFile", 0) / 1024,
                   "pss_mib": p.get("Pss", 0) / 1024, "t": time.perf_counter()})


def child(args: dict) -> dict:
    stages: list = []
    _stage("python", stages)
    import torch  # noqa: F401
    _stage("import torch", stages)
    import sparkq.runtime as rt
    from sparkq.runtime.procmem import RssSampler
    _stage("import sparkq", stages)
    from sparkq.runtime.options import LabOptions

    kw = {k: args[k] for k in ("max_model_len", "kv_budget_mib", "threads", "rope_len_from_config", "kv_dtype")
          if args.get(k) is not None}
    lab = LabOptions(rope_len_from_config=bool(kw.get("rope_len_from_config")))
    with RssSampler(0.002) as s:
        m = rt.load(args["artifact"], lab=lab, **{k: v for k, v in kw.items() if k != "rope_len_from_config"})
        _stage("after load", stages)
        list(m.stream_ids(list(range(100, 100 + min(8, m.capacity - 1))), max_new_tokens=1, stop_ids=[]))
        _stage("after warm-up", stages)
    settled = stages[-1]["rss_anon_mib"] + stages[-1]["rss_file_mib"]
    n_prompt = min(args.get("prompt_tokens", 64), m.capacity // 2)
    n_new = min(args.get("new_tokens", 64), m.capacity - n_prompt)
    list(m.stream_ids(list(range(100, 100 + n_prompt)), max_new_tokens=n_new, stop_ids=[]))
    _stage("after generation", stages)
    return {
        "artifact": args["artifact"],
        "settings": {**kw, "kv_capacity": m.capacity, "kv_dtype": m.model.cache.dtype,
                     "kv_bytes_per_token": m.model.cache.bytes_per_token(m.model.spec, m.model.cache.dtype),
                     "threads": torch.get_num_threads()},
        "stages": stages,
        "import_cost_mib": {"torch": stages[1]["rss_anon_mib"] + stages[1]["rss_file_mib"] - stages[0]["rss_anon_mib"] - stages[0]["rss_file_mib"],
                            "sparkq": stages[2]["rss_anon_mib"] + stages[2]["rss_file_mib"] - stages[1]["rss_anon_mib"] - stages[1]["rss_file_mib"]},
        "peak_mib": s.peak_kib / 1024,
        "peak_anon_mib": s.peak_anon_kib / 1024,
        "settled_mib": settled,
        "transient_mib": s.peak_kib / 1024 - settled,
        "ledger": ledger(m),
        "load_s": m.info.load_seconds,
    }


def run(artifact: str, **kw) -> dict:
    """Measure in a fresh interpreter; returns the child's JSON result."""
    import subprocess

    args = {"artifact": str(artifact), **kw}
    p = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(args)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if p.returncode != 0:
        from sparkq.runtime.errors import RuntimeUserError
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeUserError(f"memory measurement failed: {last.removeprefix('error: ')}")
    return json.loads(p.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.path.pop(0)  # run as a script: do not shadow packages with this folder
    try:  # nothing from sparkq is imported before the first stage
        print(json.dumps(child(json.loads(sys.argv[1]))))
    except Exception as e:
        if type(e).__name__ != "RuntimeUserError":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
