"""``sparkq bench``: decode and prefill speed, load time, TTFT and memory, as interleaved arms.

Every (pass, arm) runs in a fresh child process (``python .../runtime/measure/bench.py '<json>'``),
so load time and peak RSS are those of a cold start, and arms alternate within each pass
(control, arm B, ..., control, arm B, ...) so drift on a shared machine hits all of them.
Reports medians and spread (min..max), ratios to the control arm (medians of same-pass
ratios), a streaming-read bandwidth probe with the same threads right before each run, and
decode bytes per token -> effective GB/s and its share of that run's probe.
An optional llama.cpp arm runs through llama-cpp-python when it is installed.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

def _bool(v: str) -> bool:
    return v.lower() in ("1", "true", "yes", "on")


def _auto_bool(v: str) -> bool | None:
    return None if v.lower() == "auto" else _bool(v)


# load() options and LabOptions fields (runtime/options.py) an arm may set
LOAD_KEYS = {"prefill_dequant": _auto_bool, "c_decode": _bool, "c_prefill": _bool, "lite": _bool, "threads": int,
             "kv_budget_mib": float, "max_model_len": int, "kv_dtype": str}


def parse_arm(spec: str) -> tuple[str, dict, dict]:
    """``NAME=k=v,k=v``: lower-case keys are load() options (``model=PATH`` benches another
    model, e.g. the bf16 reference, in the same interleaved run; ``depth=N`` decodes after N
    cached positions), UPPER-case ones environment variables."""
    name, _, flags = spec.partition("=")
    if not name:
        raise ValueError(f"--arm {spec!r}: expected NAME=key=value,...")
    kw, env = {}, {}
    for item in filter(None, flags.split(",")):
        k, _, v = item.partition("=")
        if k.isupper():
            env[k] = v
        elif k == "model":
            kw[k] = v
        elif k == "depth":  # this arm decodes after a prompt of this many tokens (--depth for all)
            kw[k] = int(v)
        elif k in LOAD_KEYS:
            kw[k] = LOAD_KEYS[k](v)
        else:
            raise ValueError(f"--arm {name}: unknown option {k!r} (load options: {', '.join(LOAD_KEYS)}; "
                             "UPPER_CASE keys set environment variables)")
    return name, kw, env


def bandwidth_probe(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Streaming-read ceiling in GB/s: sum over a buffer much larger than the caches."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    torch.set_num_threads(old)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def decode_bytes_per_token(loaded) -> int:
    """Weight bytes one decode step reads: every linear once (the head in full, a split head's
    first plane in full and its second for the refined rows), norms."""
    from sparkq.runtime.common import decode_read_bytes
    from sparkq.runtime.measure.memory import model_regions

    seen, total = set(), 0
    for cat, name, t in model_regions(loaded):
        if cat in ("kv cache", "rope tables", "scratch"):
            continue
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += decode_read_bytes(name, t.numel() * t.element_size(), t.shape[0])
    return total


def _child_sparkq(a: dict) -> dict:
    import torch

    from sparkq.runtime.procmem import RssSampler
    from sparkq.runtime import load

    from sparkq.runtime.options import LabOptions

    kw = dict(a["load"])
    lab = LabOptions(**{k: kw.pop(k) for k in LabOptions.keys() if k in kw})
    t0 = time.perf_counter()
    with RssSampler(0.002) as s:
        m = load(a["model"], lab=lab, **kw)
        load_s = time.perf_counter() - t0
        vocab = m.model.spec.vocab
        g = torch.Generator().manual_seed(0)
        short = torch.randint(0, vocab, (a["ttft_tokens"],), generator=g).tolist()
        t = time.perf_counter()
        next(iter(m.stream_ids(short, max_new_tokens=1, stop_ids=[])))
        ttft = time.perf_counter() - t
    settled = s.sample()
    with RssSampler(0.002) as run:  # the prefill and the decode, each from an empty cache
        pp_ids = torch.randint(0, vocab, (a["pp"],), generator=g).tolist()
        list(m.stream_ids(pp_ids[:64], max_new_tokens=2, stop_ids=[]))  # warm both paths
        t = time.perf_counter()
        m.model.forward(torch.tensor(pp_ids), 0, last_only=True)
        pp_s = time.perf_counter() - t
        # decode after a prompt of `depth` tokens (llama-bench -d), else after the short one
        deep = torch.randint(0, vocab, (a["depth"],), generator=g).tolist() if a.get("depth") else short
        list(m.stream_ids(deep, max_new_tokens=a["tg"], stop_ids=[]))
    st = m.last_stats
    d = a["model"] if os.path.isdir(a["model"]) else ""  # a Hub repo id: no bound reported
    art = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors")) if d else 0
    return {"load_s": load_s, "ttft_s": ttft, "pp_tok_s": a["pp"] / pp_s, "tg_tok_s": st.decode_tok_s,
            "peak_rss_mib": s.peak_kib / 1024, "settled_rss_mib": settled / 1024, "run_peak_rss_mib": run.peak_kib / 1024,
            "after_run_rss_mib": run.sample() / 1024, "weights_file_mib": art / 2**20,
            "kv_budget_mib": m.model.cache.nbytes / 2**20,
            "decode_bytes_per_token": decode_bytes_per_token(m), "threads": torch.get_num_threads(),
            "decode_path": m.info.extra.get("decode_path"), "prefill_path": m.info.extra.get("prefill_path"),
            "kv_dtype": m.info.extra.get("kv_dtype")}


def _child_lite(a: dict) -> dict:
    """The torch-free runtime (runtime/lite/model.py): the same measurements as _child_sparkq; torch is
    never imported in this process (checked: its RSS is the point of the arm)."""
    import random

    from sparkq.runtime.procmem import RssSampler
    from sparkq.runtime.common import decode_read_bytes
    from sparkq.runtime.lite import load

    kw = {k: v for k, v in a["load"].items() if k != "lite"}
    t0 = time.perf_counter()
    with RssSampler(0.002) as s:
        m = load(a["model"], **kw)
        load_s = time.perf_counter() - t0
        rng = random.Random(0)
        vocab = m.spec.vocab
        short = [rng.randrange(vocab) for _ in range(a["ttft_tokens"])]
        t = time.perf_counter()
        next(iter(m.stream_ids(short, max_new_tokens=1, stop_ids=[])))
        ttft = time.perf_counter() - t
    settled = s.sample()
    with RssSampler(0.002) as run:
        pp_ids = [rng.randrange(vocab) for _ in range(a["pp"])]
        list(m.stream_ids(pp_ids[:64], max_new_tokens=2, stop_ids=[]))  # warm both paths
        t = time.perf_counter()
        m.prefill(pp_ids)
        pp_s = time.perf_counter() - t
        deep = [rng.randrange(vocab) for _ in range(a["depth"])] if a.get("depth") else short
        list(m.stream_ids(deep, max_new_tokens=a["tg"], stop_ids=[]))
    st = m.last_stats
    if "torch" in sys.modules:
        raise RuntimeError("the lite arm imported torch")
    d = a["model"] if os.path.isdir(a["model"]) else ""
    art = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors")) if d else 0
    # weight bytes per decode step (decode_bytes_per_token's rule)
    bpt = sum(decode_read_bytes(k, v.nbytes, v.shape[0]) for k, v in m.tensors.items())
    return {"load_s": load_s, "ttft_s": ttft, "pp_tok_s": a["pp"] / pp_s, "tg_tok_s": st.decode_tok_s,
            "peak_rss_mib": s.peak_kib / 1024, "settled_rss_mib": settled / 1024, "run_peak_rss_mib": run.peak_kib / 1024,
            "after_run_rss_mib": run.sample() / 1024, "weights_file_mib": art / 2**20, "kv_budget_mib": m.kv_nbytes / 2**20,
            "decode_bytes_per_token": bpt, "threads": m.info.extra["threads"],
            "decode_path": m.info.extra["decode_path"], "prefill_path": m.info.extra["prefill_path"],
            "kv_dtype": m.info.extra["kv_dtype"]}


def _child_llama(a: dict) -> dict:
    import random

    from llama_cpp import Llama

    from sparkq.runtime.procmem import RssSampler  # sparkq.runtime does not import torch

    t0 = time.perf_counter()
    with RssSampler(0.002) as s:
        llm = Llama(model_path=a["model"], n_ctx=max(a["pp"], a.get("depth", 0)) + a["tg"] + 64,
                    n_threads=a["load"].get("threads") or os.cpu_count(),
                    n_batch=a["pp"], verbose=False)
        load_s = time.perf_counter() - t0
        rng = random.Random(0)
        vocab = llm.n_vocab()
        short = [rng.randrange(vocab) for _ in range(a["ttft_tokens"])]
        t = time.perf_counter()
        llm.eval(short)
        ttft = time.perf_counter() - t
    settled = s.sample()
    with RssSampler(0.002) as run:
        llm.reset()
        pp_ids = [rng.randrange(vocab) for _ in range(a["pp"])]
        t = time.perf_counter()
        llm.eval(pp_ids)
        pp_s = time.perf_counter() - t
        llm.reset()
        llm.eval([rng.randrange(vocab) for _ in range(a["depth"])] if a.get("depth") else short)
        t = time.perf_counter()
        for _ in range(a["tg"] - 1):
            llm.eval([rng.randrange(vocab)])
        tg_s = time.perf_counter() - t
    return {"load_s": load_s, "ttft_s": ttft, "pp_tok_s": a["pp"] / pp_s, "tg_tok_s": (a["tg"] - 1) / tg_s,
            "peak_rss_mib": s.peak_kib / 1024, "settled_rss_mib": settled / 1024, "run_peak_rss_mib": run.peak_kib / 1024,
            "after_run_rss_mib": run.sample() / 1024,
            "decode_bytes_per_token": os.path.getsize(a["model"]), "threads": a["load"].get("threads") or os.cpu_count()}


def _run_child(args: dict, env: dict) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(args)], capture_output=True, text=True,
                       env={**os.environ, **env})
    if p.returncode != 0:
        from sparkq.runtime.errors import RuntimeUserError
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeUserError(f"bench arm failed: {last.removeprefix('error: ')}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _summ(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def paired_ratio(a: dict, b: dict, metric: str) -> float | None:
    """Median over passes of arm a's value over arm b's in the same pass (the arms of a pass run
    back to back, so a drift of the box between passes cancels), or None when b has a zero."""
    va, vb = a[metric]["values"], b[metric]["values"]
    if not all(vb):
        return None
    return statistics.median(x / y for x, y in zip(va, vb))


METRICS = ("load_s", "ttft_s", "pp_tok_s", "tg_tok_s", "peak_rss_mib", "settled_rss_mib", "run_peak_rss_mib",
           "after_run_rss_mib")
# issue 6's memory bound: peak RSS through load, prefill and decode <= weights file + KV budget + this
RSS_BOUND_SLACK_MIB = 150


def bench(model: str, arms: list[str] | None = None, passes: int = 3, threads: int | None = None, pp: int = 512,
          tg: int = 128, ttft_tokens: int = 16, llama_gguf: list[str] | str | None = None, progress=None,
          depth: int = 0, kv_dtype: str | None = None) -> dict:
    import torch

    from sparkq.runtime.errors import RuntimeUserError

    if passes < 1 or pp < 1 or tg < 2 or depth < 0:
        raise RuntimeUserError("--passes >= 1, --pp >= 1, --tg >= 2 and --depth >= 0 are required")
    threads = threads or torch.get_num_threads()
    try:
        parsed = [("control", {}, {})] + [parse_arm(a) for a in (arms or [])]
    except ValueError as e:
        raise RuntimeUserError(str(e)) from None
    runs = []
    for name, kw, env in parsed:
        d = kw.pop("depth", depth)
        kw = {"threads": threads, "max_model_len": max(pp, ttft_tokens + tg, d + tg) + 8,
              **({"kv_dtype": kv_dtype} if kv_dtype else {}), **kw}
        target = kw.pop("model", model)
        runs.append((name, {"kind": "sparkq", "model": target, "load": kw, "depth": d}, env))
    ggufs = [llama_gguf] if isinstance(llama_gguf, str) else list(llama_gguf or [])
    if ggufs:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise RuntimeUserError("--llama-gguf needs llama-cpp-python: pip install llama-cpp-python (builds llama.cpp, ~5 min)") from None
    for g in ggufs:
        if not os.path.isfile(g):
            raise RuntimeUserError(f"--llama-gguf {g}: no such file")
        name = "llama.cpp" if len(ggufs) == 1 else f"llama.cpp {os.path.basename(g)}"
        runs.append((name, {"kind": "llama", "model": g, "load": {"threads": threads}}, {}))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    # a streaming-read probe right before each arm's run (the box's bandwidth drifts within a
    # pass: one probe per pass set beside arms run minutes apart gave >100% of the "ceiling"), so
    # each run's decode GB/s is divided by its own probe
    probes: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for p in range(passes):
        for name, args, env in runs:
            args = {"depth": depth, **args, "pp": pp, "tg": tg, "ttft_tokens": ttft_tokens}
            probes[name].append(bandwidth_probe(threads))
            time.sleep(0.05)  # the probe's OpenMP threads stop spinning before the child starts
            results[name].append(_run_child(args, env))
            if progress:
                progress(f"pass {p + 1}/{passes} {name}")
    ceilings = [c for name, _, _ in runs for c in probes[name]]
    ceiling = statistics.median(ceilings)
    out_arms = {}
    for name, _, env in runs:
        rs = results[name]
        a = {m: _summ([r[m] for r in rs]) for m in METRICS}
        bpt = rs[0]["decode_bytes_per_token"]
        a["decode_bytes_per_token"] = bpt
        a["decode_gb_s"] = bpt * a["tg_tok_s"]["median"] / 1e9
        a["read_ceiling"] = _summ(probes[name])
        a["decode_pct_of_ceiling"] = statistics.median(100 * bpt * r["tg_tok_s"] / 1e9 / c for r, c in zip(rs, probes[name]))
        a["env"] = env
        a["decode_path"] = rs[0].get("decode_path", "llama.cpp")
        a["prefill_path"] = rs[0].get("prefill_path")
        a["kv_dtype"] = rs[0].get("kv_dtype")
        a["depth"] = next(args.get("depth", depth) for n, args, _ in runs if n == name)
        a["model"] = next(args["model"] for n, args, _ in runs if n == name)
        if rs[0].get("weights_file_mib"):
            a["rss_bound_mib"] = rs[0]["weights_file_mib"] + rs[0]["kv_budget_mib"] + RSS_BOUND_SLACK_MIB
            a["kv_budget_mib"] = rs[0]["kv_budget_mib"]
        out_arms[name] = a
    ctrl = out_arms["control"]
    for a in out_arms.values():
        a["ratio_to_control"] = {m: paired_ratio(a, ctrl, m) for m in METRICS}
    return {"model": model, "passes": passes, "threads": threads, "pp": pp, "tg": tg, "ttft_tokens": ttft_tokens,
            "depth": depth,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"), "read_ceiling_gb_s": ceiling,
            "read_ceiling": _summ(ceilings),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "arms": out_arms}


if __name__ == "__main__":
    sys.path.pop(0)  # run as a script: do not shadow packages with this folder
    args = json.loads(sys.argv[1])
    try:
        res = _child_llama(args) if args["kind"] == "llama" else \
            _child_lite(args) if args["load"].get("lite") else _child_sparkq(args)
    except Exception as e:
        if type(e).__name__ != "RuntimeUserError":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(res))
