"""Overlapped outer steps on shaped links: utilization measured from outside zb, and what a boundary
costs besides the transfer (network namespaces, tbf; needs root).

Every row is a real run: `zb store` and one `zb train` node per host (one thread each, held to
--node-cpu of a core by a cgroup quota, so that a node computes at one speed whatever the others do:
nodes sharing cores would speed up while another waits), the same model, data, seed and H, for each
mode one after the other on the same topology. Two figures:

- Utilization, from outside zb's own accounting: the same run with no sync inside it (`nosync`:
  blocking DiLoCo with H = the run's steps, so its only outer step comes after the last step event)
  against each mode: utilization = wall(nosync) / wall(mode), wall = first to last step event of a
  node, averaged over the nodes. Every mode runs between two nosync runs, against their mean (the
  machine's load drifts); both and their spread are printed. `none` (blocking) shows how much of its
  wall time the sync takes.
- Control overhead per sync: what an outer step cost on a node besides waiting for the transfer
  (`boundary_s - stall_s` of its outer_step event: the roll call, the check-in, applying, hand-overs,
  store writes). The minimum over the nodes of one sync is its cost without waiting for a slower
  node (the last to arrive waits for nobody); the mean over the nodes includes that wait.

Run:  PYTHONPATH=$PWD .venv/bin/python scripts/bench_overlap.py --rates 10,1 --inner-steps 20,60 --steps 240
Prints a table on stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from _cpu_quota import cpu_quota, quota_unavailable

from zb.collectives import COMPRESSIONS
from zb.metrics import read_metrics
from zb.net.netns import emulated_hosts, netns_unavailable

PORT = 29611
NOSYNC = "nosync"


def node_args(args: argparse.Namespace, mode: str, h: int, log_dir: Path) -> list[str]:
    overlap = "none" if mode == NOSYNC else mode
    return ["--model.name", args.model, "--data.seq_length", str(args.seq), "--optim.batch_size", str(args.batch),
            "--train.micro_bs", str(args.batch), "--optim.total_steps", str(args.steps), "--optim.lr", "3e-3",
            "--optim.warmup_steps", "20", "--eval.interval", "0", "--train.seed", str(args.seed),
            "--train.log_interval", "1", "--log.progress", "plain", "--train.device", "cpu", "--log.dir", str(log_dir),
            "--diloco.inner_steps", str(args.steps if mode == NOSYNC else h), "--diloco.compression", args.compression,
            "--diloco.outer_lr", str(args.outer_lr), "--diloco.outer_momentum", str(args.outer_momentum),
            "--diloco.overlap", overlap, "--train.log_model_hash", "--diloco.min_bandwidth_mbps", "0.5",
            *(["--diloco.fragments", str(args.fragments), "--diloco.fragment_delay", str(tau(args, h))]
              if mode == "streaming" else [])]


def tau(args: argparse.Namespace, h: int) -> int:
    """Streaming's fragment delay: --fragment-delay, or by default the most a fragment allows (H/P - 1)."""
    return args.fragment_delay if args.fragment_delay is not None else h // args.fragments - 1


def run_mode(net, mode: str, h: int, args: argparse.Namespace, work: Path) -> list[dict]:
    """One run of `mode` on every host; returns per-node summaries."""
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOBAL_ADDR=net.hosts[0].addr, GLOBAL_PORT=str(PORT),
               GLOBAL_WORLD_SIZE=str(len(net.hosts)))
    py = sys.executable
    store = net.hosts[0].popen([py, "-m", "zb", "store", "--host", "0.0.0.0", "--port", str(PORT)], env=env,
                               stdout=open(os.devnull, "w"), stderr=open(work / f"{mode}-store.log", "w"))
    time.sleep(2)  # the store binds before any node dials (nodes retry anyway, up to elastic.connect_timeout)
    procs = []
    with ExitStack() as quotas:
        try:
            for i, host in enumerate(net.hosts):
                node_env = dict(env, GLOBAL_UNIQUE_ID=f"node{i}", GLOBAL_RANK=str(i))
                procs.append(host.popen([py, "-m", "zb", "train", *node_args(args, mode, h, work / mode / f"node{i}")],
                                        env=node_env, stdout=open(os.devnull, "w"),
                                        stderr=open(work / f"{mode}-node{i}.log", "w")))
                if args.node_cpu:
                    # 10 ms periods: with the default 100 ms a node stops for up to 50 ms at a time, and every
                    # check-in waits for whichever node is stopped.
                    quotas.enter_context(cpu_quota(args.node_cpu, f"node{i}", period_us=10_000))(procs[-1].pid)
            for i, p in enumerate(procs):
                if p.wait(args.timeout) != 0:
                    raise SystemExit(f"{mode} node{i} failed:\n" + (work / f"{mode}-node{i}.log").read_text()[-3000:])
        finally:
            for p in [*procs, store]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return [summarize(work / mode / f"node{i}" / "metrics.jsonl") for i in range(len(net.hosts))]


