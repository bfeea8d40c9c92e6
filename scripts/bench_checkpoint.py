"""Benchmark: training time blocked by a checkpoint, async (zb.ckpt.durable.manager) against a synchronous save.

    python scripts/bench_checkpoint.py [--model tiny] [--dim 512] [--repeats 3] [--steps 6] [--interval 50] [--json]

One process trains the model (AdamW, fake data) with a one-node DiLoCo outer state, so the saved
state is model + inner optimizer + outer params + outer momentum (~520 MB at dim 512). Per repeat,
interleaved: (1) a synchronous save of the same state straight to ckpt.path (safetensors, sha256,
fsync, commit) - the baseline; (2) `CheckpointManager.save` (blocking_s: the copy into reused
staging buffers), then training on while the worker writes RAM -> disk; (3) the same number of
steps with no checkpoint. Reports medians: blocking_s / sync_s (target <= 10%) and tokens/s while
the background copy runs against idle, turned into the share of a checkpoint interval lost.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build(model_name: str, dim: int, tmp: Path):
    from zb.config import load_config, to_dict
    from zb.config_schema import DilocoConfig
    from zb.data import FakeLoader
    from zb.diloco.outer import OuterState
    from zb.local_world import LocalWorld
    from zb.train.device import pick_placement
    from zb.train.lr_schedule import build_optimizer, build_scheduler
    from zb.train.setup import build_model
    from zb.train.step import Trainer

    cfg = load_config([], {"model.name": model_name, "model.dim": str(dim), "train.device": "cpu",
                           "data.seq_length": "128", "ckpt.path": str(tmp / "disk"),
                           "ckpt.ram_dir": str(Path("/dev/shm") / f"zb-bench-{tmp.name}")}, environ={})
    placement = pick_placement(cfg.train, LocalWorld(0, 1))
    model = build_model(cfg, 259, placement)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    trainer = Trainer(model, opt, sched, placement, 1.0, 0.0)
    loader = FakeLoader(259, micro_bs=4, seq_length=128, shard=0, split="train")
    outer = OuterState(model, DilocoConfig())
    return cfg, to_dict(cfg), model, opt, sched, trainer, loader, outer


def train(trainer, loader, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step([next(loader)])
        times.append(time.perf_counter() - t0)
    return times


def sync_save(root: Path, state, step: int) -> float:
    """What a blocking checkpoint costs: the same files written and committed on the training thread."""
    from zb.ckpt.durable.state import OUTER, json_meta, live_tensors
    from zb.ckpt.format.snapshot import write_snapshot

    t0 = time.perf_counter()
    tensors = {**live_tensors(state), OUTER: state.outer}
    write_snapshot(root / f"step-{step:09d}", tensors, json_meta(state), step, name="rank-0")
    seconds = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    return seconds


def measure(args) -> dict:
    from zb.ckpt.durable.manager import CheckpointManager, TrainState
    from zb.fingerprint import fingerprint
    from zb.position import RunPosition

    tmp = Path(tempfile.mkdtemp(prefix="zb-bench-ckpt-", dir=args.dir))
    cfg, cfg_dict, model, opt, sched, trainer, loader, outer = build(args.model, args.dim, tmp)

    class Sink:
        events: list[dict] = []

        def log(self, event, **fields):
            if event == "checkpoint":
                self.events.append(fields)

    sink = Sink()
    manager = CheckpointManager(cfg.ckpt, uid="bench", local_rank=0, local_world_size=1, sink=sink)
    train(trainer, loader, 2)  # optimizer state exists from here on
    outer.step()
    state = TrainState(model, opt, sched, RunPosition(), data_state=loader.state_dict(), outer=outer.state_tensors(),
                       config=cfg_dict, fingerprint=fingerprint(cfg, 1, 259))
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3 + sum(
        t.numel() * t.element_size() for t in state.outer.values())
    manager.save(1, state)  # warm-up: allocates the staging buffers once
    manager.wait()
    rows = {"sync_s": [], "blocking_s": [], "background_s": [], "idle_step_s": [], "busy_step_s": []}
    try:
        for r in range(args.repeats):
            rows["sync_s"].append(sync_save(tmp / "sync", state, 10 + r))
            t0 = time.perf_counter()
            manager.save(100 + r, state)
            rows["blocking_s"].append(time.perf_counter() - t0)
            busy = []
            while not manager.wait(0) or len(busy) < args.steps:
                busy += train(trainer, loader, 1)
            rows["background_s"].append(sink.events[-1]["background_s"])
            rows["busy_step_s"].append(statistics.median(busy))
            rows["idle_step_s"].append(statistics.median(train(trainer, loader, max(args.steps, len(busy)))))
    finally:
        manager.close()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(cfg.ckpt.ram_dir, ignore_errors=True)
    return summarize(rows, nbytes, args)


def summarize(rows: dict, nbytes: int, args) -> dict:
    med = {k: statistics.median(v) for k, v in rows.items()}
    busy_steps = med["background_s"] / med["busy_step_s"]
    lost_s = med["blocking_s"] + busy_steps * max(0.0, med["busy_step_s"] - med["idle_step_s"])
    return {"model": args.model, "dim": args.dim, "state_bytes": nbytes, "repeats": args.repeats,
            **{k: round(v, 4) for k, v in med.items()},
            "blocking_vs_sync": round(med["blocking_s"] / med["sync_s"], 4),
            "step_slowdown_during_copy": round(med["busy_step_s"] / med["idle_step_s"] - 1, 4),
            "interval_steps": args.interval,
            "tokens_lost_per_interval": round(lost_s / (args.interval * med["idle_step_s"]), 4),
            "sync_lost_per_interval": round(med["sync_s"] / (args.interval * med["idle_step_s"]), 4)}


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoint of {res['state_bytes'] / 1e6:.0f} MB ({res['model']}, dim {res['dim']}), "
                        f"median of {res['repeats']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key in ("sync_s", "blocking_s", "blocking_vs_sync", "background_s", "idle_step_s", "busy_step_s",
                "step_slowdown_during_copy", "tokens_lost_per_interval", "sync_lost_per_interval"):
        table.add_row(key, f"{res[key]:.4f}")
    Console(stderr=True).print(table)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="training steps measured per phase (at least)")
    p.add_argument("--interval", type=int, default=50, help="checkpoint interval (steps) for the lost share")
    p.add_argument("--dir", default=None, help="where ckpt.path goes (default: the system temp dir, a disk)")
    p.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = p.parse_args(argv)
    res = measure(args)
    if not args.json:
        print_table(res)
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
