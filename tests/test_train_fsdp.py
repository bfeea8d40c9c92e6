"""FSDP2 over 2 local ranks trains exactly like one process on the same global batch,
and `torchrun -m zb train` works end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zb.testing.procs import REPO, free_port, subprocess_env

DRIVER = str(Path(__file__).parent / "drivers" / "loss_match.py")


def _torchrun(nproc: int, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=REPO)


def _losses(proc: subprocess.CompletedProcess) -> list[float]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line)["losses"]


@pytest.mark.parametrize("reduce", ["last", pytest.param("every", marks=pytest.mark.soak), "fused"])   # suite time
def test_two_rank_fsdp_matches_one_process(reduce):
    """micro_bs 2 on 2 ranks: 2 micro batches per rank, gradients reduced after the last or after each;
    "fused": the sharded run computes the loss fused with the output projection (the weight gathered
    by FSDP2 inside forward), the single process the plain way."""
    single = subprocess.run([sys.executable, DRIVER, "4"], capture_output=True, text=True, timeout=120,
                            env=subprocess_env(), cwd=REPO)
    sharded = _torchrun(2, DRIVER, "2", reduce)
    a, b = _losses(single), _losses(sharded)
    flags = json.loads([ln for ln in sharded.stdout.splitlines() if ln.startswith("{")][-1])["sync_flags"]
    assert flags == ([True, True] if reduce == "every" else [False, True])
    assert len(a) == len(b) == 4
    assert a[0] > a[-1], "the model did not learn the fixed batches"
    for x, y in zip(a, b):
        assert y == pytest.approx(x, rel=2e-5, abs=2e-5)


def test_torchrun_zb_train_two_ranks(tmp_path):
    proc = _torchrun(2, "-m", "zb", "train", "@configs/debug/normal.toml", "--optim.total_steps", "4",
                     "--optim.warmup_steps", "1", "--train.log_interval", "1", "--eval.batches", "2",
                     "--log.dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from zb.metrics import read_metrics

    steps = read_metrics(tmp_path / "metrics.jsonl", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert read_metrics(tmp_path / "metrics.jsonl", "eval")
