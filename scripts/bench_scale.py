"""What a run's coordination costs as it grows: membership alone at N members over a real `zb store`.

Membership (`--part membership`): N real `Membership` objects with their heartbeat threads, N / P in each of
P worker processes (threads inside a process; 32 by default: a real member has a process of its own, and 125
threads on one interpreter lock, with 8, cost the members 15-25% more CPU than 31 with 32), all against one
`zb store` process on loopback. Measured:
- join: all N ask to join at once and wait for the seeded world (quorum N);
- resolutions: `--resolutions` times, every member calls `resolve()` at once (a barrier across the
  processes, then each member's own start and end on CLOCK_MONOTONIC, which all processes share); the
  resolution takes from the first start to the last end;
- for each: the store requests every client made (counted in the clients: check, get, multi_get, set, append,
  add, compare_set, wait, delete_key), the keys they named and the bytes that went each way, and the store
  process's CPU seconds and the member processes' (from /proc, outside zb: their heartbeat threads included);
- heartbeats alone: `--idle-s` seconds of nothing but the heartbeats: requests, keys and store CPU per second.
  A process's heartbeats are one thread for all its members (zb.testing.pump: the requests of one heartbeat
  thread each, without hundreds of threads starving each other on 2 cores); `late_beat_rounds` counts the
  rounds that took longer than the interval.

Nodes (`--part nodes`): N real `zb train` nodes (the debug model, one thread each, TrainCluster) on one loopback
store, for each reduce shape: the medians (and p90 of the boundary) of the roll call (resolve_s), the check-in,
the all-reduce and the whole boundary, from every node's outer_step events after its first, and whether every
node ended every outer step on the same params.

Run: PYTHONPATH=. python scripts/bench_scale.py --part membership --members 8,32,128,1000 [--json]
     PYTHONPATH=. python scripts/bench_scale.py --part nodes --nodes 4,8,16,32 [--shapes ring,halving]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zb.torch_log import quiet_torch_log  # noqa: E402

quiet_torch_log()   # as `zb` does, before torch loads: each timed-out store wait would cost reverse DNS lookups

from zb.testing.procs import PYTHON, free_port, subprocess_env  # noqa: E402
from zb.testing.pump import Pump  # noqa: E402
from zb.testing.store_count import Tally  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cfg():
    from zb.config_schema import ElasticConfig

    # The defaults of a run (heartbeat 2 s, polls 0.1 s), with room for a loaded machine: the heartbeat timeout is 60 s,
    # not 10: 1,000 members on 2 cores beat late when they all read the world at once (a round of a process's
    # beats took over 10 s, and the judges rightly dropped members the harness had not beaten for).
    return ElasticConfig(store_timeout=600, sync_deadline=120, start_timeout=600, heartbeat_timeout=60)


def _worker(index: int, uids: list[str], port: int, barrier: Any, queue: Any, phases: int, total: int) -> None:
    """One process holding `uids`: join, then `phases - 1` resolutions, each after the barrier; per phase it
    sends (index, phase, starts, ends, resolution-client tally, failures) to `queue`."""
    import torch.distributed as dist

    from zb.elastic.heartbeat import Liveness
    from zb.elastic.membership import Membership

    cfg = _cfg()
    node_tally = Tally()     # the members' own clients (joins, resolutions)
    beat_tally = Tally()     # the heartbeat threads' clients

    def connect(tally: Tally):
        def make():
            return tally.client(dist.TCPStore("127.0.0.1", port, use_libuv=True,
                                              timeout=timedelta(seconds=cfg.store_timeout)))
        return make

    members = [Membership(cfg, uid, f"tok-{uid}", 1, Liveness(cfg.heartbeat_timeout), connect(node_tally))
               for uid in uids]
    for m in members:
        m.ensure_store()
        m.client.add(f"zb/hb/{m.uid}", 1)
    # One thread beats for all of this process's members (zb.testing.pump): the same requests as a heartbeat
    # thread each, without hundreds of threads on one interpreter lock starving the beats.
    pump = Pump(connect(beat_tally), members, cfg.heartbeat_interval)
    pump.start()
    # A thread per member for the whole run, released at each phase: made at each phase, the last of a process's
    # 125 threads started hundreds of ms after the first, and the resolution's span measured the harness.
    go, done = threading.Barrier(len(members) + 1), threading.Barrier(len(members) + 1)
    results: list[tuple[str, float, float, str | None]] = [("", 0.0, 0.0, None)] * len(members)

    def member(i: int, m: Any) -> None:
        for phase in range(phases):
            go.wait()
            _act(results, i, m, phase, total)
            done.wait()

    for i, m in enumerate(members):
        threading.Thread(target=member, args=(i, m), daemon=True).start()
    try:
        for phase in range(phases):
            barrier.wait()
            node_tally.clear()
            go.wait()
            done.wait()
            starts = {uid: t0 for uid, t0, _, _ in results}
            ends = {uid: t1 for uid, _, t1, _ in results}
            failures = [f for _, _, _, f in results if f]
            versions = sorted({m.world.version for m in members if m.world is not None})
            queue.put((index, phase, starts, ends, dict(node_tally.totals()), failures, versions))
        barrier.wait()                                  # the idle phase: heartbeats only
        beat_tally.clear()
        barrier.wait()
        queue.put((index, "idle", dict(beat_tally.totals()), pump.late))
    finally:
        pump.stop()


def _act(results: list, i: int, m: Any, phase: int, total: int) -> None:
    """Member `m`'s part of `phase` (0: join with quorum `total`; later: one resolution), into results[i]."""
    t0, failure = time.monotonic(), None
    try:
        world = m.join(quorum=total, quorum_timeout=m.cfg.start_timeout) if phase == 0 else m.resolve()
        if m.uid not in world.nodes:
            failure = f"{m.uid}: not in its world"
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        failure = f"{m.uid}: {type(e).__name__}: {str(e)[:200]}"
    results[i] = (m.uid, t0, time.monotonic(), failure)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _start_store(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([PYTHON, "-m", "zb", "store", "--host", "127.0.0.1", "--port", str(port), "-q"],
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    from zb.dial import wait_listening

    if wait_listening("127.0.0.1", port, 60.0, "--port") is not None:
        raise SystemExit(f"zb store did not listen on port {port}")
    return proc


def membership(n: int, procs: int, resolutions: int, idle_s: float) -> dict:
    port = free_port()
    store = _start_store(port)
    ctx = mp.get_context("spawn")
    procs = max(1, min(procs, n))
    barrier, queue = ctx.Barrier(procs + 1), ctx.Queue()
    uids = [f"m{i:04d}" for i in range(n)]
    groups = [uids[i::procs] for i in range(procs)]
    phases = 1 + resolutions
    workers = [ctx.Process(target=_worker, args=(i, g, port, barrier, queue, phases, n), daemon=True)
               for i, g in enumerate(groups)]
    for w in workers:
        w.start()
    rows = []
    try:
        for phase in range(phases):
            barrier.wait(timeout=900)
            cpu0, members0 = _cpu_s(store.pid), sum(_cpu_s(w.pid) for w in workers if w.pid)
            got = [queue.get(timeout=900) for _ in workers]
            cpu1, members1 = _cpu_s(store.pid), sum(_cpu_s(w.pid) for w in workers if w.pid)
            starts = [t for g in got for t in g[2].values()]
            ends = [t for g in got for t in g[3].values()]
            tally: Counter = Counter()
            for g in got:
                tally.update(g[4])
            failures = [f for g in got for f in g[5]]
            versions = sorted({v for g in got for v in g[6]})
            first = min(starts)
            ended = sorted(t - first for t in ends)
            rows.append({"members": n, "phase": "join" if phase == 0 else f"resolve{phase}",
                         "seconds": round(ended[-1], 3), "first_end_s": round(ended[0], 3),
                         "median_end_s": round(ended[len(ended) // 2], 3),
                         "last_start_s": round(max(starts) - first, 3), "requests": tally["requests"],
                         "keys": tally["keys"], "bytes": tally["bytes_up"] + tally["bytes_down"],
                         "store_cpu_s": round(cpu1 - cpu0, 3), "members_cpu_s": round(members1 - members0, 3),
                         "failures": failures[:3],
                         "worlds": versions,
                         "ops": {k[3:]: v for k, v in sorted(tally.items()) if k.startswith("op_")}})
        barrier.wait(timeout=900)
        cpu0, t0 = _cpu_s(store.pid), time.monotonic()
        time.sleep(idle_s)
        barrier.wait(timeout=900)
        cpu1, t1 = _cpu_s(store.pid), time.monotonic()
        idle: Counter = Counter()
        late = 0
        for _ in workers:
            got_idle = queue.get(timeout=900)
            idle.update(got_idle[2])
            late += got_idle[3]
        span = t1 - t0
        heartbeats = {"requests_per_s": round(idle["requests"] / span, 1), "keys_per_s": round(idle["keys"] / span),
                      "bytes_per_s": round((idle["bytes_up"] + idle["bytes_down"]) / span),
                      "store_cpu_share": round((cpu1 - cpu0) / span, 3), "late_beat_rounds": late}
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
        store.terminate()
        store.wait(timeout=30)
    resolves = [r for r in rows if r["phase"] != "join"]
    return {"members": n, "processes": procs, "join": rows[0], "resolutions": resolves,
            "resolve_median_s": statistics.median(r["seconds"] for r in resolves),
            "resolve_requests_median": statistics.median(r["requests"] for r in resolves),
            "resolve_bytes_median": statistics.median(r["bytes"] for r in resolves),
            "resolve_store_cpu_median_s": statistics.median(r["store_cpu_s"] for r in resolves),
            "resolve_members_cpu_median_s": statistics.median(r["members_cpu_s"] for r in resolves),
            "heartbeats": heartbeats}


def nodes(n: int, outer_steps: int, compression: str, shape: str) -> dict:
    """N real `zb train` nodes (the debug model, one thread each) on one loopback store for `outer_steps` outer
    steps: the medians of what their outer_step events say each part of an outer step took (outer steps after
    the first, every node), and whether every node ended every outer step on the same params."""
    import tempfile

    from zb.testing.cluster import TrainCluster

    steps = 5 * outer_steps
    with tempfile.TemporaryDirectory() as tmp:
        cluster = TrainCluster(Path(tmp), n)
        try:
            t0 = time.monotonic()
            uids = [f"n{i:02d}" for i in range(n)]
            for i, uid in enumerate(uids):
                cluster.start_train(uid, "--optim.total_steps", str(steps), "--diloco.compression", compression,
                                    "--diloco.reduce_shape", shape, rank=i)
            codes = {uid: cluster.finish(uid, timeout=600 + 30 * n) for uid in uids}
            wall = time.monotonic() - t0
            events = {uid: [e for e in cluster.metrics(uid, "outer_step") if e["outer_step"] > 1] for uid in uids}
        finally:
            cluster.close()
    hashes = [{e["outer_step"]: e.get("params_hash") for e in evs if e["applied"]} for evs in events.values()]
    agree = all(h == hashes[0] for h in hashes) and bool(hashes[0])
    row = {"nodes": n, "compression": compression, "shape": shape, "exit_codes": sorted(set(codes.values())),
           "agree": agree, "outer_steps": len(hashes[0]), "wall_s": round(wall, 1)}
    for part in ("resolve_s", "checkin_s", "allreduce_s", "boundary_s"):
        values = [e[part] for evs in events.values() for e in evs]
        row[part] = round(statistics.median(values), 3) if values else None
        row[part.replace("_s", "_p90_s")] = round(sorted(values)[int(0.9 * (len(values) - 1))], 3) if values else None
    return row


def _nodes_table(rows: list[dict]) -> str:
    head = (f"{'nodes':>5} {'width':>6} {'shape':>8} {'agree':>5} {'resolve s':>10} {'check-in s':>10} "
            f"{'all-reduce s':>12} {'boundary s':>10} {'(p90)':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['nodes']:>5} {r['compression']:>6} {r['shape']:>8} {str(r['agree']):>5} {r['resolve_s']:>10} "
                     f"{r['checkin_s']:>10} {r['allreduce_s']:>12} {r['boundary_s']:>10} {r['boundary_p90_s']:>7}")
    return "\n".join(lines)


def _table(results: list[dict]) -> str:
    head = (f"{'members':>8} {'join s':>8} {'resolve s':>10} {'requests':>9} {'req/N':>6} {'keys':>9} "
            f"{'bytes':>11} {'store CPU s':>11} {'members CPU s':>13} | {'hb req/s':>8} {'hb keys/s':>10} "
            f"{'hb store CPU':>12}")
    lines = [head, "-" * len(head)]
    for r in results:
        hb = r["heartbeats"]
        lines.append(f"{r['members']:>8} {r['join']['seconds']:>8.2f} {r['resolve_median_s']:>10.3f} "
                     f"{r['resolve_requests_median']:>9.0f} {r['resolve_requests_median'] / r['members']:>6.1f} "
                     f"{statistics.median(x['keys'] for x in r['resolutions']):>9.0f} "
                     f"{r['resolve_bytes_median']:>11.0f} {r['resolve_store_cpu_median_s']:>11.3f} "
                     f"{r['resolve_members_cpu_median_s']:>13.3f} | "
                     f"{hb['requests_per_s']:>8.1f} {hb['keys_per_s']:>10} {hb['store_cpu_share']:>12.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["membership", "nodes"], default="membership")
    parser.add_argument("--nodes", default="4,8,16,32", help="--part nodes: comma-separated node counts")
    parser.add_argument("--outer-steps", type=int, default=6, help="--part nodes: outer steps a run (5 inner steps each)")
    parser.add_argument("--compression", default="int8", help="--part nodes: diloco.compression")
    parser.add_argument("--shapes", default="ring,halving", help="--part nodes: diloco.reduce_shape values, each a run")
    parser.add_argument("--members", default="8,32,128", help="comma-separated member counts")
    parser.add_argument("--processes", type=int, default=32, help="worker processes holding the members (threads inside each)")
    parser.add_argument("--resolutions", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of heartbeats alone, measured")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    if args.part == "nodes":
        rows = []
        for n in (int(x) for x in args.nodes.split(",")):
            for shape in args.shapes.split(","):
                rows.append(nodes(n, args.outer_steps, args.compression, shape))
                if not args.json:
                    print(f"[{n} nodes, {shape} done]", file=sys.stderr, flush=True)
        if not args.json:
            print(_nodes_table(rows))
        doc = {"bench": "scale", "part": "nodes", "results": rows}
        print(json.dumps(doc))
        return doc
    results = []
    for n in (int(x) for x in args.members.split(",")):
        results.append(membership(n, args.processes, args.resolutions, args.idle_s))
        if not args.json:
            print(f"[{n} members done]", file=sys.stderr, flush=True)
    doc = {"bench": "scale", "part": args.part, "results": results}
    if not args.json:
        print(_table(results))
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
