"""Ring order from measured links against rank order, across emulated hosts with per-destination shaping.

Builds N hosts (zb.net.netns, unshaped veths) and shapes each host's egress per destination with
HTB: every link runs at --fast-mbit except the slow ones (--slow SRC:DST, default 0:1 and 2:3 for
4 hosts), which run at --slow-mbit and lie on the rank-order ring 0 -> 1 -> ... -> N-1 -> 0. Then:
1. `zb iperf-mesh --json` measures the real matrix across the hosts (what a user would run);
2. the ring solver (zb.net.bottleneck, what the leader runs through elastic.link_matrix) orders it;
3. `zb bench-allreduce` runs with ranks on the hosts in rank order, then in the solved order (rank
   i on host order[i], as the reordered world makes it): int8 in the order solved for zb's ring
   (rank r sends to r + 1), fp32 in the order solved for gloo's ring (r sends to r - 1).
Needs root. Run:
  sudo PYTHONPATH=. python scripts/bench_netns_ring_order.py --hosts 4 --size-mb 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

from zb.collectives.bench import BenchConfig, spawn_on
from zb.net.bottleneck import bottleneck, solve
from zb.net.netns import IFNAME, emulated_hosts, netns_unavailable


def shape_per_destination(host, dests: dict[str, float], default_mbit: float) -> None:
    """HTB on the host's egress: class 1:10 + n per slow destination, the rest through 1:1 at default_mbit."""
    def tc(*args: str) -> None:
        subprocess.run(host.command(["tc", *args]), check=True, capture_output=True, text=True, timeout=30)

    tc("qdisc", "replace", "dev", IFNAME, "root", "handle", "1:", "htb", "default", "1")
    tc("class", "add", "dev", IFNAME, "parent", "1:", "classid", "1:1", "htb", "rate", f"{default_mbit}mbit")
    for n, (addr, mbit) in enumerate(sorted(dests.items())):
        cls = f"1:{10 + n}"
        tc("class", "add", "dev", IFNAME, "parent", "1:", "classid", cls, "htb", "rate", f"{mbit}mbit")
        tc("filter", "add", "dev", IFNAME, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", "dst", f"{addr}/32", "flowid", cls)


def measure_matrix(net, duration_s: float) -> dict:
    """zb iperf-mesh across the hosts, one rank per host; rank 0's JSON document."""
    store = f"{net.hosts[0].addr}:29400"
    procs = [h.popen([sys.executable, "-m", "zb", "-q", "iperf-mesh", "--store", store, "--rank", str(r),
                      "--world-size", str(len(net.hosts)), "--duration", str(duration_s), "--json"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, h in enumerate(net.hosts)]
    outs = [p.communicate(timeout=600) for p in procs]
    if procs[0].returncode != 0:
        raise SystemExit(f"iperf-mesh failed: {outs[0][1].strip().splitlines()[-1:]}")
    return json.loads(outs[0][0])


def allreduce(net, order: list[int], cfg: BenchConfig, port: int, compressions: list[str] | None = None) -> dict:
    hosts = [net.hosts[i] for i in order]
    if compressions:
        cfg = dataclasses.replace(cfg, compressions=compressions)
    return spawn_on([h.popen for h in hosts], hosts[0].addr, port, cfg)["results"]


def run(n: int, slow: list[tuple[int, int]], fast_mbit: float, slow_mbit: float, cfg: BenchConfig,
        iperf_s: float) -> dict:
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    with emulated_hosts(n) as net:
        for i, host in enumerate(net.hosts):
            shape_per_destination(host, {net.hosts[d].addr: slow_mbit for s, d in slow if s == i}, fast_mbit)
        mesh = measure_matrix(net, iperf_s)
        matrix = mesh["matrix_mbps"]
        rank_order, solved, backward = list(range(n)), solve(matrix), solve(matrix, backward=True)
        results = {"rank": allreduce(net, rank_order, cfg, 29500),
                   "solved": {**allreduce(net, solved.order, cfg, 29501, ["int8"]),
                              **allreduce(net, backward.order, cfg, 29502, ["none"])}}
    report = {"hosts": n, "slow_links": [list(p) for p in slow], "fast_mbit": fast_mbit, "slow_mbit": slow_mbit,
              "size_mb": cfg.size_mb, "matrix_mbps": matrix, "solved_order": solved.order, "exact": solved.exact,
              "rank_bottleneck_mbps": bottleneck(matrix, rank_order),
              "solved_bottleneck_mbps": solved.bottleneck_mbps, "backward_order": backward.order,
              "rank_backward_bottleneck_mbps": bottleneck(matrix, rank_order[::-1]),
              "backward_bottleneck_mbps": backward.bottleneck_mbps, "results": {}}
    for comp in results["rank"]:
        a, b = results["rank"][comp]["median_s"], results["solved"][comp]["median_s"]
        report["results"][comp] = {"rank_order_s": a, "solved_order_s": b, "speedup": a / b,
                                   "bit_identical": results["solved"][comp]["bit_identical"]}
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--slow", action="append", default=None, metavar="SRC:DST",
                        help="a slow directed link (repeatable); default 0:1 and 2:3 (0:1 alone for 3 hosts)")
    parser.add_argument("--fast-mbit", type=float, default=100.0)
    parser.add_argument("--slow-mbit", type=float, default=20.0)
    parser.add_argument("--size-mb", type=float, default=16.0)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--iperf-seconds", type=float, default=1.0)
    args = parser.parse_args(argv)
    slow = [tuple(int(x) for x in s.split(":")) for s in args.slow] if args.slow else \
        ([(0, 1), (2, 3)] if args.hosts >= 4 else [(0, 1)])
    cfg = BenchConfig(size_mb=args.size_mb, iterations=args.iterations, warmup=1, threads=1, timeout_s=900)
    report = run(args.hosts, slow, args.fast_mbit, args.slow_mbit, cfg, args.iperf_seconds)
    from rich.console import Console
    from rich.table import Table

    err = Console(stderr=True)
    err.print(f"measured matrix (Mbit/s, rows send): {[[round(v) if v else None for v in row] for row in report['matrix_mbps']]}")
    err.print(f"rank order 0..{args.hosts - 1}: slowest hop {report['rank_bottleneck_mbps']:.1f} Mbit/s forward, "
              f"{report['rank_backward_bottleneck_mbps']:.1f} backward; solved order {report['solved_order']}: "
              f"{report['solved_bottleneck_mbps']:.1f} Mbit/s forward (int8); {report['backward_order']}: "
              f"{report['backward_bottleneck_mbps']:.1f} backward (fp32, gloo)")
    table = Table(title=f"{args.hosts} hosts, {args.fast_mbit:g} Mbit/s links, slow {slow} at {args.slow_mbit:g}, "
                        f"{args.size_mb:g} MB fp32 per rank")
    for col in ("compression", "rank order s", "solved order s", "speedup", "ranks agree"):
        table.add_column(col, justify="right")
    for comp, r in report["results"].items():
        table.add_row(comp, f"{r['rank_order_s']:.2f}", f"{r['solved_order_s']:.2f}", f"{r['speedup']:.2f}x",
                      "yes" if r["bit_identical"] else "NO")
    err.print(table)
    sys.stdout.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
