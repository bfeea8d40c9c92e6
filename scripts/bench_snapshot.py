"""What one read of the store's snapshot costs (zb.elastic.store_state.read_snapshot): store operations and time.

read_many reads every key in one `multi_get` when all exist, else one key at a time (a `check` and a `get`
each). A seeded world makes every key a resolution reads exist; before issue 39's fix, `zb/finished` (absent
until a run ends) and `zb/stayed` (absent unless claimed) sent every read down the slow path. This reads a
roll call's snapshot N times through a counting client over a loopback store hosted in this process, with
those two keys absent and then present, alternating, and prints the store operations per read and the median
time of a read (loopback: on a WAN each operation is a round trip).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_snapshot.py --reads 300 --repeats 3

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

from zb.elastic import keys
from zb.elastic.store_state import read_snapshot
from zb.elastic.tcpstore import host


class Counting:
    """A store client that counts the operations made through it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.ops = inner, 0

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return op(*args, **kwargs)

        return counted


def measure(client: Counting, reads: int, label: str) -> dict:
    client.ops, times = 0, []
    for _ in range(reads):
        started = time.perf_counter()
        read_snapshot(client, 1)
        times.append(time.perf_counter() - started)
    return {"case": label, "ops_per_read": client.ops / reads, "us_median": statistics.median(times) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reads", type=int, default=300, help="snapshot reads per case and repeat")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.reads < 1 or args.repeats < 1:
        p.error("--reads and --repeats must be at least 1")
    import torch.distributed as dist

    store = host("127.0.0.1", 0)
    raw = dist.TCPStore("127.0.0.1", store.port, use_libuv=True, timeout=timedelta(seconds=10))
    for key in (keys.WORLD, keys.GONE, keys.JOINS, keys.MOVED, keys.EVICTED):
        raw.set(key, b"")
    raw.add(keys.roll_call_events(1), 1)
    raw.append(keys.roll_call(1), "{}\n")
    client, rows = Counting(raw), []
    for _ in range(args.repeats):
        for key in (keys.FINISHED, keys.STAYED):
            raw.delete_key(key)
        rows.append(measure(client, args.reads, "absent"))
        for key in (keys.FINISHED, keys.STAYED):
            raw.set(key, b"")
        rows.append(measure(client, args.reads, "present"))
    print(f"{'zb/finished, zb/stayed':>24s} {'store ops per read':>19s} {'us per read (median)':>21s}")
    for row in rows:
        print(f"{row['case']:>24s} {row['ops_per_read']:19.1f} {row['us_median']:21.0f}")
    ratios = [a["us_median"] / b["us_median"] for a, b in zip(rows[::2], rows[1::2])]
    print(f"absent / present time: median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    print(json.dumps({"bench": "snapshot", "rows": rows, "time_ratio": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
