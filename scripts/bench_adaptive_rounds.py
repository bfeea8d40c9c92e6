"""Speed-adaptive rounds: fixed H against diloco.round_seconds, with one node slowed by the OS.

Three `zb train` nodes on this machine (one thread each, around one `zb store` on loopback); the
third is put in a cgroup v1 CPU quota (a fraction of one core: the kernel throttles it, zb does
nothing different). Three phases, each a real run with the same placement:
  1. solo: each node trains alone, all three at once (no DiLoCo): each node's solo tokens/s;
  2. fixed: DiLoCo with diloco.inner_steps = H, for --steps steps;
  3. adaptive: DiLoCo with diloco.round_seconds = H x the fast nodes' solo step time (their rounds
     keep about H steps; the slow node trains the steps that fit), for the steps the fast nodes
     reach in the fixed run's wall time (steps x fast rate / slow rate), so both runs last about
     as long and each completes its LR schedule.
  4. solo again (other jobs share the machine: the two solo phases bracket the load; their mean is used).
Reported: run tokens/s (every node's tokens over the wall time from the first step to the last
outer step) against the sum of the solo rates, and against the sum of the nodes' own inner-step
rates in the same run (robust to load changes between phases: the share of the nodes' speed the
run turned into tokens); held-out loss (eval right after outer steps) at
the same wall time, interpolated on each run's eval curve, and at each run's end; agreement on
params_hash at every outer step. A table on stderr, one JSON line on stdout.

Run (root, for the cgroup):  sudo PYTHONPATH=$PWD .venv/bin/python scripts/bench_adaptive_rounds.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _cpu_quota import cpu_quota, quota_unavailable

from zb.metrics import read_metrics

NODES = ("fast0", "fast1", "slow")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def common_args(args: argparse.Namespace, log_dir: Path, steps: int) -> list[str]:
    return ["--model.name", args.model, "--data.seq_length", str(args.seq), "--optim.batch_size", str(args.batch),
            "--train.micro_bs", str(args.batch), "--optim.total_steps", str(steps), "--optim.lr", "3e-3",
            "--optim.warmup_steps", "10", "--eval.batches", "8", "--train.seed", str(args.seed),
            "--train.log_interval", "1", "--log.progress", "plain", "--train.device", "cpu", "--log.dir", str(log_dir)]


def diloco_args(eval_interval: int) -> list[str]:
    return ["--diloco.compression", "int8", "--diloco.outer_lr", "1.0", "--diloco.outer_momentum", "0.0",
            "--train.log_model_hash", "--eval.interval", str(eval_interval)]


def run_phase(name: str, args: argparse.Namespace, work: Path, into_quota, extra: dict[str, list[str]],
              steps: dict[str, int], diloco: bool) -> dict[str, Path]:
    """Start the nodes (and a store for DiLoCo), wait for all; returns each node's metrics path."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(port),
               GLOBAL_WORLD_SIZE=str(len(NODES)))
    py, procs = sys.executable, {}
    store = None
    if diloco:
        store = subprocess.Popen([py, "-m", "zb", "store", "--port", str(port)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=open(work / f"{name}-store.log", "w"))
        time.sleep(1.5)
    try:
        for i, uid in enumerate(NODES):
            node_env = dict(env, GLOBAL_UNIQUE_ID=uid, GLOBAL_RANK=str(i))
            procs[uid] = subprocess.Popen([py, "-m", "zb", "train", *common_args(args, work / name / uid, steps[uid]),
                                           *extra[uid]], env=node_env, stdout=subprocess.DEVNULL,
                                          stderr=open(work / f"{name}-{uid}.log", "w"))
            if uid == "slow":
                into_quota(procs[uid].pid)
        for uid, p in procs.items():
            if p.wait(args.timeout) != 0:
                raise SystemExit(f"{name} {uid} failed:\n" + (work / f"{name}-{uid}.log").read_text()[-3000:])
    finally:
        for p in [*procs.values(), *([store] if store else [])]:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {uid: work / name / uid / "metrics.jsonl" for uid in NODES}


def solo_rate(path: Path, args: argparse.Namespace) -> tuple[float, float]:
    """(tokens/s, seconds per step) of a node alone, past its first steps (warm-up, kernel loads)."""
    steps = read_metrics(path, "step")[5:]
    tokens = args.batch * args.seq
    seconds = sum(tokens / e["tokens_per_s"] for e in steps)
    return tokens * len(steps) / seconds, seconds / len(steps)


def run_summary(paths: dict[str, Path], args: argparse.Namespace) -> dict:
    tokens_per_step = args.batch * args.seq
    starts, ends, tokens, hashes, inner_rates = [], [], 0, [], 0.0
    for path in paths.values():
        steps, outer = read_metrics(path, "step"), read_metrics(path, "outer_step")
        # The node's own speed in this run: tokens over the time in its inner steps (past the first 5).
        inner_rates += tokens_per_step * len(steps[5:]) / sum(tokens_per_step / e["tokens_per_s"] for e in steps[5:])
        starts.append(steps[0]["time"] - tokens_per_step / steps[0]["tokens_per_s"])
        ends.append(outer[-1]["time"])
        tokens += steps[-1]["tokens"]
        hashes.append([e.get("params_hash") for e in outer])
    start = min(starts)
    wall = max(ends) - start
    evals = [(e["time"] - start, e["loss"]) for e in read_metrics(paths[NODES[0]], "eval")]
    outer0 = read_metrics(paths[NODES[0]], "outer_step")
    agree = all(h == hashes[0] for h in hashes) and len(hashes[0]) > 0
    per_node_steps = {uid: read_metrics(p, "step")[-1]["tokens"] // tokens_per_step for uid, p in paths.items()}
    return dict(wall_s=round(wall, 2), tokens=tokens, run_tokens_per_s=round(tokens / wall, 1), evals=evals,
                vs_own_inner_rates=round(tokens / wall / inner_rates, 3),
                final_loss=evals[-1][1], outer_steps=len(outer0), agree_every_outer_step=agree,
                node_steps=per_node_steps)


def loss_at(evals: list[tuple[float, float]], t: float) -> float:
    """The eval curve interpolated linearly in wall time (held at its ends)."""
    if t <= evals[0][0]:
        return evals[0][1]
    for (t0, l0), (t1, l1) in zip(evals, evals[1:]):
        if t0 <= t <= t1:
            return l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return evals[-1][1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="debug")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200, help="Steps of the fixed-H run.")
    p.add_argument("--solo-steps", type=int, default=40)
    p.add_argument("--inner-steps", type=int, default=10, help="H of the fixed run (and the fast nodes' rounds).")
    p.add_argument("--eval-rounds", type=int, default=2, help="Evaluate every this many fixed rounds' steps (the "
                   "adaptive run as often in wall time).")
    p.add_argument("--quota", type=float, default=0.25, help="CPU share of the slow node (fraction of one core).")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--keep", metavar="DIR", help="Keep logs and metrics under DIR.")
    args = p.parse_args(argv)
    if quota_unavailable():
        raise SystemExit(f"cannot run: {quota_unavailable()}")
    work = Path(args.keep or tempfile.mkdtemp(prefix="zb-adaptive-"))
    work.mkdir(parents=True, exist_ok=True)
    with cpu_quota(args.quota) as into_quota:
        solo_args = ({u: ["--eval.interval", "-1"] for u in NODES}, {u: args.solo_steps for u in NODES})
        before = run_phase("solo", args, work, into_quota, *solo_args, diloco=False)
        solo = {uid: solo_rate(path, args) for uid, path in before.items()}
        fast_step_s = (solo["fast0"][1] + solo["fast1"][1]) / 2
        budget = round(args.inner_steps * fast_step_s, 3)
        ratio = solo["slow"][1] / fast_step_s
        adaptive_steps = int(args.steps * ratio) // args.inner_steps * args.inner_steps
        # Evaluations cost wall time: both runs evaluate about as often in wall time (the adaptive run's
        # steps come ratio times faster).
        eval_every = args.inner_steps * args.eval_rounds
        fixed = run_phase("fixed", args, work, into_quota,
                          {u: [*diloco_args(eval_every), "--diloco.inner_steps", str(args.inner_steps)] for u in NODES},
                          {u: args.steps for u in NODES}, diloco=True)
        adaptive = run_phase("adaptive", args, work, into_quota,
                             {u: [*diloco_args(int(eval_every * ratio)), "--diloco.round_seconds", str(budget)]
                              for u in NODES},
                             {u: adaptive_steps for u in NODES}, diloco=True)
        # Other jobs share this machine: solo rates measured before and after the runs bracket the load.
        after = run_phase("solo-after", args, work, into_quota, *solo_args, diloco=False)
        solo_after = {uid: solo_rate(path, args) for uid, path in after.items()}
    solo_sum_before = sum(r for r, _ in solo.values())
    solo_sum_after = sum(r for r, _ in solo_after.values())
    solo_sum = (solo_sum_before + solo_sum_after) / 2
    rows = {"fixed": run_summary(fixed, args), "adaptive": run_summary(adaptive, args)}
    t_equal = min(r["wall_s"] for r in rows.values())
    for r in rows.values():
        r["loss_at_equal_wall"] = round(loss_at(r["evals"], t_equal), 4)
        r["vs_solo_sum"] = round(r["run_tokens_per_s"] / solo_sum, 3)
    doc = dict(bench="adaptive_rounds", model=args.model, seq=args.seq, batch=args.batch, quota=args.quota,
               inner_steps=args.inner_steps, round_seconds=budget, slow_over_fast=round(ratio, 2),
               fixed_steps=args.steps, adaptive_steps=adaptive_steps,
               solo_tokens_per_s={u: round(r, 1) for u, (r, _) in solo.items()}, solo_sum=round(solo_sum, 1),
               solo_sum_before=round(solo_sum_before, 1), solo_sum_after=round(solo_sum_after, 1),
               equal_wall_s=t_equal, runs={m: {k: v for k, v in r.items() if k != "evals"} for m, r in rows.items()},
               adaptive_vs_fixed=dict(
                   run_tokens_per_s=round(rows["adaptive"]["run_tokens_per_s"] / rows["fixed"]["run_tokens_per_s"], 3),
                   loss_at_equal_wall=round(rows["adaptive"]["loss_at_equal_wall"]
                                            / rows["fixed"]["loss_at_equal_wall"], 4)),
               targets=dict(run_tokens_at_least_95pct_of_solo_sum=rows["adaptive"]["vs_solo_sum"] >= 0.95,
                            loss_no_worse_than_fixed=rows["adaptive"]["loss_at_equal_wall"]
                            <= rows["fixed"]["loss_at_equal_wall"],
                            agree=all(r["agree_every_outer_step"] for r in rows.values())))
    print_table(doc)
    print(json.dumps(doc))
    return doc


def print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"3 nodes ({doc['model']}, seq {doc['seq']}, batch {doc['batch']}), one at {doc['quota']:g} "
                    f"core: solo sum {doc['solo_sum']:,.0f} tok/s (before {doc['solo_sum_before']:,.0f}, after "
                    f"{doc['solo_sum_after']:,.0f}), slow/fast step time {doc['slow_over_fast']}")
    for col in ("run", "rounds", "steps (fast0, fast1, slow)", "wall s", "run tok/s", "vs solo sum", "vs own rates",
                f"loss at {doc['equal_wall_s']:.0f} s", "final loss", "outer steps", "params agree"):
        t.add_column(col, justify="right")
    for name, r in doc["runs"].items():
        rounds = f"H={doc['inner_steps']}" if name == "fixed" else f"{doc['round_seconds']:g} s"
        t.add_row(name, rounds, ", ".join(str(v) for v in r["node_steps"].values()), f"{r['wall_s']:.1f}",
                  f"{r['run_tokens_per_s']:,.0f}", f"{r['vs_solo_sum']:.1%}", f"{r['vs_own_inner_rates']:.1%}",
                  f"{r['loss_at_equal_wall']:.4f}",
                  f"{r['final_loss']:.4f}", str(r["outer_steps"]), "yes" if r["agree_every_outer_step"] else "NO")
    Console(stderr=True, width=170).print(t)


if __name__ == "__main__":
    main()