def summarize(path: Path) -> dict:
    steps = read_metrics(path, "step")
    outer = read_metrics(path, "outer_step")
    syncs = [e for e in outer if not e.get("closing")]   # the run's end (overlap) comes after the last step
    return dict(wall_s=steps[-1]["time"] - steps[0]["time"],
                allreduce_s=round(sum(e["allreduce_s"] for e in syncs), 2),
                stall_s=round(sum(e["stall_s"] for e in syncs), 2), hidden_s=round(sum(e["hidden_s"] for e in syncs), 2),
                control=[max(0.0, e["boundary_s"] - e["stall_s"]) for e in syncs],
                resolve=[e["resolve_s"] for e in syncs], checkin=[e["checkin_s"] for e in syncs],
                wire_bytes=sum(e["wire_bytes"] for e in outer), final_hash=outer[-1].get("params_hash"))


def control_per_sync(nodes: list[dict]) -> dict:
    """Per sync: the cheapest node's control seconds (no wait for a slower node) and the nodes' mean."""
    n = min(len(x["control"]) for x in nodes)
    if n == 0:
        return dict(syncs=0)
    cheapest = [min(x["control"][k] for x in nodes) for k in range(n)]
    mean = [statistics.mean(x["control"][k] for x in nodes) for k in range(n)]
    resolve = [min(x["resolve"][k] for x in nodes) for k in range(n)]
    checkin = [min(x["checkin"][k] for x in nodes) for k in range(n)]
    q = statistics.quantiles(cheapest, n=10)[-1] if n >= 2 else cheapest[0]
    return dict(syncs=n, cheapest_median_ms=round(1e3 * statistics.median(cheapest), 1), cheapest_p90_ms=round(1e3 * q, 1),
                mean_median_ms=round(1e3 * statistics.median(mean), 1),
                roll_call_median_ms=round(1e3 * statistics.median(resolve), 1),
                checkin_median_ms=round(1e3 * statistics.median(checkin), 1))


