"""`zb train` end to end: the end of a normal run does not save its last step twice and leaves
nothing in RAM; a disk that fills during the run makes it exit 1 with one line naming the last
durable checkpoint; a ckpt.path that can never work exits 2 at start."""

from __future__ import annotations

import subprocess

from ckpt_states import tmpfs

from zb.metrics import read_metrics
from zb.testing.procs import zb_train, zb_train_until_sigterm


def _train(tmp_path, log: str, *args: str) -> subprocess.CompletedProcess:
    return zb_train(tmp_path, "--log.dir", str(tmp_path / log), "--elastic.unique_id", "node-a", *args)


def _checkpoints(tmp_path, log: str) -> list[tuple[int, bool]]:
    return [(e["step"], e["ok"]) for e in read_metrics(tmp_path / log / "metrics.jsonl", "checkpoint")]


def test_run_end_saves_once_cleans_ram_and_reports_a_full_disk(tmp_path):
    ok = _train(tmp_path, "a", "--ckpt.path", str(tmp_path / "ck"), "--ckpt.interval", "4", "--optim.total_steps", "8")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert _checkpoints(tmp_path, "a") == [(4, True), (8, True)]  # the final save did not write step 8 again
    assert "step 8 is already committed" in ok.stderr
    assert [p for p in (tmp_path / "ram").rglob("*") if p.is_file()] == []  # nothing left in RAM

    part = max(e["bytes"] for e in read_metrics(tmp_path / "a" / "metrics.jsonl", "checkpoint"))
    with tmpfs(tmp_path / "small", (part + 8 * 4096) * 3 // 2) as disk:  # one checkpoint fits, two do not
        full = _train(tmp_path, "b", "--ckpt.path", str(disk), "--ckpt.interval", "4", "--optim.total_steps", "12")
        assert full.returncode == 1, full.stderr[-3000:]
        last = full.stderr.strip().splitlines()[-1]
        assert last.startswith("error: the last 2 checkpoint(s) (step 8, 12) were not written durably"), last
        assert "No space left on device" in last and "the last durable checkpoint is step 4" in last, last
        assert "Traceback" not in full.stderr
        assert _checkpoints(tmp_path, "b")[:3] == [(4, True), (8, False), (12, False)]
    assert sorted(p.name for p in (tmp_path / "ram" / "node-a").iterdir()) == ["step-000000012"]  # the only copy


def test_an_unusable_ckpt_path_exits_2_at_start(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    bad = _train(tmp_path, "c", "--ckpt.path", str(tmp_path / "file"), "--ckpt.interval", "4", "--optim.total_steps",
                 "8")
    assert bad.returncode == 2, bad.stderr[-2000:]
    lines = bad.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: ckpt.path '{tmp_path / 'file'}' cannot hold checkpoints"), lines[-1]
    assert "Traceback" not in bad.stderr and not (tmp_path / "file").is_dir()


def test_sigterm_leaves_nothing_in_ram(tmp_path):
    import signal

    code, err = zb_train_until_sigterm(tmp_path, "checkpoint", 2, "--ckpt.path", str(tmp_path / "ck"),
                                       "--ckpt.interval", "2")
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert [p for p in (tmp_path / "ram").rglob("*") if p.is_file()] == [], err[-2000:]
    assert any((tmp_path / "ck").glob("step-*/rank-0/COMMITTED"))
