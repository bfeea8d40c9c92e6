"""Quantization kernels (int8, int4, int2): speed against memcpy and their PyTorch twins, in one run.

Reports memory traffic and values per second. Traffic = bytes read + bytes written per second
(memcpy of n floats counts 8n bytes; a quantized form counts its packed codes plus its scales).
Kernels, memcpy and twins are interleaved over repeats; medians. Same code as
`zb bench-allreduce --kernels` (whose table shows int8).
Run: PYTHONPATH=. python scripts/bench_kernels.py [--threads 2] [--size-mb 64] [--schemes int8,int4,int2]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from zb.collectives.kernel_bench import run_kernel_bench
from zb.collectives.kernels import SCHEMES


def schemes_table(report: dict):
    from rich.table import Table

    table = Table(title=f"quantization kernels, {report['threads']} thread(s), {report['numel']:,} values per call: "
                        f"memory traffic (read + written) vs memcpy {report['memcpy_gbps']:.2f} GB/s")
    for col in ("scheme", "kernel", "C++ GB/s", "C++ Gvalues/s", "vs memcpy", "twin GB/s", "C++ vs twin"):
        table.add_column(col, justify="right")
    nan = float("nan")
    for scheme, rows in report["schemes"].items():
        for name, r in rows.items():
            table.add_row(scheme, name, f"{r.get('gbps', nan):.2f}", f"{r.get('gvals', nan):.2f}",
                          f"{r.get('vs_memcpy', nan):.0%}", f"{r['twin_gbps']:.3f}", f"{r.get('vs_twin', nan):.1f}x")
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size-mb", type=float, default=64.0, help="fp32 MB per kernel call")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated subset of int8,int4,int2")
    args = parser.parse_args(argv)
    schemes = tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    if not schemes or any(s not in SCHEMES for s in schemes):
        parser.error(f"--schemes {args.schemes!r}: use a comma-separated subset of {','.join(SCHEMES)}")
    torch.set_num_threads(args.threads)
    numel = max(1, int(args.size_mb * 1e6) // 4)
    report = run_kernel_bench(numel, repeats=args.repeats, twin_numel=min(numel, 1 << 22), schemes=schemes)
    from rich.console import Console

    Console(stderr=True, width=140).print(schemes_table(report))
    sys.stdout.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
