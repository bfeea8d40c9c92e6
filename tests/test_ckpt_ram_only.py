"""A checkpoint whose only complete copy is in RAM is never swept, whatever ended its run, and the next
start copies it to ckpt.path (issue 30, defect 2: a second Ctrl-C landed while the copy to disk ran; the
next start deleted step 6 as "RAM copies of an earlier run" and resumed from step 3)."""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time

import pytest
from ckpt_states import manager, save_steps, small_state

import zb.ckpt.durable.worker as worker_module
from zb.ckpt.durable.layout import complete_steps
from zb.ckpt.durable.ramdir import OWNER_PREFIX, claim, ram_only_steps, sweep_stale
from zb.ckpt.format.manifest import snapshot_name
from zb.position import RunPosition


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _as_if_dead(node_dir) -> None:
    """The owner files of `node_dir` name a process that is gone (the run was killed)."""
    for owner in node_dir.glob(f"{OWNER_PREFIX}*"):
        doc = json.loads(owner.read_text())
        owner.write_text(json.dumps({**doc, "pid": _dead_pid()}))


@pytest.fixture
def stop_copies(monkeypatch):
    """Call it, and every later copy to ckpt.path blocks until the test ends, then fails: a run stopped
    mid-copy."""
    gate = threading.Event()

    def blocked(src, dst):
        gate.wait(60)
        raise OSError("the process was gone before this copy finished")

    yield lambda: monkeypatch.setattr(worker_module, "copy_part", blocked)
    gate.set()


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_step_complete_only_in_ram_survives_the_next_start_and_is_resumed(tmp_path, caplog, stop_copies):
    m = manager(tmp_path)
    save_steps(m, small_state(), [3])                       # durable on disk
    stop_copies()
    state = small_state(seed=1)
    state.position = RunPosition(step=6)
    m.save(6, state)
    ram, disk = tmp_path / "ram" / "n0", tmp_path / "disk"
    _until(lambda: 6 in complete_steps(ram), "step 6 complete in RAM")
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        m.close(0)                                          # the abort: it cannot wait for the copy
    stop = [r.getMessage() for r in caplog.records if "stopping with checkpoint copies" in r.getMessage()]
    assert len(stop) == 1 and f"step 6 is complete in RAM at {ram / snapshot_name(6)}" in stop[0], stop
    assert "the newest complete checkpoint on ckpt.path is step 3" in stop[0]
    assert complete_steps(disk) == [3] and ram_only_steps(ram, disk) == [6]
    _as_if_dead(ram)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        again = manager(tmp_path, resume="latest")
    assert complete_steps(disk) == [3, 6], "the next start finishes the copy"
    assert any("copied from" in r.getMessage() and "step 6" in r.getMessage() for r in caplog.records)
    resumed = again.resume(small_state(seed=2))
    assert resumed.position.step == 6
    again.close()


def test_the_sweep_keeps_a_dead_runs_only_copy_and_removes_it_once_durable(tmp_path, caplog):
    m = manager(tmp_path)
    save_steps(m, small_state(), [2])
    ram_copy = tmp_path / "ram" / "n0"
    # Another node's RAM directory on this machine (a run with another node id): step 4 complete there.
    other = manager(tmp_path / "other")
    save_steps(other, small_state(), [4])
    other_ram = tmp_path / "other" / "ram" / "n0"
    assert complete_steps(other_ram) == [4]
    _as_if_dead(other_ram)
    # Its disk copy of step 4 was lost (the copy never finished): only the RAM copy is complete.
    import shutil

    shutil.rmtree(tmp_path / "other" / "disk" / snapshot_name(4))
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        assert sweep_stale(other_ram.parent) == []
    assert other_ram.exists()
    assert any("only complete copy of checkpoint step 4" in r.getMessage() for r in caplog.records)
    # Once ckpt.path holds step 4 (or a newer step), the RAM copy is no longer the only one: swept.
    save_steps(other, small_state(), [5])
    other.close(0)
    claim(other_ram, tmp_path / "other" / "disk")
    _as_if_dead(other_ram)
    assert sweep_stale(other_ram.parent) == [other_ram]
    m.close()
    assert not ram_copy.exists()
