"""Prefill products of one int4 rows32 linear: the C core's W4A8 GEMM (``sq_linear_batch``) vs
dequantize row blocks (``sq_dequant_rows``) + torch's fp32 GEMM, on random codes of given shapes.

``python -m sparkq.cli.gemmbench [--rows 512] [--rounds 3] [--reps 7] [--shape K,N,G ...] [--json]``
Each round times both arms interleaved (median of ``reps`` calls each); the table gives the
median over rounds of GOPS (2*M*N*K per second) and of the per-round ratio. A benchmark, run
by hand (README "Prefill"); not a test.
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
    from sparkq.runtime import kernels as K

    torch.set_num_threads(threads)
    lib = K.load()
    lib.sq_set_threads(threads)
    out = []
    for spec in shapes:
        k, n, g = (int(v) for v in spec.split(","))
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        sz = (torch.rand(k // g, n, 2, generator=gen) * 0.01).to(torch.bfloat16).contiguous()
        L = K.SqLinear(q.data_ptr(), sz.data_ptr(), None, 0, n, k, g)
        x, y = torch.randn(rows, k, generator=gen), torch.empty(rows, n)
        block = max(16, (1 << 20) // k // 16 * 16)  # the runtime's 1M-element scratch
        w = torch.empty(min(block, n), k)

        def dequant():
            for r0 in range(0, n, block):
                r1 = min(n, r0 + block)
                lib.sq_dequant_rows(ctypes.byref(L), r0, r1, w.data_ptr())
                torch.matmul(x, w[:r1 - r0].t(), out=y[:, r0:r1])

        def w4a8():
            lib.sq_linear_batch(ctypes.byref(L), x.data_ptr(), 0, rows, y.data_ptr(), None)

        ops = 2 * rows * n * k
        a, b = [], []
        for _ in range(rounds):
            a.append(_median_time(dequant, reps))
            b.append(_median_time(w4a8, reps))
        ratios = [ta / tb for ta, tb in zip(a, b)]
        out.append({"k": k, "n": n, "group": g, "rows": rows, "dequant_fp32_gops": ops / statistics.median(a) / 1e9,
                    "w4a8_gops": ops / statistics.median(b) / 1e9, "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return out


def main(shape: list[str] = typer.Option(SHAPES, "--shape", help="K,N,GROUP (repeatable)"),
         rows: int = typer.Option(512, "--rows"), rounds: int = typer.Option(3, "--rounds"),
         reps: int = typer.Option(7, "--reps"), threads: int = typer.Option(2, "--threads"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    res = run(shape, rows, rounds, reps, threads)
    if as_json:
        typer.echo(json.dumps(res, indent=1))
        return
    typer.echo(f"prefill products at {rows} rows, {threads} threads, {rounds} interleaved rounds x {reps} calls\n")
    typer.echo("| K | N | group | dequant + fp32 GEMM GOPS | W4A8 GEMM GOPS | W4A8 / dequant [min..max] |")
    typer.echo("|---|---|---|---|---|---|")
    for r in res:
        typer.echo(f"| {r['k']} | {r['n']} | {r['group']} | {r['dequant_fp32_gops']:.0f} | {r['w4a8_gops']:.0f} | "
                   f"{r['ratio']:.2f}x [{r['ratio_min']:.2f}..{r['ratio_max']:.2f}] |")


if __name__ == "__main__":
    typer.run(main)
