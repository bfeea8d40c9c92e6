"""How long a run stands still when its store dies for good or goes silent, and what training it loses
(issues 26 and 39).

N `zb train` nodes (tiny debug model, H = 5, every node on the loopback) around a `zb store` with a
standby `zb store` second in elastic.addr. After 3 outer steps the first store is SIGKILLed (--how kill:
its connections reset at once) or SIGSTOPped (--how stop: its connections stay open and nothing answers,
as with a machine that vanished) and never comes back. Measured from the nodes' own metrics against the
moment of the kill:
- failover_s: the kill to the first outer step the whole run completed on the standby (the last node's
  first outer step after its store_failover event);
- silent_s: how long the old store had been silent when the nodes moved (elastic.store_failover_s is the floor);
- round_s: the run's outer-step period before the kill, measured in the same run: the overhead beyond
  store_failover_s is given in rounds too;
- lost: inner steps done twice or skipped on any node, and outer steps missing or repeated (both must be 0).
Profiles: default (elastic.* defaults: heartbeats 2 s / 10 s, store_failover_s 30) and short (the tests'
SHORT_TIMEOUTS and store_failover_s 5).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_store_failover.py --nodes 3 6 --profiles short default --repeats 2 \
        --how kill stop

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from zb.elastic.profiles import SHORT_TIMEOUTS
from zb.testing.cluster import TrainCluster

PROFILES = {
    "short": {**SHORT_TIMEOUTS, "ZB_ELASTIC_STORE_FAILOVER_S": "5"},
    # The defaults, spelled out: TrainCluster starts from the short profile.
    "default": {"ZERO_BAND_EDM_HEARTBEAT_INTERVAL_SECONDS": "2", "ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS": "10",
                "ZB_ELASTIC_SYNC_DEADLINE": "60", "ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS": "60",
                "ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS": "300", "ZERO_BAND_GLOBAL_STORE_POLLING_INTERVAL_SECONDS": "0.1",
                "ZB_ELASTIC_CONNECT_TIMEOUT": "30", "ZB_ELASTIC_START_TIMEOUT": "60", "ZB_ELASTIC_STORE_FAILOVER_S": "30"},
}
AFTER = 3   # outer steps the whole run takes on the standby before it stops


def one_run(tmp: Path, nodes: int, profile: str, how: str = "kill") -> dict:
    run = TrainCluster(tmp, nodes, **PROFILES[profile])
    uids = [f"n{i}" for i in range(nodes)]
    try:
        run.start_store(run.add_standby())
        for i, uid in enumerate(uids):
            run.start_train(uid, "--optim.total_steps", "100000", rank=i)
        for uid in uids:
            run.wait_outer(uid, 3, timeout=300)
        before = [e["time"] for e in run.metrics("n0", "outer_step")]
        round_s = statistics.median(b - a for a, b in zip(before, before[1:]))
        killed = time.time()
        (run.kill_store if how == "kill" else run.silence_store)()
        for uid in uids:
            run.wait_for(uid, lambda u=uid: _after_move(run, u, AFTER), "outer steps on the standby", timeout=600)
        firsts = [_after_move(run, u, 1)[0]["time"] for u in uids]
        silent = [run.metrics(u, "store_failover")[0]["silent_s"] for u in uids]
        for uid in uids:
            run.procs[uid].terminate()
        for uid in uids:
            run.finish(uid, timeout=120)
        lost = sum(_lost(run, u) for u in uids)
        return {"nodes": nodes, "profile": profile, "how": how, "failover_s": round(max(firsts) - killed, 2),
                "first_node_s": round(min(firsts) - killed, 2), "silent_s": round(statistics.median(silent), 2),
                "floor_s": float(PROFILES[profile]["ZB_ELASTIC_STORE_FAILOVER_S"]), "round_s": round(round_s, 3),
                "lost_steps": lost}
    finally:
        run.close()


def _after_move(run: TrainCluster, uid: str, n: int) -> list[dict]:
    """The node's outer steps after its move to the standby (its first `n`, or [] before there are `n`)."""
    moved = run.metrics(uid, "store_failover")
    if not moved:
        return []
    after = [e for e in run.metrics(uid, "outer_step") if e["time"] >= moved[0]["time"]]
    return after[:n] if len(after) >= n else []


def _lost(run: TrainCluster, uid: str) -> int:
    """Inner steps logged twice or skipped, plus outer steps repeated or skipped, on one node."""
    steps = [e["step"] for e in run.metrics(uid, "step")]
    outer = [e["outer_step"] for e in run.metrics(uid, "outer_step")]
    twice = len(steps) - len(set(steps)) + len(outer) - len(set(outer))
    skipped = (max(steps) - min(steps) + 1 - len(set(steps))) + (max(outer) - min(outer) + 1 - len(set(outer)))
    return twice + skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[3, 6])
    p.add_argument("--profiles", nargs="+", default=["short", "default"], choices=sorted(PROFILES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--how", nargs="+", default=["kill"], choices=["kill", "stop"],
                   help="kill: SIGKILL the store (connections reset); stop: SIGSTOP it (silent, nothing reset).")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zb-failover-") as tmp:
        for profile in args.profiles:
            for nodes, r, how in itertools.product(args.nodes, range(args.repeats), args.how):
                where = Path(tmp) / f"{profile}-{nodes}-{r}-{how}"
                where.mkdir()
                row = one_run(where, nodes, profile, how)
                rows.append(row)
                print(f"[failover] {json.dumps(row)}", file=sys.stderr, flush=True)
    print(f"{'profile':8s} {'how':>4s} {'nodes':>5s} {'floor s':>8s} {'silent s':>9s} {'first node s':>13s} {'run s':>7s} "
          f"{'over floor (rounds)':>20s} {'lost steps':>10s}")
    for row in rows:
        over = (row["failover_s"] - row["floor_s"]) / row["round_s"]
        print(f"{row['profile']:8s} {row['how']:>4s} {row['nodes']:5d} {row['floor_s']:8.1f} {row['silent_s']:9.2f} "
              f"{row['first_node_s']:13.2f} {row['failover_s']:7.2f} {over:20.1f} {row['lost_steps']:10d}")
    print(json.dumps({"bench": "store_failover", "rows": rows}))
    return 0 if all(r["lost_steps"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
