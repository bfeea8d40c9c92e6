"""`zb iperf-mesh` across emulated hosts with tbf-shaped links: measured rate vs shaped rate.

Builds N hosts (zb.net.netns), each link shaped to --rate-mbit in both directions, runs
`zb iperf-mesh` with one process per host (rank 0 hosts the store on host 0), and prints every
link's measured Mbit/s as a fraction of the shaped rate. Needs root. Run:
  sudo PYTHONPATH=. python scripts/bench_netns_iperf.py --hosts 3 --rate-mbit 50 --duration 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from zb.collectives.bench import communicate_all
from zb.net.netns import emulated_hosts, netns_unavailable

STORE_PORT = 29500  # each host is a fresh namespace: nothing else listens there


def run(hosts: int, rate_mbit: float, duration_s: float, extra: list[str] = (), timeout_s: float = 300) -> dict:
    """rank 0's report, plus rate_mbit and each link's measured / shaped ratio."""
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    with emulated_hosts(hosts, rate_mbit=rate_mbit) as net:
        store = f"{net.hosts[0].addr}:{STORE_PORT}"
        procs = [h.popen([sys.executable, "-m", "zb", "-q", "iperf-mesh", "--store", store, "--rank", str(r),
                          "--world-size", str(hosts), "--duration", str(duration_s), "--json", *extra],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r, h in enumerate(net.hosts)]
        outs = communicate_all(procs, timeout_s)
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"rank {r} exited with {p.returncode}: {err.strip()}")
    report = json.loads(outs[0][0])
    report["rate_mbit"] = rate_mbit
    for link in report["links"]:
        link["of_shaped_rate"] = link["mbps"] / rate_mbit
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=50.0)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--serial", action="store_true")
    args = parser.parse_args(argv)
    extra = ["--parallel", str(args.parallel)] + (["--serial"] if args.serial else [])
    report = run(args.hosts, args.rate_mbit, args.duration, extra)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.hosts} hosts, tbf {args.rate_mbit:g} Mbit/s per link, {args.duration:g} s, "
                        f"-P {args.parallel}{', serial' if args.serial else ''}")
    for col in ("link", "Mbit/s", "of shaped", "rtt ms"):
        table.add_column(col, justify="right")
    for link in report["links"]:
        table.add_row(f"{link['src']} -> {link['dst']}", f"{link['mbps']:.1f}", f"{link['of_shaped_rate']:.0%}",
                      f"{link['rtt_ms']:.2f}")
    Console(stderr=True).print(table)
    sys.stdout.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
