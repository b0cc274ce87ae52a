"""Prefill products of one int4 rows32 linear: the C core's GEMMs (``sq_linear_batch``: W4A8, and
on AVX512-BF16 CPUs the bf16 one it uses from 32 rows) vs dequantize row blocks
(``sq_dequant_rows``) + torch's GEMM (fp32, or bf16 where the CPU has native bf16: what the
torch model's dequantizing path does), on random codes of given shapes.

``python tools/gemmbench.py [--rows 512] [--rounds 3] [--reps 7] [--shape K,N,G ...] [--json]``
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


def run(shapes: list[str], rows: int, rounds: int, reps: int, threads: int) -> list[dict]:
    import torch
    from sparkq.formats import constants as C
    from sparkq.runtime import core
    from sparkq.runtime.weights import prefill_dtype

    torch.set_num_threads(threads)
    lib = core.load()
    has_bf16 = bool(lib.sq_prefill_bf16())
    a8lib = core.load("avx512-vnni") if has_bf16 else lib  # the same build without the bf16 GEMM
    for x in (lib, a8lib):
        x.sq_set_threads(threads)
    dt = prefill_dtype()  # what the torch model's dequantizing path multiplies in
    out = []
    for spec in shapes:
        k, n, g = (int(v) for v in spec.split(","))
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        sz = (torch.rand(k // g, n, 2, generator=gen) * 0.01).to(torch.bfloat16).contiguous()
        L = core.linear_struct(lib, core.CLinear(C.KIND_INT4, n, k, g, q, sz))
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

        def c_gemm(bf16: bool):
            use = lib if bf16 else a8lib

            def f():
                use.sq_linear_batch(ctypes.byref(L), x.data_ptr(), 0, rows, y.data_ptr(), None)
            return f

        arms = {"dequant": dequant, "w4a8": c_gemm(False)}
        if has_bf16 and rows >= 32:  # sq_linear_batch takes the bf16 GEMM from 32 rows on
            arms["bf16"] = c_gemm(True)
        ops = 2 * rows * n * k
        ts = {a: [] for a in arms}
        for _ in range(rounds):
            for a, f in arms.items():
                ts[a].append(_median_time(f, reps))
        r = {"k": k, "n": n, "group": g, "rows": rows, "dequant_dtype": str(dt).replace("torch.", "")}
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
         as_json: bool = typer.Option(False, "--json")) -> None:
    res = run(shape, rows, rounds, reps, threads)
    if as_json:
        typer.echo(json.dumps(res, indent=1))
        return
    bf16 = "bf16_gops" in res[0]  # AVX512-BF16 CPU and >= 32 rows
    typer.echo(f"prefill products at {rows} rows, {threads} threads, {rounds} interleaved rounds x {reps} calls; "
               f"ratios are against dequantize + {res[0]['dequant_dtype']} torch GEMM\n")
    head = "| K | N | group | dequant + torch GEMM GOPS | W4A8 GEMM GOPS | W4A8 / dequant [min..max] |"
    if bf16:
        head += " bf16 GEMM GOPS | bf16 / dequant [min..max] |"
    typer.echo(head)
    typer.echo("|---" * (head.count("|") - 1) + "|")
    for r in res:
        line = (f"| {r['k']} | {r['n']} | {r['group']} | {r['dequant_gops']:.0f} | {r['w4a8_gops']:.0f} | "
                f"{r['w4a8_ratio']:.2f}x [{r['w4a8_ratio_range'][0]:.2f}..{r['w4a8_ratio_range'][1]:.2f}] |")
        if bf16:
            line += (f" {r['bf16_gops']:.0f} | {r['bf16_ratio']:.2f}x "
                     f"[{r['bf16_ratio_range'][0]:.2f}..{r['bf16_ratio_range'][1]:.2f}] |")
        typer.echo(line)


if __name__ == "__main__":
    typer.run(main)
