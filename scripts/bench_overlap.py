"""Overlapped outer steps: compute utilization of blocking DiLoCo against diloco.overlap = eager,
on emulated hosts with shaped links (network namespaces, tbf; needs root).

Each mode is a real run: `zb store` and one `zb train` node per host (one thread each), the same
model, data, seed and H. Per node, from its metrics:
  utilization = time in inner steps / wall time (first step's start to the last outer step's end),
where a step's time is batch tokens / its tokens_per_s (data + compute). Blocking's share of wall
time in the all-reduce is printed beside it; eager's `stall_s` and `hidden_s` say how much of the
transfer it waited for and how much ran behind compute. Bytes on the wire and the nodes' agreement
on params_hash are reported for both. Prints a table on stderr and one JSON line on stdout.

Run:  sudo PYTHONPATH=$PWD .venv/bin/python scripts/bench_overlap.py --rate-mbit 5 --inner-steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from zb.metrics import read_metrics
from zb.net.netns import emulated_hosts, netns_unavailable

PORT = 29611


def node_args(args: argparse.Namespace, mode: str, log_dir: Path) -> list[str]:
    return ["--model.name", args.model, "--data.seq_length", str(args.seq), "--optim.batch_size", str(args.batch),
            "--train.micro_bs", str(args.batch), "--optim.total_steps", str(args.steps), "--optim.lr", "3e-3",
            "--optim.warmup_steps", "20", "--eval.interval", "0", "--eval.batches", "8", "--train.seed", str(args.seed),
            "--train.log_interval", "1", "--log.progress", "plain", "--train.device", "cpu", "--log.dir", str(log_dir),
            "--diloco.inner_steps", str(args.inner_steps), "--diloco.compression", args.compression,
            "--diloco.outer_lr", str(args.outer_lr), "--diloco.outer_momentum", str(args.outer_momentum),
            "--diloco.overlap", mode, "--train.log_model_hash", "--diloco.min_bandwidth_mbps", "1",
            *(["--diloco.fragments", str(args.fragments), "--diloco.fragment_delay", str(args.fragment_delay)]
              if mode == "streaming" else [])]


def run_mode(net, mode: str, args: argparse.Namespace, work: Path) -> list[dict]:
    """One run of `mode` on every host; returns per-node summaries."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOBAL_ADDR=net.hosts[0].addr, GLOBAL_PORT=str(PORT),
               GLOBAL_WORLD_SIZE=str(len(net.hosts)))
    py = sys.executable
    store = net.hosts[0].popen([py, "-m", "zb", "store", "--host", "0.0.0.0", "--port", str(PORT)], env=env,
                               stdout=open(os.devnull, "w"), stderr=open(work / f"{mode}-store.log", "w"))
    time.sleep(2)  # the store binds before any node dials (nodes retry anyway, up to elastic.connect_timeout)
    procs = []
    try:
        for i, host in enumerate(net.hosts):
            node_env = dict(env, GLOBAL_UNIQUE_ID=f"node{i}", GLOBAL_RANK=str(i))
            procs.append(host.popen([py, "-m", "zb", "train", *node_args(args, mode, work / mode / f"node{i}")],
                                    env=node_env, stdout=open(os.devnull, "w"),
                                    stderr=open(work / f"{mode}-node{i}.log", "w")))
        for i, p in enumerate(procs):
            if p.wait(args.timeout) != 0:
                raise SystemExit(f"{mode} node{i} failed:\n" + (work / f"{mode}-node{i}.log").read_text()[-3000:])
    finally:
        for p in [*procs, store]:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [summarize(work / mode / f"node{i}" / "metrics.jsonl", args) for i in range(len(net.hosts))]


