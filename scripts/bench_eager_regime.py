"""Eager against blocking DiLoCo across the regime: H and the outer optimizer's settings, best against best.

Issue 24 asks whether eager's loss gap on the convergence benchmark (+43% at H = 10, outer lr 1.0,
momentum 0) is a defect or the regime. The rule itself is held elsewhere (tests/test_node_inprocess.py:
the closed forms, M = 1, a single-process reference; real runs equal the simulation to 1e-5). Here
every cell is the single-process simulation of the rule (tests/drivers/diloco_reference.py, the same
model, data and inner optimizer as `zb train`), so a sweep of many settings fits on a 2-core machine:
the loss is the mean train loss of the last 30 steps over the nodes.

    PYTHONPATH=$PWD python scripts/bench_eager_regime.py --hs 10,30 --settings 1.0:0,0.7:0.9,0.5:0,0.7:0

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from statistics import mean

from zb.testing.cluster import REFERENCE
from zb.testing.procs import REPO, checkout_file, subprocess_env

TAIL = 30   # steps at the end whose train loss is averaged


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4, help="M: simulated DiLoCo nodes.")
    p.add_argument("--steps", type=int, default=300, help="Inner steps (a multiple of every H).")
    p.add_argument("--hs", default="10,30", help="Comma-separated H values (diloco.inner_steps).")
    p.add_argument("--settings", default="1.0:0,0.7:0.9,0.5:0,0.7:0",
                   help="Comma-separated outer lr:momentum pairs (Nesterov when momentum > 0).")
    p.add_argument("--model", default="debug", help="model.name.")
    p.add_argument("--batch", type=int, default=8, help="Per-node batch in sequences.")
    p.add_argument("--seq", type=int, default=128, help="data.seq_length.")
    p.add_argument("--seed", type=int, default=1, help="train.seed.")
    p.add_argument("--jobs", type=int, default=2, help="Simulations run at once (one thread each).")
    p.add_argument("--json", action="store_true", help="Only the JSON line on stdout.")
    args = p.parse_args(argv)
    hs = [int(h) for h in args.hs.split(",")]
    if any(args.steps % h for h in hs):
        p.error(f"--steps {args.steps} must be a multiple of every H ({args.hs})")
    if args.steps < TAIL:
        p.error(f"--steps must be at least {TAIL} (the loss is the mean of the last {TAIL} steps)")
    return args


def simulate(args: argparse.Namespace, rule: str, h: int, lr: float, momentum: float) -> float:
    flags = ["--model.name", args.model, "--optim.total_steps", str(args.steps), "--diloco.inner_steps", str(h),
             "--optim.batch_size", str(args.batch), "--train.micro_bs", str(args.batch), "--data.seq_length",
             str(args.seq), "--diloco.outer_lr", str(lr), "--diloco.outer_momentum", str(momentum),
             "--train.seed", str(args.seed), "--train.device", "cpu"]
    out = subprocess.run([sys.executable, checkout_file(REFERENCE), str(args.nodes), rule, *flags], capture_output=True,
                         text=True, timeout=3600, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"the simulation of {rule} H={h} lr={lr} momentum={momentum} failed:\n{out.stderr[-2000:]}")
    losses = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    return mean(mean(node[-TAIL:]) for node in losses)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    hs = [int(h) for h in args.hs.split(",")]
    settings = [(float(a), float(b)) for a, b in (s.split(":") for s in args.settings.split(","))]
    cells = [(rule, h, lr, mom) for h in hs for lr, mom in settings for rule in ("none", "eager")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        found = dict(zip(cells, pool.map(lambda c: simulate(args, *c), cells)))
    rows, best = [], []
    for h in hs:
        for lr, mom in settings:
            blocking, eager = found[("none", h, lr, mom)], found[("eager", h, lr, mom)]
            rows.append({"h": h, "outer_lr": lr, "outer_momentum": mom, "blocking": round(blocking, 4),
                         "eager": round(eager, 4), "eager_vs_blocking_pct": round(100 * (eager / blocking - 1), 2)})
        mine = [r for r in rows if r["h"] == h]
        b, e = min(mine, key=lambda r: r["blocking"]), min(mine, key=lambda r: r["eager"])
        best.append({"h": h, "blocking": b["blocking"], "blocking_setting": [b["outer_lr"], b["outer_momentum"]],
                     "eager": e["eager"], "eager_setting": [e["outer_lr"], e["outer_momentum"]],
                     "eager_vs_blocking_pct": round(100 * (e["eager"] / b["blocking"] - 1), 2)})
    doc = {"bench": "eager_regime", "nodes": args.nodes, "steps": args.steps, "model": args.model,
           "batch": args.batch, "seq": args.seq, "seed": args.seed, "rows": rows, "best": best}
    if not args.json:
        print(f"{'H':>4} {'outer lr':>8} {'momentum':>8} {'blocking':>9} {'eager':>9} {'eager vs blocking':>18}")
        for r in rows:
            print(f"{r['h']:>4} {r['outer_lr']:>8} {r['outer_momentum']:>8} {r['blocking']:>9.4f} {r['eager']:>9.4f} "
                  f"{r['eager_vs_blocking_pct']:>+17.2f}%")
        for b in best:
            print(f"H={b['h']}: best blocking {b['blocking']:.4f} (lr, momentum {b['blocking_setting']}), best eager "
                  f"{b['eager']:.4f} ({b['eager_setting']}): {b['eager_vs_blocking_pct']:+.2f}%")
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
