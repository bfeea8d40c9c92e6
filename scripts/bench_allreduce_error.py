"""Relative error of the int8 all-reduce by world size, on pseudo-gradient-like tensors.

For each world size W, W local ranks reduce (SUM) heavy-tailed Student-t (df=3) tensors (the
stand-in for pseudo-gradients; Gaussian too), and the result is compared with gloo's fp32
all-reduce: ||int8 - fp32|| / ||fp32||. Also checks that all ranks agree bit for bit.
Run: PYTHONPATH=. python scripts/bench_allreduce_error.py [--world-sizes 2,3,4,6,8] [--size-mb 4]
"""

from __future__ import annotations

import argparse
import json
import sys

from zb.collectives.bench import BenchConfig, free_port, spawn_local


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,3,4,6,8")
    parser.add_argument("--size-mb", type=float, default=4.0)
    args = parser.parse_args(argv)
    rows = []
    for data in ("student_t", "gaussian"):
        for w in [int(x) for x in args.world_sizes.split(",")]:
            cfg = BenchConfig(size_mb=args.size_mb, compressions=["int8"], iterations=1, warmup=0, data=data, threads=1)
            r = spawn_local(w, cfg, free_port())["results"]["int8"]
            rows.append({"data": data, "world_size": w, "rel_error": r["rel_error"], "bit_identical": r["bit_identical"]})
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"int8 all-reduce (SUM) relative L2 error vs fp32, {args.size_mb:g} MB per rank")
    for col in ("data", "world size", "rel. error", "ranks agree"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["data"], str(r["world_size"]), f"{r['rel_error']:.4f}", "yes" if r["bit_identical"] else "NO")
    Console(stderr=True).print(table)
    doc = {"benchmark": "allreduce_error", "size_mb": args.size_mb, "rows": rows}
    sys.stdout.write(json.dumps(doc) + "\n")
    return doc


if __name__ == "__main__":
    main()
