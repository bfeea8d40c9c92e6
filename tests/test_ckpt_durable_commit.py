"""Committing a checkpoint part leaves a complete checkpoint at every instant: a kill at any point
of a re-commit of the same step (with an atomic swap, and with the move-aside fallback of file
systems that cannot swap) is followed by a resume from a complete copy; leftovers of a crash are
tidied at start; a final checkpoint does not rewrite the step the interval already saved."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from ckpt_states import Recorder, manager, save_steps, small_state

import zb.ckpt.format.catalog as catalog
from zb.ckpt.durable.layout import complete_steps
from zb.ckpt.format.manifest import snapshot_name
from zb.ckpt.format.snapshot import load_snapshot, write_snapshot
from zb.position import RunPosition


class Killed(BaseException):
    """The process died here (BaseException: no `except Exception` on the way may swallow it)."""


def _part(tmp_path, seed: int, step: int):
    """The tensors and meta of a part as the manager writes it, from a scratch directory."""
    m = manager(tmp_path / f"scratch-{seed}")
    state = small_state(seed=seed)
    save_steps(m, state, [step])
    m.close()
    return load_snapshot(tmp_path / f"scratch-{seed}" / "disk" / snapshot_name(step) / "rank-0")


def _first_weight(tensors) -> torch.Tensor:
    return tensors["model.safetensors"]["0.weight"]


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "move-aside"])
def test_a_kill_at_any_point_of_a_recommit_leaves_a_complete_checkpoint(tmp_path, monkeypatch, swap):
    """The old commit moved the good copy aside, then renamed the new one in: killed in between,
    only `.del-` and `.tmp-` directories were left and, with topk 1, a resume started from scratch."""
    old, meta = _part(tmp_path, seed=0, step=3)
    new, _ = _part(tmp_path, seed=1, step=3)
    candidates = [_first_weight(old), _first_weight(new)]
    points, leftovers, k = [], [], 0
    while True:
        k += 1
        root = tmp_path / f"kill-{k}" / "disk"
        write_snapshot(root / snapshot_name(3), old, meta, 3, name="rank-0")
        with monkeypatch.context() as patch:
            calls = []

            def op(name, real, calls=calls, k=k):
                def wrapped(*args, **kwargs):
                    calls.append(name)
                    if len(calls) == k:
                        raise Killed(name)
                    return real(*args, **kwargs)
                return wrapped

            if not swap:
                patch.setattr(catalog, "_renameat2", lambda: None)  # a file system that cannot swap
            for name in ("write_durable", "fsync_path", "exchange", "_move_aside"):
                if hasattr(catalog, name):
                    patch.setattr(catalog, name, op(name, getattr(catalog, name)))
            patch.setattr(os, "rename", op("rename", os.rename))
            patch.setattr(shutil, "rmtree", op("rmtree", shutil.rmtree))
            try:
                write_snapshot(root / snapshot_name(3), new, meta, 3, name="rank-0")
                done = True
            except Killed as e:
                points.append(str(e))
                done = False
        # The process restarts: its manager tidies the leftovers, `latest` finds a complete step 3.
        restarted = manager(root.parent, resume="latest", topk=1)
        assert complete_steps(root) == [3], (k, points)
        leftovers += [(k, n) for n in os.listdir(root / snapshot_name(3)) if n != "rank-0"]
        fresh = small_state(seed=2)
        assert restarted.resume(fresh).position.step == 3, (k, points)
        got = fresh.model[0].weight.detach()
        assert any(torch.equal(got, c) for c in candidates), k  # all of one copy, never a mix
        restarted.close()
        if done:
            assert torch.equal(got, candidates[1])
            break
    assert len(points) >= 4, points  # every step of the commit was a kill point
    assert not leftovers  # tidied at start


def test_leftovers_of_a_crash_are_tidied_at_start_with_a_log_line(tmp_path, caplog):
    m, state = manager(tmp_path), small_state()
    save_steps(m, state, [1, 2])
    m.close()
    disk = tmp_path / "disk"
    shutil.copytree(disk / snapshot_name(2) / "rank-0", disk / snapshot_name(2) / ".del-rank-0-0123abcd")
    shutil.copytree(disk / snapshot_name(2) / "rank-0", disk / snapshot_name(2) / ".tmp-rank-0")
    (disk / snapshot_name(3) / ".tmp-rank-0").mkdir(parents=True)  # killed while copying step 3
    # A part replaced on a file system that cannot swap, killed before the new copy arrived:
    os.rename(disk / snapshot_name(1) / "rank-0", disk / snapshot_name(1) / ".old-rank-0-89abcdef")
    (disk / snapshot_name(2) / ".tmp-rank-1").mkdir()  # another local rank's: not ours to touch
    with caplog.at_level(logging.INFO, logger="zb.ckpt"):
        m = manager(tmp_path, resume="latest")
    assert sorted(os.listdir(disk)) == [snapshot_name(1), snapshot_name(2)]
    assert os.listdir(disk / snapshot_name(1)) == ["rank-0"]
    assert sorted(os.listdir(disk / snapshot_name(2))) == [".tmp-rank-1", "rank-0"]
    lines = [r.getMessage() for r in caplog.records if "checkpoint leftovers" in r.getMessage()]
    assert len(lines) == 5 and any("restored" in line for line in lines), lines
    assert complete_steps(disk) == [1, 2]
    m.close()


def test_the_final_checkpoint_does_not_rewrite_the_step_the_interval_saved(tmp_path, monkeypatch):
    import zb.ckpt.durable.worker as worker

    writes = []
    real_write, real_copy = worker.write_snapshot, worker.copy_part
    monkeypatch.setattr(worker, "write_snapshot",
                        lambda root, *a, **k: (writes.append(root), real_write(root, *a, **k))[1])
    monkeypatch.setattr(worker, "copy_part", lambda src, dst: (writes.append(dst), real_copy(src, dst))[1])
    sink = Recorder()
    m, state = manager(tmp_path, sink, remote=str(tmp_path / "remote"), topk=1), small_state()
    m.cfg.remote.interval = 8  # step 4 is not uploaded at the interval: the final save makes up for it
    m._worker.t.remote_interval = 8
    state.position = RunPosition(step=4)
    m.save(4, state)
    part = tmp_path / "disk" / snapshot_name(4) / "rank-0"
    assert m.wait(30)
    inode = part.stat().st_ino
    m.save(4, state, final=True)
    assert m.wait(30)
    m.close()
    disk_writes = [w for w in writes if str(w).startswith(str(tmp_path / "disk"))]
    assert len(disk_writes) == 1, writes  # once, at the interval
    assert part.stat().st_ino == inode  # the committed copy was never replaced
    assert [e["step"] for e in sink.of("checkpoint")] == [4]
    assert [(u["step"], u["ok"]) for u in sink.of("upload")] == [(4, True)]
