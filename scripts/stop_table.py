"""How every command ends on SIGINT and SIGTERM (issue 37): each stopped at a point of its life
(zb.testing.stops: training before its loop, joining, training; export hashing and writing; generate;
ckpt verify and ls; store; status watching, serving, waiting; ckpt-serve; subset-data; bench-allreduce;
iperf-mesh), timed from the signal to the exit, with its exit code and its one line.

    PYTHONPATH=$PWD .venv/bin/python scripts/stop_table.py [--bound 2] [--only export,store] [--repeats 3]

Prints a table and one JSON line; exits 1 when a stop's code or line is wrong, it left something behind,
or it took longer than --bound seconds (the slowest of --repeats runs counts). tests/test_stops.py runs it
under the perf marker.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from zb.testing.stops import Stage, Stop, stops

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def measure(stop: Stop, repeats: int) -> list[dict]:
    """One row per signal: the slowest of `repeats` runs, and every problem any run had."""
    rows = []
    for sig in SIGNALS:
        outcomes = [stop.run(sig) for _ in range(repeats)]
        slowest = max(outcomes, key=lambda o: o.seconds)
        rows.append({"stop": stop.name, "signal": sig.name, "code": slowest.code, "seconds": round(slowest.seconds, 3),
                     "line": slowest.line(), "problems": sorted({p for o in outcomes for p in o.problems()})})
        print(f"[stop] {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bound", type=float, default=2.0, help="Most seconds from the signal to the exit.")
    p.add_argument("--only", default="", help="Comma-separated words: only the stops whose name holds one.")
    p.add_argument("--repeats", type=int, default=1, help="Runs per stop and signal (the slowest counts).")
    args = p.parse_args(argv)
    words = [w for w in args.only.split(",") if w]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="zb-stops-") as tmp, Stage(Path(tmp)) as stage:
        for stop in stops(stage):
            if not words or any(w in stop.name for w in words):
                rows += measure(stop, args.repeats)
    for row in rows:
        if row["seconds"] > args.bound:
            row["problems"].append(f"{row['seconds']:.2f} s > {args.bound:g} s")
    print(f"{'command, at':52s} {'signal':7s} {'code':>4s} {'s':>6s}  line")
    for row in rows:
        print(f"{row['stop']:52s} {row['signal']:7s} {row['code']!s:>4s} {row['seconds']:6.2f}  {row['line'][:100]}"
              + "".join(f"\n{'':52s} PROBLEM: {problem}" for problem in row["problems"]))
    bad = [row for row in rows if row["problems"]]
    print(json.dumps({"bench": "stops", "bound_s": args.bound, "rows": rows, "ok": not bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
