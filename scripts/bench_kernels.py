"""int8 kernels: memory traffic against memcpy and against their PyTorch twins, in one run.

Traffic = bytes read + bytes written per second (memcpy of n floats counts 8n bytes). Kernels,
memcpy and twins are interleaved over repeats; medians. Same code as `zb bench-allreduce --kernels`.
Run: PYTHONPATH=. python scripts/bench_kernels.py [--threads 2] [--size-mb 64]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from zb.cli.bench_allreduce import kernels_table
from zb.collectives.kernel_bench import run_kernel_bench


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size-mb", type=float, default=64.0, help="fp32 MB per kernel call")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    numel = int(args.size_mb * 1e6) // 4
    report = run_kernel_bench(numel, repeats=args.repeats, twin_numel=min(numel, 1 << 22))
    from rich.console import Console

    Console(stderr=True).print(kernels_table(report))
    sys.stdout.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
