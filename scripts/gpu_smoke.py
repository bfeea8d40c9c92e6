"""GPU smoke test of zb's CUDA paths: a minute on a machine with one or more NVIDIA GPUs.

    python scripts/gpu_smoke.py                 # every stage
    python scripts/gpu_smoke.py --stage single --stage diloco --keep /tmp/zb-smoke

None of this has run on a GPU while zb was written (there was none): it is what a user with a GPU
runs first. Each stage runs `zb train` on the debug model and the built-in text in subprocesses and
prints one line, PASS, FAIL (with the reason and the log to read) or SKIP (with why):

  single      one GPU, bf16: eval, checkpoints, then a resume from `latest` that continues the run
  ac-compile  one GPU, bf16, activation checkpointing and torch.compile
  torchrun    all visible GPUs (2 or more) as local ranks: FSDP2 over NCCL, gradients reduced per
              micro batch, an eval right before the final checkpoint, then a resume from `latest`
  diloco      two DiLoCo nodes on this machine with a `zb store`: int8 outer steps, and every outer
              step's params hash equal on both nodes (local ranks per node: GPUs // 2, at least 1)

Exit code: 0 if no stage failed, 1 if one did, 2 if no CUDA GPU is visible (nothing was run).

--cpu runs the same stages on the CPU (gloo, 2 "GPUs"): a check of this script itself on a machine
without a GPU; it says nothing about the CUDA paths.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _two_nodes import REPO, repo_env, run_two_nodes

STAGES = ("single", "ac-compile", "torchrun", "diloco")
DEVICE = ["--train.device", "cuda"]  # --cpu: ["--train.device", "cpu"]
BASE = ["@configs/debug/normal.toml", "--train.param_dtype", "bf16", "--log.progress", "plain",
        "--train.log_interval", "1", "--optim.warmup_steps", "2", "--eval.batches", "2"]


class StageFailed(Exception):
    pass


class Skip(Exception):
    pass


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _metrics(log_dir: Path, kind: str) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == kind]


def _zb_train(work: Path, name: str, args: list[str], nproc: int = 1, timeout: float = 300, env=None) -> str:
    """Run `zb train` (through torch's launcher when nproc > 1); its stderr, or StageFailed."""
    cmd = [sys.executable, "-m", "zb", "train", *DEVICE, *args]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    log = work / f"{name}.log"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env or repo_env())
    except subprocess.TimeoutExpired as e:
        log.write_text((e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        raise StageFailed(f"{name}: no exit within {timeout:.0f} s (log: {log})") from None
    log.write_text(proc.stderr)
    if proc.returncode != 0:
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise StageFailed(f"{name}: exit {proc.returncode}: {last[0][:200]} (log: {log})")
    return proc.stderr


def _finite_losses(log_dir: Path, what: str) -> list[dict]:
    steps = _metrics(log_dir, "step")
    if not steps or not all(math.isfinite(s["loss"]) for s in steps):
        raise StageFailed(f"{what}: no steps logged or a non-finite loss (metrics: {log_dir / 'metrics.jsonl'})")
    return steps


def _train_then_resume(work: Path, name: str, extra: list[str], nproc: int) -> str:
    ck, a, b = work / f"{name}-ckpt", work / f"{name}-a", work / f"{name}-b"
    ckpt = ["--ckpt.path", str(ck), "--ckpt.ram_dir", str(work / f"{name}-ram"), "--ckpt.interval", "5"]
    err = _zb_train(work, f"{name}-first", [*BASE, *extra, *ckpt, "--optim.total_steps", "12", "--eval.interval",
                                            "5", "--log.dir", str(a)], nproc)
    if "params computed in bf16" not in err:
        raise StageFailed(f"{name}: params not computed in bf16 (log: {work / (name + '-first.log')})")
    _finite_losses(a, name)
    err = _zb_train(work, f"{name}-resume", [*BASE, *extra, *ckpt, "--optim.total_steps", "16", "--ckpt.resume",
                                             "latest", "--log.dir", str(b)], nproc)
    steps = [s["step"] for s in _finite_losses(b, f"{name} resume")]
    if "resumed from" not in err or steps[0] != 13:
        raise StageFailed(f"{name}: the resume did not continue at step 13 (steps {steps[:3]}...; "
                          f"log: {work / (name + '-resume.log')})")
    return "12 steps with eval and checkpoints, resumed from step 12 to 16"


def stage_single(work: Path, gpus: int) -> str:
    return _train_then_resume(work, "single", [], 1)


def stage_ac_compile(work: Path, gpus: int) -> str:
    log_dir = work / "ac-compile"
    _zb_train(work, "ac-compile", [*BASE, "--train.ac_ckpt", "--train.torch_compile", "--optim.total_steps", "8",
                                   "--eval.interval", "-1", "--log.dir", str(log_dir)], timeout=600)
    return f"{len(_finite_losses(log_dir, 'ac-compile'))} steps with activation checkpointing and torch.compile"


def stage_torchrun(work: Path, gpus: int) -> str:
    if gpus < 2:
        raise Skip("needs 2 or more GPUs")
    nproc = min(gpus, 8)
    # debug.toml's batch of 16 must split over the ranks into micro batches of 2.
    extra = ["--optim.batch_size", str(2 * nproc * 2), "--train.micro_bs", "2", "--train.reduce_every_micro_batch"]
    return f"{nproc} ranks: " + _train_then_resume(work, "torchrun", extra, nproc)


def stage_diloco(work: Path, gpus: int) -> str:
    per_node = max(1, gpus // 2)

    def args_of(i: int) -> list[str]:
        return ["@configs/debug/diloco.toml", *DEVICE, "--log.progress", "plain", "--optim.total_steps", "20",
                "--optim.warmup_steps", "2", "--diloco.inner_steps", "5", "--train.log_model_hash",
                "--optim.batch_size", str(8 * per_node), "--log.dir", str(work / f"diloco{i}")] + \
            (["--nproc-per-node", str(per_node)] if per_node > 1 else [])

    def env_of(i: int) -> dict[str, str]:
        devices = ",".join(str(d) for d in range(i * per_node, (i + 1) * per_node)) if gpus >= 2 else "0"
        return {"CUDA_VISIBLE_DEVICES": devices}

    failed = run_two_nodes(work, "diloco", args_of, 300, env_of)
    if failed:
        raise StageFailed(failed)
    hashes = [[e.get("params_hash") for e in _metrics(work / f"diloco{i}", "outer_step")] for i in range(2)]
    if not hashes[0] or None in hashes[0] or hashes[0] != hashes[1]:
        raise StageFailed(f"diloco: params hashes differ between the nodes or are missing: {hashes}")
    events = [e for i in range(2) for e in _metrics(work / f"diloco{i}", "outer_step")]
    split = ", ".join(f"{name} {sorted(e.get(key, 0.0) for e in events)[len(events) // 2]:.3f} s"
                      for key, name in (("d2h_s", "device-to-host"), ("reduce_s", "all-reduce"), ("h2d_s", "host-to-device")))
    return f"2 nodes x {per_node} rank(s), {len(hashes[0])} outer steps, params hashes equal on both; median {split}"


RUNNERS = {"single": stage_single, "ac-compile": stage_ac_compile, "torchrun": stage_torchrun,
           "diloco": stage_diloco}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", action="append", choices=STAGES, help="run only this stage (repeatable)")
    parser.add_argument("--cpu", action="store_true", help="run the stages on the CPU: checks this script, "
                                                           "not the CUDA paths")
    parser.add_argument("--keep", metavar="DIR", help="write logs and checkpoints here and keep them "
                                                      "(default: a temporary directory, kept only on failure)")
    args = parser.parse_args(argv)
    gpus = 2 if args.cpu else _gpus()
    if args.cpu:
        DEVICE[:] = ["--train.device", "cpu"]
    if gpus == 0:
        print("gpu_smoke: FAIL: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); run this on a "
              "machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="zb-gpu-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    seen = "--cpu: the stages on the CPU, 2 ranks standing in for GPUs" if args.cpu else f"{gpus} GPU(s) visible"
    print(f"gpu_smoke: {seen}; logs in {work}", flush=True)
    failed = False
    for name in args.stage or STAGES:
        t0 = time.perf_counter()
        try:
            detail = RUNNERS[name](work, gpus)
            status = "PASS"
        except Skip as e:
            status, detail = "SKIP", str(e)
        except StageFailed as e:
            status, detail, failed = "FAIL", str(e), True
        print(f"{status} {name:<11} {time.perf_counter() - t0:6.1f} s  {detail}", flush=True)
    if not failed and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
