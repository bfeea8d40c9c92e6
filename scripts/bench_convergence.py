"""DiLoCo convergence benchmark: does DiLoCo learn as well as synchronous data-parallel?

Run:  PYTHONPATH=$PWD python scripts/bench_convergence.py            (the full table, ~30 min)
      PYTHONPATH=$PWD python scripts/bench_convergence.py --quick --rows diloco-h5-fp32 --seeds 1

Rows (every one a real `zb train` run on the built-in offline data, whose entropy floor is printed):
  single          one node alone, batch B, S steps (the lower anchor; 1/N of the tokens)
  dp              synchronous data-parallel over N nodes, i.e. one process with batch N*B (an
                  all-reduce of the grads every step is mathematically the same step)
  diloco-hH-C     N DiLoCo nodes (`zb store` + N processes), batch B each, H inner steps,
                  pseudo-gradients sent as C = fp32, int8, int4 or int2 (int4 and int2 with error
                  feedback, their default; a "-noef" suffix turns it off: diloco-h10-int4-noef), or sparse
                  (diloco.compression = sparse at --sparse-outer-lr, no outer momentum: SparseLoCo's outer step)
  elastic-hH-C    as diloco-hH-C, but the last node is SIGKILLed after 1/3 of the outer steps and a
                  new node joins at once; ends by checking that all live nodes agree (params_hash)
  eager-hH-C      as diloco-hH-C with diloco.overlap = eager (the all-reduce behind the next round)
  streaming-hH-C  as diloco-hH-C with diloco.overlap = streaming (--fragments, --fragment-delay, --fragment-alpha)
  poison-hH-C     as diloco-hH-C, but the last node sends its pseudo-gradient x1000 every round
                  (scripts/_hostile_node.py); flip-hH-C: the last node sends it sign-flipped
  ...-clipK       any DiLoCo row with diloco.clip = K (robust aggregation), e.g. poison-h10-fp32-clip2
Single, dp and node 0 of every DiLoCo row train on data shard 0 of N and are evaluated on the same
held-out shard, so their final held-out losses are comparable. DiLoCo losses are node 0's eval after
the final outer step (params are identical on all nodes then). Seeds are interleaved (seed 1 of every
row, then seed 2, ...). Prints a rich table on stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _convergence_procs import run_nodes, run_single  # noqa: E402
from _convergence_report import report  # noqa: E402

from zb.config_schema import DilocoConfig  # noqa: E402

DEFAULT_ROWS = "single,dp,diloco-h10-fp32,diloco-h10-int8,diloco-h50-fp32,diloco-h50-int8,elastic-h10-fp32"
ROW = re.compile(r"^(single|dp|(diloco|elastic|eager|streaming|poison|flip)-h(\d+)-(fp32|int8|int4|int2|sparse)(-noef)?"
                 r"(-clip([\d.]+))?)$")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"Comma-separated rows (default: {DEFAULT_ROWS}).")
    p.add_argument("--seeds", default="1,2", help="Comma-separated train.seed values, one run per row each.")
    p.add_argument("--steps", type=int, default=500, help="Inner steps S of every run (a multiple of each H).")
    p.add_argument("--batch", type=int, default=8, help="Per-node batch B in sequences (dp uses N*B).")
    p.add_argument("--nodes", type=int, default=4, help="N: DiLoCo nodes, and dp's batch multiple.")
    p.add_argument("--seq", type=int, default=128, help="data.seq_length.")
    p.add_argument("--model", default="debug", help="model.name (debug or tiny).")
    p.add_argument("--lr", type=float, default=3e-3, help="Inner (and single/dp) peak learning rate.")
    p.add_argument("--warmup", type=int, default=20, help="optim.warmup_steps.")
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco.outer_lr.")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="diloco.outer_momentum.")
    p.add_argument("--sparse-outer-lr", type=float, default=None,
                   help="diloco.outer_lr of sparse rows (no outer momentum). Default: zb's for --sparse-average (4 for "
                        "nodes, 2 for senders: the best measured in scripts/bench_sparse_shapes.py).")
    p.add_argument("--sparse-beta", type=float, default=DilocoConfig().sparse_beta,
                   help="diloco.sparse_beta of sparse rows (default: zb's).")
    p.add_argument("--sparse-average", choices=("nodes", "senders"), default=DilocoConfig().sparse_average,
                   help="diloco.sparse_average of sparse rows (default: zb's; runs before 2026-12-03 averaged over "
                        "nodes).")
    p.add_argument("--fragments", type=int, default=2, help="diloco.fragments of streaming rows.")
    p.add_argument("--fragment-delay", type=int, default=1, help="diloco.fragment_delay of streaming rows.")
    p.add_argument("--fragment-alpha", type=float, default=0.5, help="diloco.fragment_alpha of streaming rows.")
    p.add_argument("--eval-batches", type=int, default=32, help="eval.batches of the final held-out eval.")
    p.add_argument("--timeout", type=float, default=900, help="Seconds one run may take before it is killed.")
    p.add_argument("--quick", action="store_true", help="Tiny smoke size: 20 steps, batch 4, seq 64, 2 nodes.")
    p.add_argument("--json", action="store_true", help="Only the JSON line on stdout (no table).")
    p.add_argument("--keep", metavar="DIR", help="Keep every run's logs and metrics under DIR.")
    p.add_argument("--reuse", metavar="FILE", action="append", default=[],
                   help="Take (row, seed) runs from an earlier JSON line of this script instead of running them "
                        "(same training settings; for DiLoCo rows also the same outer settings). Repeatable.")
    args = p.parse_args(argv)
    if args.sparse_outer_lr is None:
        args.sparse_outer_lr = DilocoConfig(compression="sparse", sparse_average=args.sparse_average).lr()
    if args.quick:
        args.steps, args.batch, args.seq, args.nodes, args.warmup, args.eval_batches = 20, 4, 64, 2, 2, 4
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    for row in args.rows:
        m = ROW.match(row)
        if m is None:
            p.error(f"unknown row {row!r}: use single, dp, or diloco-, elastic-, eager-, streaming-, poison- or "
                    "flip-h<H>-<fp32|int8|int4|int2|sparse>[-noef][-clipK]")
        if m.group(3) and args.steps % int(m.group(3)):
            p.error(f"--steps {args.steps} is not a multiple of H in {row}")
    return args


def train_args(args: argparse.Namespace, seed: int, batch: int) -> list[str]:
    micro = min(batch, 8)
    return ["--model.name", args.model, "--data.seq_length", str(args.seq), "--optim.batch_size", str(batch),
            "--train.micro_bs", str(micro), "--optim.total_steps", str(args.steps), "--optim.lr", str(args.lr),
            "--optim.warmup_steps", str(args.warmup), "--eval.interval", "0", "--eval.batches",
            str(args.eval_batches), "--train.seed", str(seed), "--data.data_world_size", str(args.nodes),
            "--log.progress", "plain", "--train.log_interval", "50", "--train.device", "cpu"]


def run_row(row: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One run of one row; returns its final loss, bytes, outer steps and checks."""
    started = time.monotonic()
    m = ROW.match(row)
    if row in ("single", "dp"):
        batch = args.batch * (args.nodes if row == "dp" else 1)
        records = run_single(workdir, [*train_args(args, seed, batch), "--data.data_rank", "0"], args.timeout)
        result = summarize(records, ["node0"], dp_steps=args.steps if row == "dp" else 0)
    else:
        h, compression = int(m.group(3)), "none" if m.group(4) == "fp32" else m.group(4)
        feedback = ["--diloco.error_feedback", "false" if m.group(5) else "true"] if compression != "none" else []
        lr, momentum = (args.sparse_outer_lr, 0.0) if compression == "sparse" else (args.outer_lr, args.outer_momentum)
        diloco = [*feedback, "--diloco.inner_steps", str(h), "--diloco.compression", compression, "--diloco.outer_lr",
                  str(lr), "--diloco.outer_momentum", str(momentum), "--train.log_model_hash",
                  "--diloco.overlap", m.group(2) if m.group(2) in ("eager", "streaming") else "none"]
        if compression == "sparse":
            diloco += ["--diloco.sparse_beta", str(args.sparse_beta), "--diloco.sparse_average", args.sparse_average]
        if m.group(7):
            diloco += ["--diloco.clip", m.group(7)]
        if m.group(2) == "streaming":
            diloco += ["--diloco.fragments", str(args.fragments), "--diloco.fragment_delay", str(args.fragment_delay),
                       "--diloco.fragment_alpha", str(args.fragment_alpha)]
        kill_at = max(1, args.steps // h // 3) if m.group(2) == "elastic" else None
        hostile = {"poison": 1000.0, "flip": -1.0}.get(m.group(2))
        records, live = run_nodes(workdir, [*train_args(args, seed, args.batch), *diloco], args.nodes,
                                  args.timeout, kill_at, hostile)
        result = summarize(records, live)
    return dict(row=row, seed=seed, wall_s=round(time.monotonic() - started, 1), **result)


def summarize(records: dict[str, list[dict]], live: list[str], dp_steps: int = 0) -> dict:
    """Final held-out loss of node 0, bytes it sent, and whether the live nodes agree at the end."""
    evals = {name: [r for r in records[name] if r["event"] == "eval"] for name in live}
    outer = {name: [r for r in records[name] if r["event"] == "outer_step"] for name in records}
    loss = evals["node0"][-1]["loss"]
    # Every live node's last outer step and params hash (a node that never synced counts as disagreeing).
    finals = {name: (outer[name][-1]["outer_step"], outer[name][-1].get("params_hash")) if outer[name] else name
              for name in live}
    return dict(
        loss=loss,
        loss_nodes_mean=sum(e[-1]["loss"] for e in evals.values()) / len(evals),
        wire_bytes=sum(r["wire_bytes"] for r in outer["node0"]),
        outer_steps=len(outer["node0"]),
        applied=sum(bool(r["applied"]) for r in outer["node0"]),
        agree=len(set(finals.values())) == 1 if outer["node0"] else None,
        mesh_version=max((r["mesh_version"] for r in outer["node0"]), default=0),
        final_nodes=sorted(live),
        max_world=max((r["global_world_size"] for r in outer["node0"]), default=1),
        min_world=min((r["global_world_size"] for r in outer["node0"]), default=1),
        run_tokens=max(r["run_tokens"] for r in records["node0"] if r["event"] == "step"),
        dp_steps=dp_steps,
    )


SAME = ("model", "seq", "batch", "nodes", "steps", "lr", "warmup", "eval_batches")


def reused_runs(paths: list[str], args: argparse.Namespace) -> list[dict]:
    """Runs of earlier invocations for the requested (row, seed) pairs; a file whose training settings
    differ is refused, and its DiLoCo runs are used only if its outer settings match too."""
    taken: dict[tuple[str, int], dict] = {}
    for path in paths:
        earlier = json.loads(Path(path).read_text().strip().splitlines()[-1])
        differ = [k for k in SAME if earlier["config"][k] != getattr(args, k)]
        if differ:
            raise SystemExit(f"--reuse {path}: settings differ ({', '.join(differ)}); rerun those rows instead")
        same_outer = all(earlier["config"][k] == getattr(args, k) for k in ("outer_lr", "outer_momentum"))
        # Runs from before --sparse-beta ran at 0.95, and from before --sparse-average over nodes: zb's defaults then.
        same_sparse = (earlier["config"].get("sparse_outer_lr"), earlier["config"].get("sparse_beta", 0.95),
                       earlier["config"].get("sparse_average", "nodes")) \
            == (args.sparse_outer_lr, args.sparse_beta, args.sparse_average)
        for r in earlier["runs"]:
            if r["row"] in args.rows and r["seed"] in args.seeds and "error" not in r \
                    and (r["row"] in ("single", "dp") or (same_sparse if "sparse" in r["row"] else same_outer)):
                taken.setdefault((r["row"], r["seed"]), r)
    return list(taken.values())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="zb-convergence-"))
    runs = reused_runs(args.reuse, args)
    done = {(r["row"], r["seed"]) for r in runs}
    try:
        for seed in args.seeds:
            for row in args.rows:
                if (row, seed) in done:
                    continue
                try:
                    runs.append(run_row(row, seed, args, base / f"{row}-s{seed}"))
                except (RuntimeError, TimeoutError, KeyError, IndexError) as e:
                    # One broken run must not lose the others: it is reported, and left out of the means.
                    runs.append(dict(row=row, seed=seed, error=str(e)))
                    print(f"{row} seed {seed}: FAILED: {e}", file=sys.stderr)
                    continue
                print(f"{row} seed {seed}: loss {runs[-1]['loss']:.4f} in {runs[-1]['wall_s']} s", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    doc = report(runs, args)
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
