"""A log.dir without room (issue 37): full at the start, `zb train` refuses in one line (exit 1, as a
full ckpt.path does); full during the run, training goes on to its end and its final checkpoint
(exit 0), metrics.jsonl keeps only whole lines, and the lack of room is said once, with the path and
the free space, and the count of dropped events once more at the end. TensorBoard and wandb writing
into the same directory fail quietly (one line each), never with a traceback.

Full disks are real: small tmpfs mounts (root; skipped where mount is not allowed). The cut-short
write is also faked (any user).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path

from ckpt_states import tmpfs

from zb.metrics import MetricsSink
from zb.testing.procs import zb_train

PAGE = 4096
CANNOT_WRITE = r"cannot write metrics to {} \(No space left on device; [\d.,]+ \w+ free\)"


def _leave_free(disk: Path, free: int) -> None:
    """Fill the tmpfs at `disk` but for `free` bytes."""
    filler = os.statvfs(disk)
    (disk / "filler").write_bytes(b"x" * (filler.f_bavail * filler.f_frsize - free))


def _whole_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n"), "the file ends inside a line"
    return [json.loads(line) for line in text.splitlines()]


def test_a_write_cut_short_is_taken_back_and_the_lack_of_room_said_once(tmp_path, monkeypatch, caplog):
    """A disk with room for half a line: the half is removed, the event dropped; later lines are
    written again as soon as they fit."""
    import zb.metrics

    real_write, calls = os.write, []

    def write(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 2:                  # the second event: half of it fits
            return real_write(fd, data[:len(data) // 2])
        if len(calls) in (3, 4):             # the rest of it, and the third event: no room at all
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(zb.metrics.os, "write", write)
    sink = MetricsSink(tmp_path, "n0")
    with caplog.at_level(logging.WARNING, logger="zb.metrics"):
        for step in range(1, 5):
            sink.log("step", step=step)
        sink.close()
    assert [r["step"] for r in _whole_lines(tmp_path / "metrics.jsonl")] == [1, 4]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert re.search(CANNOT_WRITE.format(re.escape(str(tmp_path / "metrics.jsonl"))), said[0]), said
    assert said[1].startswith("2 metrics event(s) were not written to"), said


def test_metrics_on_a_disk_that_fills_keep_whole_lines(tmp_path, caplog):
    with tmpfs(tmp_path / "logs", 64 * PAGE) as disk:
        _leave_free(disk, 2 * PAGE)
        sink = MetricsSink(disk, "n0")
        with caplog.at_level(logging.WARNING, logger="zb.metrics"):
            for step in range(200):   # ~20 kB of lines for 8 kB of room
                sink.log("step", step=step, loss=1.0, note="x" * 40)
            sink.close()
        kept = _whole_lines(disk / "metrics.jsonl")
    assert 0 < len(kept) < 200 and [r["step"] for r in kept] == list(range(len(kept)))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[1].startswith(f"{200 - len(kept)} metrics event(s) were not written"), said


def _train(tmp_path: Path, log_dir: Path, *args: str):
    return zb_train(tmp_path, "--optim.total_steps", "30", "--log.dir", str(log_dir), "--ckpt.path",
                    str(tmp_path / "ckpt"), "--ckpt.interval", "1000", *args)


def test_a_log_dir_that_fills_during_training_costs_metrics_not_the_run(tmp_path):
    with tmpfs(tmp_path / "logs", 64 * PAGE) as disk:
        _leave_free(disk, 2 * PAGE)
        proc = _train(tmp_path, disk / "run", "--log.backends", "jsonl,tensorboard")
        metrics = disk / "run" / "metrics.jsonl"
        kept = _whole_lines(metrics)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "step-000000030").is_dir(), "the final checkpoint"
    assert kept and kept[0]["event"] == "run_start"
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr[-3000:]
    assert len(re.findall(CANNOT_WRITE.format(re.escape(str(metrics))), proc.stderr)) == 1, proc.stderr[-3000:]
    assert len(re.findall(r"metrics event\(s\) were not written", proc.stderr)) == 1
    assert len(re.findall(r"metrics backend tensorboard failed", proc.stderr)) == 1


def test_wandb_in_a_log_dir_that_fills_says_so_once(tmp_path):
    with tmpfs(tmp_path / "logs", 64 * PAGE) as disk:
        _leave_free(disk, 2 * PAGE)
        proc = _train(tmp_path, disk / "run", "--log.backends", "jsonl,wandb", "--log.wandb_mode", "offline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "step-000000030").is_dir(), "the final checkpoint"
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr[-3000:]


def test_a_log_dir_full_at_the_start_is_refused_in_one_line(tmp_path):
    with tmpfs(tmp_path / "logs", 16 * PAGE) as disk:
        _leave_free(disk, 0)
        proc = _train(tmp_path, disk / "run")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: log.dir = '{re.escape(str(disk / 'run'))}' \(from flag --log.dir\): cannot hold the "
                        r"metrics: No space left on device \(0 bytes free\); free space there or point --log.dir at "
                        r"another disk", last), last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())

