"""Prefill products of one int4 (or lut4) rows32 linear: the C core's GEMMs (``sq_linear_batch`` of
each prompt build this CPU runs: avx512-vnni W4A8, avx512-bf16 vdpbf16ps from 32 rows, amx tiles
from 16; "tiles": the amx build's tile GEMM forced at any row count, for the crossover; "a16": the
batched decode step's opt-in int8 tile products, `sq_linear_a16`, always one thread) vs
dequantize row blocks
(``sq_dequant_rows``) + torch's GEMM (fp32, or bf16 where the CPU has native bf16: what the
torch model's dequantizing path does), on random codes of given shapes.

``python tools/gemmbench.py [--rows 512] [--rounds 3] [--reps 7] [--shape K,N,G ...] [--kind int4|lut4] [--json]``
Each round times the arms interleaved (median of ``reps`` calls each); the table gives the
median over rounds of GOPS (2*M*N*K per second) and of the per-round ratio. A benchmark, run
by hand (docs/performance.md "Prompt GEMMs"); not a test. The W4A8 arm on an AVX512-BF16 CPU is
the avx512-vnni build (the same code without the bf16 GEMM).
"""
from __future__ import annotations

import ctypes
import json
import statistics
import time

import typer

# (K, N, group): the example's linears (hidden 576) and the Qwen3-1.7B shape's (hidden 2048)
SHAPES = ["576,1536,64", "1536,576,128", "1536,576,64", "2048,2048,64", "2048,2048,128", "2048,12288,128",
          "6144,2048,128"]


def _median_time(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def run(shapes: list[str], rows: int, rounds: int, reps: int, threads: int, kind: str = "int4") -> list[dict]:
    import torch
    from sparkq.formats import constants as C
    from sparkq.runtime import core
    from sparkq.runtime.core.builds import PROMPT_BUILDS
    from sparkq.runtime.torchrt.weights import prefill_dtype

    torch.set_num_threads(threads)
    # one arm per prompt GEMM this CPU runs: each build's sq_linear_batch (amx: AMX tiles from
    # AMX_GEMM_MIN_M rows, avx512-bf16: vdpbf16ps from 32, avx512-vnni: W4A8); elsewhere the one build
    builds = [b for b in PROMPT_BUILDS if b in core.host_builds()] or [core.resolve_variant("native")]
    libs = {b: core.load(b) for b in builds}
    for x in libs.values():
        x.sq_set_threads(threads)
    lib = next(iter(libs.values()))
    dt = prefill_dtype()  # what the torch model's dequantizing path multiplies in
    out = []
    for spec in shapes:
        k, n, g = (int(v) for v in spec.split(","))
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        sz = (torch.rand(k // g, n, 2, generator=gen) * 0.01).to(torch.bfloat16).contiguous()
        lut = torch.randint(-100, 100, (n, 16), dtype=torch.int8, generator=gen).sort(dim=1).values.contiguous()
        cl = core.CLinear(C.KIND_LUT4 if kind == "lut4" else C.KIND_INT4, n, k, g, q, sz,
                          lut=lut if kind == "lut4" else None)
        Ls = {b: core.linear_struct(x, cl) for b, x in libs.items()}
        L = Ls[builds[0]]
        x, y = torch.randn(rows, k, generator=gen), torch.empty(rows, n)
        block = max(16, (1 << 20) // k // 16 * 16)  # the runtime's 1M-element scratch
        w, xd = torch.empty(min(block, n), k), x.to(dt)

        def dequant():
            for r0 in range(0, n, block):
                r1 = min(n, r0 + block)
                lib.sq_dequant_rows(ctypes.byref(L), r0, r1, w.data_ptr())
                if dt == torch.float32:
                    torch.matmul(xd, w[:r1 - r0].t(), out=y[:, r0:r1])
                else:
                    y[:, r0:r1] = xd @ w[:r1 - r0].to(dt).t()

        def c_gemm(b):
            use, Lb = libs[b], Ls[b]

            def f():
                use.sq_linear_batch(ctypes.byref(Lb), x.data_ptr(), 0, rows, y.data_ptr(), None)
            return f

        arms = {"dequant": dequant, **{b: c_gemm(b) for b in builds}}
        if "amx" in builds:  # the tile GEMM at any row count (sq_linear_batch takes it from AMX_GEMM_MIN_M)
            def tiles():
                libs["amx"].sq_gemm_tiles(ctypes.byref(Ls["amx"]), x.data_ptr(), rows, y.data_ptr(), 1)
            arms["tiles"] = tiles

            def a16():  # the batched decode step's opt-in int8 tile products (one thread, packing included)
                libs["amx"].sq_linear_a16(ctypes.byref(Ls["amx"]), x.data_ptr(), rows, y.data_ptr(), 1)
            arms["a16"] = a16
        ops = 2 * rows * n * k
        ts = {a: [] for a in arms}
        for _ in range(rounds):
            for a, f in arms.items():
                ts[a].append(_median_time(f, reps))
        r = {"k": k, "n": n, "group": g, "kind": kind, "rows": rows, "threads": threads,
             "dequant_dtype": str(dt).replace("torch.", ""), "builds": builds}
        for a in arms:
            r[f"{a}_gops"] = ops / statistics.median(ts[a]) / 1e9
            if a != "dequant":
                ratios = [td / ta for td, ta in zip(ts["dequant"], ts[a])]
                r[f"{a}_ratio"] = statistics.median(ratios)
                r[f"{a}_ratio_range"] = [min(ratios), max(ratios)]
        out.append(r)
    return out


def main(shape: list[str] = typer.Option(SHAPES, "--shape", help="K,N,GROUP (repeatable)"),
         rows: int = typer.Option(512, "--rows"), rounds: int = typer.Option(3, "--rounds"),
         reps: int = typer.Option(7, "--reps"), threads: int = typer.Option(2, "--threads"),
         kind: str = typer.Option("int4", "--kind", help="int4 or lut4"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    res = run(shape, rows, rounds, reps, threads, kind)
    if as_json:
        typer.echo(json.dumps(res, indent=1))
        return
    builds = res[0]["builds"] + (["tiles", "a16"] if "tiles_gops" in res[0] else [])
    typer.echo(f"{kind} prefill products at {rows} rows, {threads} threads, {rounds} interleaved rounds x {reps} calls; "
               f"ratios are against dequantize + {res[0]['dequant_dtype']} torch GEMM\n")
    head = "| K | N | group | dequant + torch GOPS |" + "".join(f" {b} GOPS | {b} / dequant [min..max] |" for b in builds)
    typer.echo(head)
    typer.echo("|---" * (head.count("|") - 1) + "|")
    for r in res:
        line = f"| {r['k']} | {r['n']} | {r['group']} | {r['dequant_gops']:.0f} |"
        for b in builds:
            line += f" {r[b + '_gops']:.0f} | {r[b + '_ratio']:.2f}x [{r[b + '_ratio_range'][0]:.2f}..{r[b + '_ratio_range'][1]:.2f}] |"
        typer.echo(line)


if __name__ == "__main__":
    typer.run(main)
