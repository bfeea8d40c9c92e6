"""What a partition of each shape costs a run (issue 39): seconds without an applied outer step on each side.

Four `zb train` nodes (tiny debug model, H = 5, the tests' short-timeout profile), each on an emulated host of
its own (zb.net.netns through scripts/_chaos_netns.py), `zb store` A on another host and, for the failover
shapes, store B on a sixth host that every host reaches (elastic.addr A,B, elastic.store_failover_s short).
For each shape a fresh run applies a few outer steps; then nft drops every packet of the cut (no reset) for a
fixed time longer than the heartbeat timeout and store_failover_s; then the cut heals and the run goes on until
it is one world of all 4 again, and stops (SIGTERM). Shapes (the cut nodes are the highest ranks; n0, the
leader, stays with store A):

  cut1      1 of 4 cut from the store, one store
  cut2      2 of 4 cut from the store, one store
  cut1-ab   1 of 4 cut from store A, failover list A,B
  cut2-ab   2 of 4 cut from store A, failover list A,B
  cut3-ab   3 of 4 cut from store A, failover list A,B
  groups    n0,n1 and n2,n3 cut from each other (both reach the store), one store
  silent-a  store A's host silent for good (every packet dropped, never healed), failover list A,B

Measured from the nodes' own metrics (wall-clock times of the outer steps they applied, with mesh version and
world size; scripts/_partition_report.py), outside zb's decisions: per side, the time from the cut to its next
applied outer step and the longest time without one; the time from the cut and from the heal (silent-a: never
healed) to one world of all 4 (it may come before the heal: the run moved to store B whole); whether two
worlds ever applied outer steps at overlapping times (must be never); whether the nodes that reached the last
outer step hold one params_hash.

    sudo PYTHONPATH=$PWD .venv/bin/python scripts/bench_partition.py                   # every shape once
    sudo PYTHONPATH=$PWD .venv/bin/python scripts/bench_partition.py --shapes cut1,groups --repeats 2 --keep /tmp/p
    sudo PYTHONPATH=$PWD .venv/bin/python scripts/bench_partition.py --quick --shapes cut1      # a smoke run

Prints a table and one JSON line; exits 1 when a check failed (two worlds, a hash mismatch, no one world of 4
within --bound, a node exiting), 2 on a bad invocation or where namespaces cannot be built.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _partition_report import by_world, last_agreement, reunited, side_cost, two_worlds

from zb.testing.cluster import PROFILE
from zb.testing.procs import REPO, wait_until

UIDS = ["n0", "n1", "n2", "n3"]
HEARTBEAT_TIMEOUT = float(PROFILE["ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS"])
STORE_TIMEOUT = float(PROFILE["ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS"])
START_BOUND = 180.0     # 4 nodes importing torch and building the model on 2 busy cores
STOP_BOUND = 60.0


@dataclass(frozen=True)
class Shape:
    name: str
    words: str
    cut: int = 0               # nodes cut from store A: the highest ranks
    failover: bool = False     # elastic.addr A,B
    groups: bool = False       # n0,n1 | n2,n3
    silent: bool = False       # store A's host drops everything, for good
    stagger_s: float = 0.0     # seconds between one cut node's cut and the next's (highest rank first)

    def sides(self) -> dict[str, list[str]]:
        if self.silent:
            return {"all": UIDS}
        if self.groups:
            return {"n0,n1": UIDS[:2], "n2,n3": UIDS[2:]}
        return {"store": UIDS[:len(UIDS) - self.cut], "cut": UIDS[len(UIDS) - self.cut:]}


SHAPES = [Shape("cut1", "1 of 4 cut from the store", cut=1), Shape("cut2", "2 of 4 cut from the store", cut=2),
          Shape("cut1-ab", "1 of 4 cut from store A", cut=1, failover=True),
          Shape("cut2-ab", "2 of 4 cut from store A", cut=2, failover=True),
          Shape("cut3-ab", "3 of 4 cut from store A", cut=3, failover=True),
          Shape("groups", "n0,n1 | n2,n3, both reach the store", groups=True),
          Shape("silent-a", "store A's host silent for good", failover=True, silent=True),
          # Not one of issue 39's seven (not run by default): cut2-ab with n2's cut coming after the store's side
          # dropped n3 alone, so that it drops the two in two worlds, each a majority of the one before.
          Shape("cut2-ab-late", "2 of 4 cut from store A, n2 8 s after n3", cut=2, failover=True,
                stagger_s=HEARTBEAT_TIMEOUT + 3)]
BY_NAME = {s.name: s for s in SHAPES}
DEFAULT_SHAPES = [s.name for s in SHAPES if not s.stagger_s]


def settings(shape: Shape, failover_s: float) -> str:
    return f"A,B; store_failover_s {failover_s:g}" if shape.failover else "A"


# -- one run ---------------------------------------------------------------------------------------------
def start_standby(run, host) -> subprocess.Popen:
    """Store B on `host`, second in every node's elastic.addr (GLOBAL_ADDR=A,B, both on the run's port)."""
    run.env["GLOBAL_ADDR"] = f"{run.store_host.addr},{host.addr}"
    err = run.tmp / "store-b.err"
    proc = subprocess.Popen(host.command([sys.executable, "-m", "zb", "store", "--host", host.addr, "--port",
                                          str(run.port)]), env=run.env, stdout=subprocess.DEVNULL,
                            stderr=open(err, "a"), cwd=REPO)
    wait_until(lambda: host.run(["ss", "-ltnH", f"sport = :{run.port}"], timeout=10).stdout.strip(), 60,
               f"store B listening in {host.name}", alive=[proc], details=lambda: err.read_text()[-2000:])
    return proc


def cut(shape: Shape, run, standby_host):
    """Drop every packet of the shape's cut (nft, no reset); returns when it began and how to heal it (None: never
    healed)."""
    from _chaos_netns import set_partition

    hosts = [run.host_of[u] for u in UIDS]
    if shape.silent:
        for other in [*hosts, standby_host]:
            set_partition(run.store_host, other, True)
        return time.time(), None
    if shape.groups:
        for a in hosts[:2]:
            for b in hosts[2:]:
                set_partition(a, b, True)
        cut_hosts, far, began = hosts[:2], hosts[2], time.time()
    else:
        cut_hosts, far, began = list(reversed(hosts[len(hosts) - shape.cut:])), run.store_host, None
        for host in cut_hosts:
            if began is not None:
                time.sleep(shape.stagger_s)   # the next node's link to the store fails later
            set_partition(host, far, True)
            began = began or time.time()
    return began, lambda: [set_partition(host, far, False) for host in cut_hosts]   # the rules live in cut_hosts


def events(tails) -> dict[str, list[dict]]:
    return {u: t.events("membership") + t.events("outer_step") for u, t in tails.items()}


def exited(run) -> dict[str, int]:
    return {u: p.poll() for u, p in run.procs.items() if p.poll() is not None}


def one_shape(shape: Shape, tmp: Path, args) -> dict:
    from _chaos_checks import Tail
    from _chaos_netns import NetnsCluster

    from zb.net.netns import emulated_hosts

    with emulated_hosts(len(UIDS) + 2) as net:     # store A, the nodes, store B (idle without a failover list)
        env = {"ZB_ELASTIC_STORE_FAILOVER_S": str(args.failover_s)} if shape.failover else {}
        run, standby, heal = NetnsCluster(tmp, len(UIDS), net, **env), None, None
        try:
            if shape.failover:
                standby = start_standby(run, net.hosts[-1])
            for i, uid in enumerate(UIDS):
                run.start_train(uid, "--optim.total_steps", "100000", rank=i)
                assert run.host_of[uid] is not net.hosts[-1], "a node on store B's host"
            tails = {u: Tail(tmp / u / "metrics.jsonl") for u in UIDS}
            for uid in UIDS:
                run.wait_outer(uid, args.before, timeout=START_BOUND)
            cut_at, heal = cut(shape, run, net.hosts[-1])
            while time.time() < cut_at + args.cut_s and not exited(run):
                time.sleep(0.5)       # the partition held: the benchmark's fault, not a wait in zb
            heal_at = None
            if heal is not None:
                heal()
                heal, heal_at = None, time.time()
            since = heal_at or cut_at
            while not (whole := reunited(by_world(events(tails)), UIDS, cut_at, heal_at)) and not exited(run) \
                    and time.time() < since + args.bound:
                time.sleep(0.5)
            end = whole[0] if whole else time.time()
            early = exited(run)
            for uid in UIDS:
                if uid not in early:
                    os.killpg(run.procs[uid].pid, signal.SIGTERM)
            codes = {u: _finish(run, u) for u in UIDS}
            row = measure(shape, events(tails), cut_at, heal_at, end, whole, args)
            row.update(exits=codes, exited_early=early,
                       logs={u: run.log(u) for u in UIDS} if early or not whole or row["two_worlds"] else {})
            return row
        finally:
            if heal is not None:
                heal()
            run.close()
            if standby is not None and standby.poll() is None:
                standby.kill()
                standby.wait(10)


def _finish(run, uid: str) -> int | None:
    try:
        return run.procs[uid].wait(STOP_BOUND)
    except subprocess.TimeoutExpired:
        return None    # did not stop: close() kills it


def measure(shape: Shape, evs: dict[str, list[dict]], cut_at: float, heal_at: float | None, end: float,
            whole, args) -> dict:
    worlds = by_world(evs)
    before = sorted(e["time"] for e in evs["n0"] if e["event"] == "outer_step" and e["applied"] and e["time"] <= cut_at)
    sides = [{"side": name, "nodes": nodes, **side_cost(worlds, nodes, cut_at, heal_at, end, open_end=not whole)}
             for name, nodes in shape.sides().items()]
    return {"shape": shape.name, "settings": settings(shape, args.failover_s), "cut_s": round(heal_at - cut_at, 1) if heal_at else None,
            "round_s": round(statistics.median(b - a for a, b in zip(before, before[1:])), 2) if len(before) > 1 else None,
            "sides": sides, "one_world_after_cut_s": round(whole[0] - cut_at, 2) if whole else None,
            "one_world_s": round(whole[0] - heal_at, 2) if whole and heal_at else None,
            "one_world_version": whole[1][0] if whole else None,
            "two_worlds": two_worlds(worlds), **last_agreement(worlds)}


def failed(row: dict) -> list[str]:
    out = [*row["two_worlds"]]
    if row["one_world_after_cut_s"] is None:
        out.append(f"no one world of all 4 within the bound (exited: {row['exited_early'] or 'none'})")
    elif row["exited_early"]:
        out.append(f"nodes exited on their own: {row['exited_early']}")
    if not row["same_hash"]:
        out.append(f"params_hash differs at the last outer step {row['last_step']} among {row['reached']}")
    return out


# -- the report ---------------------------------------------------------------------------------------------
def _s(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_table(rows: list[dict]) -> None:
    """One line per side; the run's columns on its first side's line. "one world" is the first time all 4 had
    applied an outer step in one world of 4 formed after the cut, from the cut and from the heal (negative: whole
    again before the heal)."""
    print(f"{'shape':9s} {'stores':24s} {'side':6s} {'nodes':12s} {'round s':>7s} {'next s':>7s} {'gap s':>7s} "
          f"{'steps in cut':>12s} {'cut->one world s':>16s} {'heal->one world s':>17s} {'two worlds':>10s} "
          f"{'same hash':>9s}")
    for row in rows:
        for i, side in enumerate(row["sides"]):
            run = ["", "", "", "", "", "", ""] if i else [
                row["shape"], row["settings"], _s(row["round_s"]), _s(row["one_world_after_cut_s"]),
                _s(row["one_world_s"]), "YES" if row["two_worlds"] else "never", "yes" if row["same_hash"] else "NO"]
            print(f"{run[0]:9s} {run[1]:24s} {side['side']:6s} {','.join(side['nodes']):12s} {run[2]:>7s} "
                  f"{_s(side['next_s']):>7s} {_s(side['gap_s']):>7s} {side['during']:12d} {run[3]:>16s} {run[4]:>17s} "
                  f"{run[5]:>10s} {run[6]:>9s}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="shapes: " + "; ".join(f"{s.name}: {s.words}" for s in SHAPES))
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), metavar="S1,S2",
                   help=f"comma-separated shapes to run, in this order (default: {','.join(DEFAULT_SHAPES)})")
    p.add_argument("--repeats", type=int, default=1, help="runs of each shape (each a fresh run)")
    p.add_argument("--cut-s", type=float, default=20.0,
                   help="seconds the cut is held: past the heartbeat timeout and store_failover_s (default 20)")
    p.add_argument("--failover-s", type=float, default=5.0, help="elastic.store_failover_s of the failover shapes")
    p.add_argument("--before", type=int, default=3, help="outer steps every node logs before the cut")
    p.add_argument("--bound", type=float, default=180.0,
                   help="seconds after the heal (silent-a: the cut) to wait for one world of all 4 (then: a hang)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: the shortest cut past every timeout and 2 outer steps before it")
    p.add_argument("--keep", metavar="DIR", type=Path, help="keep every run's logs and metrics under DIR")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        p.error(f"--shapes: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(BY_NAME)}")
    args.shapes = [BY_NAME[n] for n in names]
    floor = max(HEARTBEAT_TIMEOUT, args.failover_s)
    if args.quick:
        args.cut_s, args.before = floor + 3, 2
    if args.cut_s <= floor:
        p.error(f"--cut-s {args.cut_s:g}: the cut must outlast the heartbeat timeout ({HEARTBEAT_TIMEOUT:g} s) and "
                f"store_failover_s ({args.failover_s:g} s)")
    if args.repeats < 1 or args.before < 2:
        p.error("--repeats must be at least 1 and --before at least 2 (a round time needs two outer steps)")
    return args


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so the cleanup kills the nodes and namespaces
    args = parse_args(argv)
    from _chaos_netns import unavailable

    if reason := unavailable():
        print(f"bench_partition: cannot run here: {reason}", file=sys.stderr)
        return 2
    if args.cut_s >= STORE_TIMEOUT:
        print(f"bench_partition: a cut of {args.cut_s:g} s outlasts elastic.store_timeout ({STORE_TIMEOUT:g} s): cut "
              "nodes may rightly exit 1 instead of rejoining", file=sys.stderr)
    root = args.keep or Path(tempfile.mkdtemp(prefix="zb-partition-"))
    load = os.getloadavg()
    rows = []
    for r in range(args.repeats):
        for shape in args.shapes:
            tmp = root / f"{shape.name}-{r}"
            tmp.mkdir(parents=True, exist_ok=True)
            row = {"repeat": r, **one_shape(shape, tmp, args)}
            row["failures"] = failed(row)
            rows.append(row)
            print(f"[partition] {json.dumps({k: v for k, v in row.items() if k != 'logs'})}", file=sys.stderr, flush=True)
            for uid, tail in row["logs"].items():
                print(f"--- {shape.name} {uid}\n{tail}", file=sys.stderr)
    print(f"cut held {args.cut_s:g} s; profile: heartbeat {PROFILE['ZERO_BAND_EDM_HEARTBEAT_INTERVAL_SECONDS']} s / "
          f"timeout {HEARTBEAT_TIMEOUT:g} s, sync_deadline {PROFILE['ZB_ELASTIC_SYNC_DEADLINE']} s, pg_timeout "
          f"{PROFILE['ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS']} s, store_timeout {STORE_TIMEOUT:g} s; load "
          f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print_table(rows)
    bad = [f"{row['shape']} (repeat {row['repeat']}): {f}" for row in rows for f in row["failures"]]
    for line in bad:
        print(f"FAILED {line}", file=sys.stderr)
    print(json.dumps({"bench": "partition", "cut_s": args.cut_s, "failover_s": args.failover_s, "load": load[0],
                      "rows": [{k: v for k, v in row.items() if k != "logs"} for row in rows], "failures": bad}))
    if args.keep is None and not bad:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
