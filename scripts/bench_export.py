"""Benchmark: `zb export --format hf` of a 150M checkpoint on the CPU, against copying the same bytes.

    PYTHONPATH=$PWD python scripts/bench_export.py [--repeats 3] [--dir /tmp] [--json]
    PYTHONPATH=$PWD python scripts/bench_export.py --checkpoints CKPT_A,CKPT_B --repeats 1   # existing ones

Without --checkpoints it first writes two real checkpoints with `zb train` (llama2 150M at Prime's
32k vocabulary, one DiLoCo step hosting its own store): one process, and two local ranks under
FSDP2 (`--nproc-per-node 2`). Per checkpoint and repeat, interleaved: the baseline, a plain copy of
the ranks' model.safetensors files (the bytes an fp32 export writes, read and written once and
fsynced, no checks); then exports of the outer params in fp32 and bf16 and of the inner params in fp32 (sha256
of every file read, gather, RoPE reordering, write, fsync). Reports medians and export / copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--model.type", "llama2", "--model.name", "150M", "--model.vocab_size", "32000"]
VARIANTS = (("outer fp32", False, "fp32"), ("outer bf16", False, "bf16"), ("inner fp32", True, "fp32"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(root: Path, ranks: int, model: list[str]) -> Path:
    """A real checkpoint of one DiLoCo step of `zb train` with `ranks` local ranks."""
    args = [sys.executable, "-m", "zb", "train", *model, "--data.seq_length", "32", "--optim.batch_size", "2",
            "--train.micro_bs", "1", "--optim.total_steps", "1", "--optim.warmup_steps", "1", "--eval.interval", "-1",
            "--train.device", "cpu", "--log.progress", "plain", "--diloco.inner_steps", "1", "--elastic.host_store",
            "--ckpt.interval", "1", "--ckpt.grace_period", "1800",  # 4.4 GB of state: the disk copy takes a while
            "--ckpt.path", str(root / "ckpt"), "--ckpt.ram_dir", str(root / "ram"), "--log.dir", str(root / "log"),
            "--nproc-per-node", str(ranks)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZB_", "GLOBAL_", "ZERO_BAND_"))}
    env.update(GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(_free_port()), GLOBAL_UNIQUE_ID=f"bench-{ranks}",
               PYTHONPATH=str(REPO))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"zb train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return root / "ckpt" / "step-000000001"


def copy_baseline(step_dir: Path, dest: Path) -> float:
    """The floor of any durable export: the same bytes read once and written once, fsynced (as the
    export's files are), without checks or conversions."""
    t0 = time.perf_counter()
    dest.mkdir()
    for part in sorted(step_dir.glob("rank-*")):
        shutil.copyfile(part / "model.safetensors", dest / f"{part.name}.safetensors")
        with open(dest / f"{part.name}.safetensors", "rb") as f:
            os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    shutil.rmtree(dest)
    return seconds


def measure(step_dir: Path, repeats: int, scratch: Path) -> dict:
    from zb.export import export_checkpoint

    times: dict[str, list[float]] = {"copy": [], **{name: [] for name, _, _ in VARIANTS}}
    for _ in range(repeats):
        times["copy"].append(copy_baseline(step_dir, scratch / "copy"))
        for name, inner, dtype in VARIANTS:
            out = scratch / "export"
            t0 = time.perf_counter()
            report = export_checkpoint(step_dir, out, inner=inner, dtype=dtype)
            times[name].append(time.perf_counter() - t0)
            if name == "outer fp32":
                fp32 = report
            shutil.rmtree(out)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {"checkpoint": str(step_dir), "local_ranks": fp32.local_ranks, "parameters": fp32.parameters,
            "fp32_bytes": fp32.bytes, "seconds": medians, "phases_outer_fp32": fp32.seconds,
            "ratio_to_copy": {name: medians[name] / medians["copy"] for name, _, _ in VARIANTS},
            "mb_per_s_outer_fp32": fp32.bytes / 1e6 / medians["outer fp32"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="Where checkpoints and exports are written (default: a temp dir).")
    parser.add_argument("--checkpoints", default=None, help="Comma-separated existing step directories to export.")
    parser.add_argument("--json", action="store_true", help="Print only the JSON line.")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="zb-bench-export-", dir=args.dir))
    try:
        if args.checkpoints:
            steps = [Path(p) for p in args.checkpoints.split(",")]
        else:
            steps = [write_checkpoint(scratch / f"ranks{n}", n, MODEL) for n in (1, 2)]
        rows = [measure(step, args.repeats, scratch) for step in steps]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"benchmark": "export", "repeats": args.repeats, "rows": rows}
    if not args.json:
        print(f"{'local ranks':>11} {'params':>12} {'fp32 MB':>8} {'copy s':>7} " +
              " ".join(f"{name + ' s':>13} {'/copy':>6}" for name, _, _ in VARIANTS))
        for r in rows:
            print(f"{r['local_ranks']:>11} {r['parameters']:>12,} {r['fp32_bytes'] / 1e6:>8.0f} "
                  f"{r['seconds']['copy']:>7.2f} " +
                  " ".join(f"{r['seconds'][n]:>13.2f} {r['ratio_to_copy'][n]:>6.2f}" for n, _, _ in VARIANTS))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
