"""Shared by the durable-checkpoint tests: a small training state, a manager over tmp_path, a
metrics recorder, and a small tmpfs (a full or read-only disk, for real)."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from zb.ckpt.durable.manager import CheckpointManager, TrainState
from zb.config_schema import CkptConfig, RemoteConfig
from zb.position import RunPosition


class Recorder:
    """A metrics sink that keeps events in memory."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def log(self, event: str, **fields) -> None:
        self.events.append((event, fields))

    def of(self, event: str) -> list[dict]:
        return [f for e, f in self.events if e == event]


def small_state(seed: int = 0, width: int = 64) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(2):
        model(torch.randn(4, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return TrainState(model, opt, sched, RunPosition(step=2, tokens=8, run_tokens=8),
                      data_state={"kind": "fake", "batch": 2}, outer=None, config={},
                      fingerprint={"model.dim": width, "local_world_size": 1})


def manager(tmp_path: Path, sink=None, **kw) -> CheckpointManager:
    remote = RemoteConfig(path=kw.pop("remote", None))
    cfg = CkptConfig(interval=1, path=str(tmp_path / "disk"), ram_dir=str(tmp_path / "ram"), remote=remote, **kw)
    return CheckpointManager(cfg, uid="n0", local_rank=0, local_world_size=1, sink=sink or Recorder(),
                             retry_delay=0.01)


def save_steps(m: CheckpointManager, state: TrainState, steps: list[int]) -> None:
    for step in steps:
        state.position = RunPosition(step=step)
        m.save(step, state)
        assert m.wait(30)


@contextmanager
def tmpfs(path, size: int, *options: str):
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
