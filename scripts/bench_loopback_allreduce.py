"""int8 ring vs gloo fp32 on unshaped loopback: the median of per-repeat time ratios.

W local ranks, each with cores / W torch threads; the two compressions alternate repeat by
repeat in the same processes, so machine noise hits both alike; ratio = fp32 time / int8 time
(> 1: int8 faster). Run: PYTHONPATH=. python scripts/bench_loopback_allreduce.py [--size-mb 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from zb.cli.bench_allreduce import results_table
from zb.collectives.bench import BenchConfig, free_port, spawn_local


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    cfg = BenchConfig(size_mb=args.size_mb, iterations=args.repeats, warmup=2)
    report = spawn_local(args.world_size, cfg, free_port())
    res = report["results"]
    ratios = [a / b for a, b in zip(res["none"]["times_s"], res["int8"]["times_s"])]
    report["int8_speedup_median"] = statistics.median(ratios)
    report["int8_speedup_per_repeat"] = ratios
    from rich.console import Console

    console = Console(stderr=True)
    console.print(results_table(report))
    console.print(f"int8 vs gloo fp32, median of {len(ratios)} per-repeat ratios: {report['int8_speedup_median']:.2f}x "
                  f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    sys.stdout.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
