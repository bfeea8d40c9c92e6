"""ckpt.path that can never work is refused at start; a disk that fills during the run is reported at
its end; RAM copies are removed when the run ends, and those of dead runs at the next start.

Full and read-only disks are real: small tmpfs mounts (root; skipped where mount is not allowed)."""

from __future__ import annotations

import json
import logging
import os
import subprocess

import pytest
from ckpt_states import Recorder, manager, save_steps, small_state, tmpfs

from zb.ckpt.durable.manager import CheckpointManager
from zb.ckpt.durable.ramdir import OWNER_PREFIX
from zb.ckpt.format.manifest import snapshot_name
from zb.config_schema import CkptConfig
from zb.errors import EnvironmentFailure, InvalidInput


def on(tmp_path, path, sink=None) -> CheckpointManager:
    """A manager whose ckpt.path is `path` (RAM staging under tmp_path)."""
    cfg = CkptConfig(interval=1, path=str(path), ram_dir=str(tmp_path / "ram"))
    return CheckpointManager(cfg, uid="n0", local_rank=0, local_world_size=1, sink=sink or Recorder(),
                             retry_delay=0.01)


def _resize(path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def test_an_unusable_ckpt_path_is_refused_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for path in (blocker, blocker / "ck"):
        with pytest.raises(InvalidInput, match=f"ckpt.path '{path}' cannot hold checkpoints: .*writable directory"):
            on(tmp_path, path)
    with tmpfs(tmp_path / "ro", 1 << 20, "ro") as ro:
        with pytest.raises(InvalidInput, match="ckpt.path .*Read-only file system"):
            on(tmp_path, ro / "ck")
        with pytest.raises(InvalidInput, match="ckpt.path .*Read-only file system"):
            on(tmp_path, ro)
    with tmpfs(tmp_path / "full", 4096) as full:
        (full / "filler").write_bytes(b"x" * 4096)
        with pytest.raises(EnvironmentFailure, match="ckpt.path .*No space left on device"):
            on(tmp_path, full)


def test_an_unusable_ram_dir_means_straight_to_disk_with_a_warning(tmp_path, caplog):
    (tmp_path / "ram").write_text("a file where the RAM directory should be")
    sink = Recorder()
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        m = on(tmp_path, tmp_path / "disk", sink)
        save_steps(m, small_state(), [1])
        m.close()
    assert [(e["step"], e["ok"]) for e in sink.of("checkpoint")] == [(1, True)]
    warnings = [r.getMessage() for r in caplog.records]
    assert any("ckpt.ram_dir" in w and "straight to ckpt.path" in w for w in warnings), warnings
    assert not any("failed (attempt" in w for w in warnings), warnings  # no retries against a file, every save


def _part_bytes(tmp_path) -> int:
    """What one checkpoint part of small_state() takes on a tmpfs (whole pages per file)."""
    m = manager(tmp_path / "measure")
    save_steps(m, small_state(), [1])
    m.close()
    part = tmp_path / "measure" / "disk" / snapshot_name(1) / "rank-0"
    return sum(-(-f.stat().st_size // 4096) * 4096 for f in part.iterdir())


def test_a_disk_that_fills_during_the_run_is_reported_at_its_end(tmp_path, caplog):
    size = _part_bytes(tmp_path) * 3 // 2  # room for one checkpoint, not for the next beside it
    with tmpfs(tmp_path / "small", size) as disk:
        sink = Recorder()
        m, state = on(tmp_path, disk, sink), small_state()
        save_steps(m, state, [1, 2])  # training goes on: save returns, the copy fails in the background
        assert [(e["step"], e["ok"]) for e in sink.of("checkpoint")] == [(1, True), (2, False)]
        # The half copy was removed, not left to fill the disk, and no empty step directory stays behind.
        assert not (disk / snapshot_name(2)).exists()
        with pytest.raises(EnvironmentFailure) as failed:
            m.check_durable()
        line = str(failed.value)
        assert "the last 1 checkpoint(s) (step 2) were not written durably" in line and "\n" not in line
        assert "No space left on device" in line and "the last durable checkpoint is step 1" in line
        assert f"free on {disk})" in line   # how far from enough the disk is (issue 37)
        ram_copy = tmp_path / "ram" / "n0" / snapshot_name(2)
        assert f"kept in RAM at {ram_copy}" in line

        # Space comes back: the next checkpoint is durable, the end of the run only warns.
        _resize(disk, size * 4)
        save_steps(m, state, [3])
        with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
            m.check_durable()
        assert any("step(s) 2 did not reach ckpt.path" in r.getMessage() for r in caplog.records)
        m.close()
    assert not (tmp_path / "ram" / "n0").exists()  # nothing in RAM is the only copy of anything now


def test_the_only_copy_stays_in_ram_when_the_run_ends_with_a_full_disk(tmp_path):
    size = _part_bytes(tmp_path) * 3 // 2
    with tmpfs(tmp_path / "small", size) as disk:
        m = on(tmp_path, disk)
        save_steps(m, small_state(), [1, 2])
        m.close()
    node = tmp_path / "ram" / "n0"
    assert sorted(os.listdir(node)) == [snapshot_name(2)]  # its owner file is gone: no sweep removes it
    assert os.listdir(node / snapshot_name(2)) == ["rank-0"]


def test_ram_copies_are_removed_when_the_run_ends(tmp_path):
    m = manager(tmp_path)
    save_steps(m, small_state(), [1, 2])
    node = tmp_path / "ram" / "n0"
    assert sorted(os.listdir(node)) == [f"{OWNER_PREFIX}{os.getpid()}", snapshot_name(2)]
    m.close()
    assert not node.exists()
    assert sorted(os.listdir(tmp_path / "disk")) == [snapshot_name(1), snapshot_name(2)]  # durable ones stay


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_ram_copies_of_dead_runs_are_removed_at_start_and_live_ones_kept(tmp_path, caplog):
    ram = tmp_path / "ram"
    dead, reused, mine, unowned, other_host, live_dead = (
        ram / "dead-node", ram / "pid-reused", ram / "live-run", ram / "no-owner", ram / "remote-host",
        ram / "live" / "dead-node")
    for d in (dead, reused, mine, unowned, other_host, live_dead):
        (d / snapshot_name(4) / "rank-0").mkdir(parents=True)
    host = os.uname().nodename
    (dead / f"{OWNER_PREFIX}1").write_text(json.dumps({"pid": _dead_pid(), "start": "1", "host": host}))
    # A pid that now belongs to another process (this one) whose start time differs: the owner is gone.
    (reused / f"{OWNER_PREFIX}2").write_text(json.dumps({"pid": os.getpid(), "start": "1", "host": host}))
    (live_dead / f"{OWNER_PREFIX}3").write_text(json.dumps({"pid": _dead_pid(), "start": "1", "host": host}))
    from zb.ckpt.durable.ramdir import claim

    claim(mine)  # a run that is still going
    (other_host / f"{OWNER_PREFIX}4").write_text(json.dumps({"pid": _dead_pid(), "start": "1", "host": "elsewhere"}))
    with caplog.at_level(logging.INFO, logger="zb.ckpt"):
        m = manager(tmp_path)
    assert not dead.exists() and not reused.exists() and not live_dead.exists()
    assert mine.exists() and unowned.exists() and other_host.exists()
    assert sum("removed" in r.getMessage() and "processes are gone" in r.getMessage() for r in caplog.records) == 3
    m.close()


def test_without_ckpt_path_the_ram_copies_are_the_checkpoints_and_stay(tmp_path):
    cfg = CkptConfig(interval=1, path=None, ram_dir=str(tmp_path / "ram"), live_recovery=True)
    m = CheckpointManager(cfg, uid="n0", local_rank=0, local_world_size=1, sink=Recorder(), retry_delay=0.01)
    save_steps(m, small_state(), [1])
    m.close()
    assert os.listdir(tmp_path / "ram" / "n0") == [snapshot_name(1)]  # no owner file: no sweep takes it
    cfg.resume = "latest"
    again = CheckpointManager(cfg, uid="n0", local_rank=0, local_world_size=1, sink=Recorder())
    assert again.resume(small_state(seed=1)).position.step == 1
    again.close()
