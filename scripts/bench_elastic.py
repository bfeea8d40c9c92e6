"""Elastic recovery and rebuild times on real processes (loopback, gloo, CPU).

Recovery: time from a signal to a follower (SIGKILL, SIGTERM with its deathrattle, SIGSTOP) or a
SIGKILL of the leader to the survivors' next successful all-reduce over the new groups, compared
with the configured timeouts of the test profile. Rebuild: time to build a replica group's
ProcessGroupGloo for 2, 4 and 8 nodes (forced new mesh versions, no membership change).

Run: PYTHONPATH=. python scripts/bench_elastic.py [--repeats 3] [--sizes 2,4,8]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from zb.testing.cluster import PROFILE, Cluster

KINDS = {"sigkill": (signal.SIGKILL, "c"), "sigkill-leader": (signal.SIGKILL, "a"),
         "sigterm": (signal.SIGTERM, "c"), "sigstop": (signal.SIGSTOP, "c")}


def recovery_once(kind: str, step_time: float) -> float:
    sig, victim = KINDS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.start_store()
            nodes = dict(zip("abc", cluster.start_world(3, "--step-time", str(step_time))))
            cluster.agreement(list(nodes.values()), 3, timeout=90)
            time.sleep(1.0)
            sent = nodes.pop(victim).signal(sig)
            view = cluster.agreement(list(nodes.values()), 2, after=sent, timeout=90)
            return view["all_time"] - sent
        finally:
            cluster.close()


def rebuild_times(n: int, versions: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.start_store()
            nodes = cluster.start_world(n, "--step-time", "0.3", "--force-rebuild-every", "2")
            first = cluster.agreement(nodes, n, timeout=120)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and _versions_seen(nodes) < first["version"] + versions:
                time.sleep(0.5)
            return _rebuild_stats(nodes, first["version"])
        finally:
            cluster.close()


def _versions_seen(nodes) -> int:
    return min(max([s["version"] for s in n.events("step")] or [0]) for n in nodes)


def _rebuild_stats(nodes, after_version: int) -> dict:
    per_version: dict[int, list[float]] = {}
    for node in nodes:
        for step in node.events("step"):
            if step["version"] > after_version and step["rebuild_s"] > 0:
                per_version.setdefault(step["version"], []).append(step["rebuild_s"])
    full = [v for v in per_version.values() if len(v) == len(nodes)]
    return {"build_s": statistics.median(min(v) for v in full),        # last arriver: the build itself
            "with_skew_s": statistics.median(max(v) for v in full),    # first arriver waits for the rest
            "versions": len(full)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", default="2,4,8")
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--versions", type=int, default=6)
    args = p.parse_args(argv)
    results: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.repeats):          # interleaved: noise hits every kind alike
        for kind in KINDS:
            results[kind].append(recovery_once(kind, args.step_time))
    rebuild = {n: rebuild_times(n, args.versions) for n in map(int, args.sizes.split(","))}
    report(results, rebuild, args)
    return 0


def report(results: dict, rebuild: dict, args) -> None:
    from rich.console import Console
    from rich.table import Table

    hb_timeout = float(PROFILE["ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS"])
    pg_timeout = float(PROFILE["ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS"])
    bound = {"sigkill": hb_timeout, "sigkill-leader": hb_timeout, "sigterm": 1.0, "sigstop": hb_timeout + pg_timeout}
    table = Table(title=f"recovery to the next successful all-reduce (3 nodes, step {args.step_time} s)")
    for col in ("event", "median s", "max s", "target s", "median / target"):
        table.add_column(col, justify="right")
    summary: dict = {"recovery": {}, "rebuild": {}, "profile": PROFILE}
    for kind, times in results.items():
        med = statistics.median(times)
        table.add_row(kind, f"{med:.2f}", f"{max(times):.2f}", f"{bound[kind]:g}", f"{med / bound[kind]:.2f}")
        summary["recovery"][kind] = {"median_s": round(med, 3), "max_s": round(max(times), 3), "target_s": bound[kind],
                                     "runs": [round(t, 3) for t in times]}
    rb = Table(title="global group rebuild (median over forced new mesh versions)")
    for col in ("nodes", "build ms", "incl. arrival skew ms", "versions"):
        rb.add_column(col, justify="right")
    for n, stats in rebuild.items():
        rb.add_row(str(n), f"{stats['build_s'] * 1e3:.1f}", f"{stats['with_skew_s'] * 1e3:.1f}", str(stats["versions"]))
        summary["rebuild"][n] = {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()}
    console = Console(stderr=True)
    console.print(table)
    console.print(rb)
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