def summarize(path: Path, args: argparse.Namespace) -> dict:
    steps = read_metrics(path, "step")
    outer = read_metrics(path, "outer_step")
    evals = read_metrics(path, "eval")
    tokens = args.batch * args.seq
    dts = [tokens / e["tokens_per_s"] for e in steps]
    start = steps[0]["time"] - dts[0]
    wall = outer[-1]["time"] - start
    inner = sum(dts)
    return dict(wall_s=round(wall, 2), inner_s=round(inner, 2), utilization=inner / wall,
                allreduce_s=round(sum(e["allreduce_s"] for e in outer), 2),
                stall_s=round(sum(e["stall_s"] for e in outer), 2), hidden_s=round(sum(e["hidden_s"] for e in outer), 2),
                wire_bytes=sum(e["wire_bytes"] for e in outer), transfers=sum(e["wire_bytes"] > 0 for e in outer),
                peak_sync_bytes=max(e["wire_bytes"] for e in outer),
                final_hash=outer[-1].get("params_hash"), loss=evals[-1]["loss"] if evals else None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=5.0, help="tbf rate of every host's link, both directions.")
    p.add_argument("--model", default="debug")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--inner-steps", type=int, default=10, help="H.")
    p.add_argument("--compression", default="int8", choices=("none", "int8"))
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", default="none,eager,streaming")
    p.add_argument("--fragments", type=int, default=2, help="diloco.fragments of the streaming row.")
    p.add_argument("--fragment-delay", type=int, default=1, help="diloco.fragment_delay of the streaming row.")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--keep", metavar="DIR", help="Keep logs and metrics under DIR.")
    args = p.parse_args(argv)
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    work = Path(args.keep or tempfile.mkdtemp(prefix="zb-overlap-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    with emulated_hosts(args.hosts, rate_mbit=args.rate_mbit) as net:
        for mode in args.modes.split(","):
            results[mode] = run_mode(net, mode, args, work)
    doc = dict(bench="overlap_utilization", hosts=args.hosts, rate_mbit=args.rate_mbit, model=args.model,
               steps=args.steps, inner_steps=args.inner_steps, compression=args.compression, seed=args.seed,
               modes={m: dict(nodes=r, utilization=sum(n["utilization"] for n in r) / len(r),
                              agree=len({n["final_hash"] for n in r}) == 1) for m, r in results.items()})
    for mode in [m for m in results if m != "none" and "none" in results]:
        base = doc["modes"]["none"]
        doc[f"{mode}_vs_none"] = dict(
            utilization=round(doc["modes"][mode]["utilization"] / base["utilization"], 3),
            wall=round(sum(n["wall_s"] for n in results[mode]) / sum(n["wall_s"] for n in results["none"]), 3),
            bytes=round(sum(n["wire_bytes"] for n in results[mode]) / sum(n["wire_bytes"] for n in results["none"]), 4),
            loss=round(sum(n["loss"] for n in results[mode]) / sum(n["loss"] for n in results["none"]), 4))
    print_table(doc)
    print(json.dumps(doc))
    return doc


def print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{doc['hosts']} hosts, tbf {doc['rate_mbit']:g} Mbit/s, {doc['model']}, H={doc['inner_steps']}, "
                    f"{doc['compression']}, {doc['steps']} steps")
    for col in ("mode", "node", "utilization", "wall s", "inner s", "all-reduce s", "stall s", "hidden s",
                "wire MB", "peak sync MB", "transfers", "held-out loss", "agree"):
        t.add_column(col, justify="right")
    for mode, m in doc["modes"].items():
        for i, n in enumerate(m["nodes"]):
            t.add_row(mode, str(i), f"{n['utilization']:.1%}", f"{n['wall_s']:.1f}", f"{n['inner_s']:.1f}",
                      f"{n['allreduce_s']:.1f}", f"{n['stall_s']:.1f}", f"{n['hidden_s']:.1f}",
                      f"{n['wire_bytes'] / 1e6:.2f}", f"{n['peak_sync_bytes'] / 1e6:.3f}", str(n["transfers"]),
                      f"{n['loss']:.4f}" if n["loss"] is not None else "-", "yes" if m["agree"] else "NO")
    Console(stderr=True, width=170).print(t)


if __name__ == "__main__":
    main()
