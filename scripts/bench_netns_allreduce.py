"""Quantized (int8, int4, int2) vs fp32 all-reduce across emulated hosts with shaped links (network
namespaces, tbf).

Builds N hosts (zb.net.netns), each link shaped to --rate-mbit in both directions, runs
`zb bench-allreduce` with one rank per host (gloo over eth0), and reports each compression's speedup
over fp32 and the fraction of the shaped link rate it uses (bytes a rank sends / time).
Needs root. Run:
  sudo PYTHONPATH=. python scripts/bench_netns_allreduce.py --hosts 3 --rate-mbit 100 --size-mb 64 \
      --compressions none,int8,int4,int2
"""

from __future__ import annotations

import argparse
import json
import sys

from zb.collectives.bench import BenchConfig, spawn_on
from zb.net.netns import emulated_hosts, netns_unavailable


def run(hosts: int, rate_mbit: float, cfg: BenchConfig) -> dict:
    """Returns the bench report plus speedup and link utilization per compression."""
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    with emulated_hosts(hosts, rate_mbit=rate_mbit) as net:
        report = spawn_on([h.popen for h in net.hosts], net.hosts[0].addr, 29500, cfg)
    res = report["results"]
    for r in res.values():
        r["link_utilization"] = r["wire_bytes"] * 8 / r["median_s"] / (rate_mbit * 1e6)
    if "none" in res:
        report["speedups"] = {c: res["none"]["median_s"] / r["median_s"] for c, r in res.items() if c != "none"}
        if "int8" in res:
            report["int8_speedup"] = report["speedups"]["int8"]
    report["hosts"], report["rate_mbit"] = hosts, rate_mbit
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compressions", default="none,int8")
    args = parser.parse_args(argv)
    cfg = BenchConfig(size_mb=args.size_mb, compressions=args.compressions.split(","), iterations=args.iterations,
                      warmup=args.warmup,
                      streams=args.streams, threads=args.threads, timeout_s=900)
    report = run(args.hosts, args.rate_mbit, cfg)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.hosts} hosts, tbf {args.rate_mbit:g} Mbit/s per link, {args.size_mb:g} MB fp32")
    for col in ("compression", "median s", "wire MB/rank", "link used", "rel. error", "ranks agree"):
        table.add_column(col, justify="right")
    for comp, r in report["results"].items():
        table.add_row(comp, f"{r['median_s']:.2f}", f"{r['wire_bytes'] / 1e6:.1f}", f"{r['link_utilization']:.0%}",
                      f"{r['rel_error']:.2e}", "yes" if r["bit_identical"] else "NO")
    Console(stderr=True).print(table)
    for comp, speedup in report.get("speedups", {}).items():
        Console(stderr=True).print(f"{comp} speedup over fp32: {speedup:.2f}x")
    sys.stdout.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
