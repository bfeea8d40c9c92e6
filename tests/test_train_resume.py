"""`zb train` with checkpoints, end to end: 10 + resume + 10 steps equals 20 straight (bit for bit),
and SIGTERM (spot preemption) leaves a final checkpoint that a restart resumes from."""

from __future__ import annotations

import shutil
import signal

import pytest

from zb.metrics import read_metrics
from zb.testing.procs import zb_train, zb_train_until_sigterm


def _losses(path) -> list[float]:
    return [e["loss"] for e in read_metrics(path, "step")]


@pytest.mark.parametrize("machine", ["same", "replaced"])
def test_resume_continues_bit_for_bit(tmp_path, machine):
    """"replaced": the restart runs on a new machine (disk and RAM gone) from the remote copy."""
    straight = zb_train(tmp_path, "--optim.total_steps", "16", "--log.dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    ck = ["--ckpt.path", str(tmp_path / "ck"), "--optim.total_steps", "16", "--log.dir", str(tmp_path / "b")]
    if machine == "replaced":
        ck += ["--ckpt.remote.path", str(tmp_path / "remote"), "--elastic.unique_id", "node-a"]
    first = zb_train(tmp_path, *ck, "--train.max_steps", "8")
    assert first.returncode == 0, first.stderr[-2000:]
    if machine == "replaced":
        assert (tmp_path / "remote" / "node-a" / "step-000000008" / "rank-0" / "COMMITTED").is_file()
        shutil.rmtree(tmp_path / "ck")
        shutil.rmtree(tmp_path / "ram", ignore_errors=True)
    second = zb_train(tmp_path, *ck, "--ckpt.resume", "latest")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stderr and "settings without effect" not in second.stderr
    assert ("downloaded to" in second.stderr) == (machine == "replaced")
    assert _losses(tmp_path / "b" / "metrics.jsonl") == _losses(tmp_path / "a" / "metrics.jsonl")
    if machine == "same":
        # Prime's ckpt.skip_dataloader: the state resumes, the data starts over (so the losses differ).
        step8 = tmp_path / "ck" / "step-000000008"
        skip = zb_train(tmp_path, "--optim.total_steps", "16", "--log.dir", str(tmp_path / "c"),
                        "--ckpt.resume", str(step8), "--ckpt.skip_dataloader")
        assert skip.returncode == 0, skip.stderr[-2000:]
        assert "resumed from" in skip.stderr and "data starts from the beginning" in skip.stderr
        skipped, straight_tail = _losses(tmp_path / "c" / "metrics.jsonl"), _losses(tmp_path / "a" / "metrics.jsonl")[8:]
        assert len(skipped) == len(straight_tail) == 8 and skipped != straight_tail


def test_sigterm_writes_a_final_checkpoint(tmp_path):
    code, err = zb_train_until_sigterm(tmp_path, "step", 3, "--ckpt.path", str(tmp_path / "ck"))
    assert code == 128 + signal.SIGTERM, err[-2000:]
    metrics = tmp_path / "log" / "metrics.jsonl"
    last = read_metrics(metrics, "step")[-1]["step"]
    assert (tmp_path / "ck" / f"step-{last:09d}").is_dir(), err[-2000:]
    resumed = zb_train(tmp_path, "--ckpt.path", str(tmp_path / "ck"), "--ckpt.resume", "latest", "--optim.total_steps",
                     str(last + 2), "--log.dir", str(tmp_path / "log2"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [e["step"] for e in read_metrics(tmp_path / "log2" / "metrics.jsonl", "step")] == [last + 1, last + 2]


def test_two_rank_final_checkpoint_after_eval_resumes_bit_for_bit(tmp_path):
    """The final checkpoint of a 2-rank run follows a no-grad eval forward, which leaves the last block
    (and the root) gathered: resuming `latest` from it must continue exactly like a straight run."""
    # Batches prefetched (on by default only on CUDA): the resume position must still be exact.
    two = ["--nproc-per-node", "2", "--optim.batch_size", "8", "--eval.interval", "5", "--eval.batches", "1",
           "--data.prefetch", "3"]
    straight = zb_train(tmp_path, *two, "--optim.total_steps", "12", "--log.dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    ck = [*two, "--ckpt.path", str(tmp_path / "ck"), "--ckpt.interval", "5", "--log.dir", str(tmp_path / "b")]
    # Steps 1-8: saves at step 5 (interval) and 8 (final, right after the final eval).
    first = zb_train(tmp_path, *ck, "--optim.total_steps", "12", "--train.max_steps", "8")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "eval step 8" in first.stderr
    second = zb_train(tmp_path, *ck, "--optim.total_steps", "12", "--ckpt.resume", "latest")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "at step 8" in second.stderr
    assert _losses(tmp_path / "b" / "metrics.jsonl") == _losses(tmp_path / "a" / "metrics.jsonl")
