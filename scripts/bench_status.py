"""What one `zb status` refresh costs the run's store, for N nodes: store operations, bytes and time.

A real `zb store` process is filled with N simulated nodes as a run of N nodes leaves it: the world,
join requests, heartbeat counters, and each node's status record and full history (zb.status.record,
at its bounds). Then, against that store, in one run:
- baseline: one `get` of one key (a round trip to the store);
- per-key: what a reader without multi_get would do (one check + one get per key, as many keys as ours);
- table: RunReader.read(), what `zb status` and each --watch refresh do;
- dash_new: RunReader.read(with_history=True) when every node's history changed since the last sample
  (a fresh reader: it reads at most 64 histories per sample, the longest unread first);
- dash_same: the same when no history changed (records and heartbeats only).
And for R runs on one store (--runs, each of --run-nodes nodes in its own namespace, listed on the store's
list of runs, zb.elastic.runs):
- list: StoreView.read(), what `zb status` without --namespace and each --watch refresh do (one run: the run
  itself, as ever; two or more: the list, a row per run);
- list_dash: the same with the histories (the dashboard's sample), when no history changed.
Store operations are counted by a proxy around the client; times are the median of --repeats.
The writers' side: each node sets its record every elastic.status_interval s and its history when
it changed, so N nodes add 2N/interval sets per second of a few hundred bytes + a few KB.

Run: PYTHONPATH=. python scripts/bench_status.py [--nodes 1,8,64,256] [--runs 1,2,4] [--run-nodes 8] [--repeats 20]
[--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Counting:
    """A store client that counts the operations and the bytes they return (into `tally`, another Counting, when
    several clients count together)."""

    def __init__(self, store, tally: Counting | None = None) -> None:
        self.store, self.ops, self.bytes = store, 0, 0
        self.tally = tally or self

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            self.tally.ops += 1
            result = method(*args, **kwargs)
            if isinstance(result, bytes):
                self.tally.bytes += len(result)
            elif isinstance(result, list):
                self.tally.bytes += sum(len(r) for r in result if isinstance(r, bytes))
            return result

        return call


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill(store, n: int, prefix: str) -> list[str]:
    """N nodes in the world, each with a full record and history; returns their ids."""
    from zb.elastic import keys
    from zb.elastic.store_state import encode_line
    from zb.elastic.world import World
    from zb.status.record import HISTORY_POINTS, MEMBERSHIP_POINTS, OUTER_POINTS, NodeStatus, encode

    uids = [f"{prefix}-node-{i:04d}" for i in range(n)]
    store.set(keys.WORLD, World(version=7, resolution=9, nodes=uids, tokens={u: "t" * 12 for u in uids},
                                join_cursor=n).encode())
    now = time.time()
    for i, uid in enumerate(uids):
        store.append(keys.JOINS, encode_line({"uid": uid, "token": "t" * 12, "pref_rank": i}))
        store.add(keys.heartbeat(uid), 1)
        status = NodeStatus(uid, state="training", total_steps=100000, heartbeat_interval=2.0, heartbeat_timeout=10.0)
        status.observe({"event": "run_start", "time": now, "host": f"host-{i}.example.net", "pid": 4242,
                        "device": "cuda", "local_world_size": 8})
        for j in range(MEMBERSHIP_POINTS):
            status.observe({"event": "membership", "time": now + j, "mesh_version": j + 1, "global_world_size": n,
                            "leader": uids[0], "joined": [uid], "left": [], "died": [], "global_rank": i})
        for j in range(HISTORY_POINTS):
            status.observe({"event": "step", "time": now + j, "step": 1000 + j, "outer_step": 10, "loss": 2.345678,
                            "tokens": 123456789, "tokens_per_s": 54321.5, "run_tokens": 987654321})
        for j in range(OUTER_POINTS):
            status.observe({"event": "outer_step", "time": now + j, "outer_step": j, "step": 1000, "mesh_version": 7,
                            "global_world_size": n, "num_peers": n, "allreduce_s": 12.3456, "wire_bytes": 123456789,
                            "wire_mbps": 98.76})
        record, history, _ = status.snapshot()
        store.append(keys.STATUS_INDEX, uid + "\n")
        store.set(keys.status(uid), encode(record))
        store.set(keys.status_history(uid), encode(history))
    return uids


def _timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def measure(client, n: int, repeats: int) -> dict:
    """One run of `n` nodes, under its own prefix of the store (so runs of other sizes are not read)."""
    import torch.distributed as dist

    from zb.elastic import keys
    from zb.status.reader import RunReader

    client = dist.PrefixStore(f"bench-{n}/", client)
    uids = fill(client, n, f"n{n}")
    counting = Counting(client)
    reader = RunReader(counting, "bench")
    rows = {}

    def run(name: str, fn) -> None:
        counting.ops = counting.bytes = 0
        fn()
        ops, size = counting.ops, counting.bytes
        seconds, _ = _timed(fn, repeats)
        rows[name] = {"ops": ops, "bytes": size, "ms": round(seconds * 1e3, 3)}

    run("baseline", lambda: counting.get(keys.WORLD))
    per_key = [keys.status(u) for u in uids] + [keys.heartbeat(u) for u in uids]
    run("per_key", lambda: [counting.get(k) for k in per_key if counting.check([k])])
    run("table", lambda: reader.read())
    # A fresh reader has read no history yet: every node's counts as changed (up to the budget of 64).
    run("dash_new", lambda: RunReader(counting, "bench").read(with_history=True))
    for _ in range(-(-n // reader.history_budget) + 1):     # until every history was read once
        reader.read(with_history=True)
    run("dash_same", lambda: reader.read(with_history=True))
    base = rows["baseline"]["ms"]
    for row in rows.values():
        row["x_round_trip"] = round(row["ms"] / base, 1)
    return {"nodes": n, **rows}


def measure_runs(client, runs: int, nodes: int, repeats: int) -> dict:
    """`runs` runs of `nodes` nodes each, in namespaces of their own under one prefix of the store (its root for
    them: the list of runs is there), listed as StoreView lists them."""
    import torch.distributed as dist

    from zb.elastic import keys
    from zb.elastic.runs import start_line
    from zb.status.listing import StoreView
    from zb.status.reader import RunReader

    root = dist.PrefixStore(f"bench-runs-{runs}/", client)
    names = [f"model-{i}" for i in range(runs)]
    for name in names:
        fill(dist.PrefixStore(name, root), nodes, f"r{runs}-{name}")
        root.append(keys.RUNS, start_line(name, secret=False))
    tally = Counting(root)
    # Each run's reader reads under its namespace (what RunReader does with namespace=NAME, on a counted client).
    view = StoreView([tally], lambda name: RunReader(Counting(dist.PrefixStore(name, root), tally), "bench"), "bench")
    rows = {}
    for label, history in (("list", False), ("list_dash", True)):
        for _ in range(-(-nodes // 64) + 1):     # every history read once: a refresh reads only the changed ones
            view.read(with_history=history)
        tally.ops = tally.bytes = 0
        view.read(with_history=history)
        ops, size = tally.ops, tally.bytes
        seconds, _ = _timed(lambda history=history: view.read(with_history=history), repeats)
        rows[label] = {"ops": ops, "bytes": size, "ms": round(seconds * 1e3, 3)}
    return {"runs": runs, "nodes_per_run": nodes, **rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,8,64,256", help="comma-separated node counts")
    parser.add_argument("--runs", default="1,2,4", help="comma-separated counts of runs on one store")
    parser.add_argument("--run-nodes", type=int, default=8, help="nodes of each of those runs")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)

    from zb.elastic.keys import is_counter
    from zb.store_clients import run_client

    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    store_proc = subprocess.Popen([sys.executable, "-m", "zb", "store", "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = run_client("127.0.0.1", port, 60.0, 60.0, counters=is_counter)
        results = [measure(client, int(n), args.repeats) for n in args.nodes.split(",")]
        listed = [measure_runs(client, int(r), args.run_nodes, args.repeats) for r in args.runs.split(",")]
    finally:
        store_proc.terminate()
        store_proc.wait(30)
    doc = {"bench": "status", "repeats": args.repeats, "results": results, "runs": listed}
    if not args.json:
        print(f"{'nodes':>6} | {'what':<9} {'store ops':>9} {'KB read':>9} {'ms':>9} {'x round trip':>12}",
              file=sys.stderr)
        for r in results:
            for name in ("baseline", "per_key", "table", "dash_new", "dash_same"):
                row = r[name]
                print(f"{r['nodes']:>6} | {name:<9} {row['ops']:>9} {row['bytes'] / 1024:>9.1f} {row['ms']:>9.3f} "
                      f"{row['x_round_trip']:>12.1f}", file=sys.stderr)
        print(f"{'runs':>6} | {'what':<9} {'store ops':>9} {'KB read':>9} {'ms':>9}   ({args.run_nodes} nodes per run)",
              file=sys.stderr)
        for r in listed:
            for name in ("list", "list_dash"):
                row = r[name]
                print(f"{r['runs']:>6} | {name:<9} {row['ops']:>9} {row['bytes'] / 1024:>9.1f} {row['ms']:>9.3f}",
                      file=sys.stderr)
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
