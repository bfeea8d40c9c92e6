"""DiLoCo-SWARM benchmark: does syncing a stage every H steps learn as well as syncing every step, and does
throughput-aware routing send less work to a slowed worker?

Run:  PYTHONPATH=$PWD python scripts/bench_swarm.py                     (the full table)
      PYTHONPATH=$PWD python scripts/bench_swarm.py --quick --seeds 1    (a smoke run)

Rows (real `zb train` processes on the built-in offline data of the convergence benchmark, equal tokens):
  single     one process, batch M*B, S steps (the same tokens as the grid's M first-stage workers x B)
  swarm      the 2-stage x M-worker grid, each stage's workers averaging params after every step
             (diloco.inner_steps 1, outer_optimizer avg: SWARM's sync every step)
  dswarm-hH  the same grid, DiLoCo within each stage every H steps (outer Nesterov, --outer-lr/--outer-momentum)
  slowed     dswarm-h10 with one stage-1 worker held to --slow-quota of a core by a cgroup CPU quota (root,
             cgroup v1 cpu controller; the OS slows it, nothing in zb), next to `even`: the same run unslowed
  restart    dswarm-h10 with stage checkpoints every 10 steps, every worker SIGKILLed halfway and all restarted
             against the same store (ckpt.resume latest): compared with dswarm-h10 of the same seed; reports
             the step every stage resumed, the steps done twice and the seconds from relaunch to the first step
Loss: first-stage worker 0's held-out eval after the final outer step (all replicas agree then), on held-out
shard 0 of M as single's. Bytes: within-stage all-reduce bytes (all workers' outer steps) and pipeline bytes
(what the first-stage workers sent and received). Prints a table on stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _convergence_procs import Procs, base_env, run_single, start_store  # noqa: E402

from zb.metrics import read_metrics  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="single,swarm,dswarm-h10,dswarm-h50,slowed,restart", help="Comma-separated rows.")
    p.add_argument("--seeds", default="1,2", help="train.seed values; the convergence rows run once per seed.")
    p.add_argument("--steps", type=int, default=300, help="Steps S (a multiple of every H).")
    p.add_argument("--batch", type=int, default=8, help="B: batch of each first-stage worker, in sequences.")
    p.add_argument("--workers", type=int, default=2, help="M: workers per stage.")
    p.add_argument("--seq", type=int, default=128, help="data.seq_length.")
    p.add_argument("--model", default="debug", help="model.name (2 stages need at least 2 blocks).")
    p.add_argument("--lr", type=float, default=3e-3, help="Inner peak learning rate.")
    p.add_argument("--warmup", type=int, default=20, help="optim.warmup_steps.")
    p.add_argument("--outer-lr", type=float, default=1.0, help="diloco.outer_lr of the dswarm rows (1.0 with momentum 0 "
                   "is plain averaging, the setting that learns best at this scale: BENCHMARKS.md, DiLoCo convergence).")
    p.add_argument("--outer-momentum", type=float, default=0.0, help="diloco.outer_momentum of the dswarm rows.")
    p.add_argument("--eval-batches", type=int, default=32, help="eval.batches of the final held-out eval.")
    p.add_argument("--slow-quota", type=float, default=0.1, help="Share of one core the slowed worker gets (on 2 cores "
                   "shared by 4 workers and other load, a quarter of a core barely binds).")
    p.add_argument("--timeout", type=float, default=1200, help="Seconds one run may take.")
    p.add_argument("--quick", action="store_true", help="Smoke size: 20 steps, batch 4, seq 64.")
    p.add_argument("--keep", metavar="DIR", help="Keep every run's logs and metrics under DIR.")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq, args.warmup, args.eval_batches = 20, 4, 64, 2, 4
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    for row in args.rows:
        h = _h(row)
        if row not in ("single", "swarm", "slowed", "restart") and (h is None or not row.startswith("dswarm-h")):
            p.error(f"unknown row {row!r}: single, swarm, dswarm-h<H>, slowed or restart")
        if h and args.steps % h:
            p.error(f"--steps {args.steps} is not a multiple of H in {row}")
    return args


def _h(row: str) -> int | None:
    return int(row[len("dswarm-h"):]) if row.startswith("dswarm-h") and row[len("dswarm-h"):].isdigit() else None


def train_args(args, seed: int, batch: int) -> list[str]:
    return ["--model.name", args.model, "--data.seq_length", str(args.seq), "--optim.batch_size", str(batch),
            "--train.micro_bs", str(min(batch, 4)), "--optim.total_steps", str(args.steps), "--optim.lr",
            str(args.lr), "--optim.warmup_steps", str(args.warmup), "--eval.interval", "0", "--eval.batches",
            str(args.eval_batches), "--train.seed", str(seed), "--data.data_world_size", str(args.workers),
            "--log.progress", "plain", "--train.log_interval", "10", "--train.device", "cpu"]


def sync_args(row: str, args) -> list[str]:
    if row == "swarm":
        return ["--diloco.inner_steps", "1", "--diloco.outer_optimizer", "avg"]
    h = 10 if row in ("slowed", "even", "restart") else _h(row)
    return ["--diloco.inner_steps", str(h), "--diloco.outer_lr", str(args.outer_lr), "--diloco.outer_momentum",
            str(args.outer_momentum)]


def run_grid(workdir: Path, args, seed: int, row: str, slow: bool = False) -> dict:
    procs = Procs(workdir, base_env(), args.timeout)
    group = None
    try:
        port = start_store(procs)
        env = dict(GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(port), GLOBAL_WORLD_SIZE=str(args.workers))
        common = [*train_args(args, seed, args.batch), *sync_args(row, args), "--swarm.stages", "2",
                  "--train.log_model_hash", "--diloco.compression", "none"]
        names = [f"s{j}w{m}" for j in range(2) for m in range(args.workers)]

        def start_all() -> None:
            for name in names:
                ckpt = ["--ckpt.path", str(workdir / "ckpt" / name), "--ckpt.interval", "10", "--ckpt.resume",
                        "latest"] if row == "restart" else []
                procs.train(name, [*common, "--swarm.stage", name[1], *ckpt], GLOBAL_RANK=name[3],
                            GLOBAL_UNIQUE_ID=name, **env)

        start_all()
        if slow:
            group = slow_down(procs.procs[f"s1w{args.workers - 1}"].pid, args.slow_quota)
        started = time.monotonic()
        restart = kill_halfway_and_restart(procs, names, args, start_all) if row == "restart" else {}
        procs.wait(names)
        wall = time.monotonic() - started
        return dict(**summarize({n: read_metrics(workdir / n / "metrics.jsonl") for n in names}, args, wall), **restart)
    finally:
        procs.close()
        if group is not None:
            group.rmdir()


def kill_halfway_and_restart(procs: Procs, names: list[str], args, start_all) -> dict:
    """SIGKILL every worker once first-stage worker 0 passed half the steps, relaunch them all against the same
    store, and report where they resumed and how long the relaunch took to its first step."""
    half = args.steps // 2
    while not any(e["step"] >= half for e in procs.metrics("s0w0", "step")):
        for name in names:
            procs.check_alive(name)
        procs.remaining()
        time.sleep(0.1)
    if any(procs.procs[name].poll() is not None for name in names):
        raise RuntimeError("a worker ended before the kill at half the steps: give the restart row more --steps")
    for name in names:
        procs.kill(name)
    killed_at = procs.metrics("s0w0", "step")[-1]["step"]
    before = len(procs.metrics("s0w0", "step"))
    relaunched = time.monotonic()
    start_all()
    while len(procs.metrics("s0w0", "step")) == before:
        for name in names:
            procs.check_alive(name)
        procs.remaining()
        time.sleep(0.05)
    restart_s = time.monotonic() - relaunched
    resumed = set()
    for name in names:
        found = re.findall(r"resumed from \S+ at step (\d+)", (procs.workdir / f"{name}.log").read_text())
        resumed.add(int(found[-1]) if found else None)
    if len(resumed) != 1 or None in resumed:
        raise RuntimeError(f"the workers did not all resume one step: {sorted(resumed, key=str)}")
    step = resumed.pop()
    return dict(killed_at=killed_at, resumed_step=step, redone_steps=killed_at - step, restart_s=round(restart_s, 1))


def slow_down(pid: int, quota: float) -> Path:
    """Hold `pid` to `quota` of one core with a cgroup v1 CPU quota (the OS throttles it)."""
    if os.geteuid() != 0 or not (CGROUP / "cpu.cfs_quota_us").exists():
        raise RuntimeError("the slowed row needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    group = CGROUP / f"zb-bench-swarm-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text(str(int(100000 * quota)))
    (group / "cgroup.procs").write_text(str(pid))
    return group


def summarize(records: dict[str, list[dict]], args, wall: float) -> dict:
    owners = sorted(n for n in records if n.startswith("s0"))
    evals = [r for r in records[owners[0]] if r["event"] == "eval"]
    outer = {n: [r for r in records[n] if r["event"] == "outer_step"] for n in records}
    agree = True
    for stage in ("s0", "s1"):
        by_step: dict[int, set] = {}
        for n in records:
            if n.startswith(stage):
                for r in _last_start(records[n], "outer_step"):   # a restarted run redoes some outer steps
                    if r["applied"]:
                        by_step.setdefault(r["outer_step"], set()).add(r.get("params_hash"))
        agree &= all(len(v) == 1 for v in by_step.values())
    swarm_last = {n: [r for r in records[n] if r["event"] == "swarm"][-1] for n in records}
    served = {n: swarm_last[n]["backward"] for n in records if n.startswith("s1")}
    tokens = sum(max(r["tokens"] for r in records[n] if r["event"] == "step") for n in owners)
    return dict(loss=evals[-1]["loss"], agree=agree, wall_s=round(wall, 1), run_tokens_per_s=round(tokens / wall, 1),
                stage_bytes=sum(r["wire_bytes"] for rs in outer.values() for r in rs),
                pipeline_bytes=sum(swarm_last[n]["pipeline_bytes_out"] + swarm_last[n]["pipeline_bytes_in"]
                                   for n in owners),
                served=served, reissued=sum(swarm_last[n]["reissued"] for n in owners))


def _last_start(records: list[dict], event: str) -> list[dict]:
    """The `event` records of the worker's last start (a metrics file appends across starts)."""
    starts = [i for i, r in enumerate(records) if r["event"] == "run_start"]
    return [r for r in records[starts[-1] if starts else 0:] if r["event"] == event]