def one_rate(rate: float, h: int, args: argparse.Namespace, work: Path) -> dict:
    """Every mode between two nosync runs (nosync, a, nosync, b, nosync, ...): each mode's utilization is
    against the mean of the two baselines beside it, so a load that drifts over the benchmark (the
    machine is shared) moves both sides of a ratio alike; their spread is reported with it."""
    modes = [m for m in args.modes.split(",") if m]
    rows: dict[str, dict] = {}
    with emulated_hosts(args.hosts, rate_mbit=rate) as net:
        def wall_of(mode: str, i: int) -> tuple[float, list[dict]]:
            nodes = run_mode(net, mode, h, args, work / f"{rate:g}mbit" / f"{i}-{mode}")
            return statistics.mean(x["wall_s"] for x in nodes), nodes

        baselines = [wall_of(NOSYNC, 0)[0]]
        for i, mode in enumerate(modes):
            wall, nodes = wall_of(mode, 2 * i + 1)
            baselines.append(wall_of(NOSYNC, 2 * i + 2)[0])
            base = statistics.mean(baselines[-2:])
            rows[mode] = dict(wall_s=round(wall, 2), utilization=round(base / wall, 4),
                              nosync_wall_s=[round(w, 2) for w in baselines[-2:]],
                              nosync_spread=round(abs(baselines[-1] - baselines[-2]) / base, 4),
                              control=control_per_sync(nodes),
                              allreduce_s=round(statistics.mean(x["allreduce_s"] for x in nodes), 2),
                              stall_s=round(statistics.mean(x["stall_s"] for x in nodes), 2),
                              hidden_s=round(statistics.mean(x["hidden_s"] for x in nodes), 2),
                              wire_bytes=sum(x["wire_bytes"] for x in nodes),
                              agree=len({x["final_hash"] for x in nodes}) == 1)
    return dict(rate_mbit=rate, inner_steps=h, modes=rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rates", default="10,1", help="tbf rate of every host's link, both directions (Mbit/s), per run.")
    p.add_argument("--inner-steps", default="20,60", help="H per rate (one value: the same for every rate).")
    p.add_argument("--model", default="debug")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--compression", default="int8", choices=COMPRESSIONS)
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", default="none,eager,streaming", help="Modes besides the nosync baseline.")
    p.add_argument("--fragments", type=int, default=2, help="diloco.fragments of the streaming row.")
    p.add_argument("--fragment-delay", type=int, default=None, help="tau of the streaming row (default: H/P - 1).")
    p.add_argument("--node-cpu", type=float, default=0.5,
                   help="Each node held to this fraction of one core by a cgroup CPU quota (0: no quota). Nodes that "
                        "share cores speed up while another waits, which flatters any mode with waits in it.")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--keep", metavar="DIR", help="Keep logs and metrics under DIR.")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    hs = [int(h) for h in args.inner_steps.split(",")]
    hs = hs * len(rates) if len(hs) == 1 else hs
    if len(hs) != len(rates):
        p.error(f"--inner-steps gives {len(hs)} values for {len(rates)} rates: give one, or one per rate")
    for h in hs:
        if args.steps % h or h % args.fragments or not 0 <= tau(args, h) < h // args.fragments:
            p.error(f"H = {h} must divide --steps {args.steps} and be a multiple of --fragments {args.fragments} "
                    f"with the fragment delay below H / fragments")
    reason = netns_unavailable() or (quota_unavailable() if args.node_cpu else None)
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    work = Path(args.keep or tempfile.mkdtemp(prefix="zb-overlap-"))
    doc = dict(bench="overlap_utilization", hosts=args.hosts, model=args.model, steps=args.steps,
               compression=args.compression, seed=args.seed, fragments=args.fragments,
               rates=[one_rate(rate, h, args, work) for rate, h in zip(rates, hs)])
    print_table(doc)
    print(json.dumps(doc))
    return doc


def print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{doc['hosts']} hosts, {doc['model']}, {doc['compression']}, {doc['steps']} steps: utilization "
                    "= wall(no sync) / wall(mode)")
    for col in ("Mbit/s", "H", "mode", "utilization", "wall s", "nosync wall s (spread)", "all-reduce s", "stall s",
                "hidden s", "control/sync ms (cheapest: median, p90)", "roll call ms", "check-in ms", "mean node ms",
                "agree"):
        t.add_column(col, justify="right")
    for r in doc["rates"]:
        for mode, m in r["modes"].items():
            c = m["control"]
            t.add_row(f"{r['rate_mbit']:g}", str(r["inner_steps"]), mode, f"{m['utilization']:.1%}", f"{m['wall_s']:.1f}",
                      " / ".join(f"{w:.1f}" for w in m["nosync_wall_s"]) + f" ({m['nosync_spread']:.1%})",
                      f"{m['allreduce_s']:.1f}", f"{m['stall_s']:.1f}", f"{m['hidden_s']:.1f}",
                      f"{c.get('cheapest_median_ms', 0):.0f}, {c.get('cheapest_p90_ms', 0):.0f}",
                      f"{c.get('roll_call_median_ms', 0):.0f}", f"{c.get('checkin_median_ms', 0):.0f}",
                      f"{c.get('mean_median_ms', 0):.0f}", "yes" if m["agree"] else "NO")
    Console(stderr=True, width=200).print(t)


if __name__ == "__main__":
    main()