def run_plain(workdir: Path, args, seed: int) -> dict:
    started = time.monotonic()
    records = run_single(workdir, [*train_args(args, seed, args.batch * args.workers), "--data.data_rank", "0"],
                         args.timeout)["node0"]
    wall = time.monotonic() - started
    tokens = max(r["tokens"] for r in records if r["event"] == "step")
    return dict(loss=[r for r in records if r["event"] == "eval"][-1]["loss"], agree=True, wall_s=round(wall, 1),
                run_tokens_per_s=round(tokens / wall, 1), stage_bytes=0, pipeline_bytes=0, served={}, reissued=0)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="zb-bench-swarm-"))
    runs = []
    try:
        for seed in args.seeds:
            for row in args.rows:
                pairs = [("even", False), ("slowed", True)] if row == "slowed" else [(row, False)]
                if row == "slowed" and seed != args.seeds[0]:
                    continue   # throughput rows: once
                for name, slow in pairs:
                    workdir = base / f"{name}-s{seed}"
                    try:
                        result = run_plain(workdir, args, seed) if name == "single" else \
                            run_grid(workdir, args, seed, name, slow)
                    except (RuntimeError, TimeoutError, KeyError, IndexError) as e:
                        runs.append(dict(row=name, seed=seed, error=str(e)[:2000]))
                        print(f"{name} seed {seed}: FAILED: {e}", file=sys.stderr)
                        continue
                    runs.append(dict(row=name, seed=seed, **result))
                    print(f"{name} seed {seed}: loss {result['loss']:.4f}, {result['wall_s']} s, served "
                          f"{result['served']}", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    doc = report(runs, args)
    print(json.dumps(doc))
    return doc


def report(runs: list[dict], args) -> dict:
    rows: dict[str, list[dict]] = {}
    for r in runs:
        if "error" not in r:
            rows.setdefault(r["row"], []).append(r)
    base = rows.get("swarm")
    base_loss = sum(r["loss"] for r in base) / len(base) if base else None
    base_bytes = sum(r["stage_bytes"] for r in base) / len(base) if base else None
    table = []
    for name, rs in rows.items():
        loss = sum(r["loss"] for r in rs) / len(rs)
        stage_bytes = sum(r["stage_bytes"] for r in rs) / len(rs)
        line = dict(row=name, seeds=len(rs), loss=round(loss, 4),
                    loss_vs_swarm=round(loss / base_loss - 1, 4) if base_loss else None,
                    stage_bytes=int(stage_bytes), stage_bytes_vs_swarm=round(stage_bytes / base_bytes, 4)
                    if base_bytes else None, pipeline_bytes=int(sum(r["pipeline_bytes"] for r in rs) / len(rs)),
                    run_tokens_per_s=round(sum(r["run_tokens_per_s"] for r in rs) / len(rs), 1),
                    agree=all(r["agree"] for r in rs))
        if name == "restart":
            same_seed = {r["seed"]: r["loss"] for r in rows.get("dswarm-h10", [])}
            pairs = [(r["loss"], same_seed[r["seed"]]) for r in rs if r["seed"] in same_seed]
            line.update(loss_vs_h10=round(sum(a for a, _ in pairs) / sum(b for _, b in pairs) - 1, 4) if pairs else None,
                        resumed_step=[r["resumed_step"] for r in rs], redone_steps=[r["redone_steps"] for r in rs],
                        restart_s=[r["restart_s"] for r in rs])
        if name in ("slowed", "even"):
            served = rs[0]["served"]
            line["served"] = served
            line["slowed_share"] = round(served.get(f"s1w{args.workers - 1}", 0) / max(1, sum(served.values())), 3)
        table.append(line)
    print(f"{'row':<12}{'seeds':>6}{'held-out':>10}{'vs swarm':>10}{'stage MB':>10}{'x swarm':>9}{'pipe MB':>9}"
          f"{'tok/s':>9}  agree  slowed share", file=sys.stderr)
    for t in table:
        vs = f"{100 * t['loss_vs_swarm']:+.2f}%" if t["loss_vs_swarm"] is not None else "-"
        xb = f"{t['stage_bytes_vs_swarm']:.3f}" if t["stage_bytes_vs_swarm"] is not None else "-"
        print(f"{t['row']:<12}{t['seeds']:>6}{t['loss']:>10.4f}{vs:>10}{t['stage_bytes'] / 1e6:>10.1f}{xb:>9}"
              f"{t['pipeline_bytes'] / 1e6:>9.1f}{t['run_tokens_per_s']:>9.0f}  {str(t['agree']):<6} "
              f"{t.get('slowed_share', '')}", file=sys.stderr)
    for t in table:
        if t["row"] == "restart":
            vs = f"{100 * t['loss_vs_h10']:+.2f}%" if t["loss_vs_h10"] is not None else "- (no dswarm-h10 row)"
            print(f"restart: held-out loss vs dswarm-h10 of the same seeds {vs}; resumed at steps {t['resumed_step']}, "
                  f"{t['redone_steps']} steps done twice, first step {t['restart_s']} s after the relaunch",
                  file=sys.stderr)
    config = {k: getattr(args, k) for k in ("steps", "batch", "workers", "seq", "model", "lr", "warmup", "outer_lr",
                                             "outer_momentum", "eval_batches", "slow_quota")}
    return dict(bench="swarm", config=config, table=table, runs=runs, load=os.getloadavg()[0])


if __name__ == "__main__":
    main()
