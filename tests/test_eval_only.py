"""zb train --eval.only: evaluate a checkpoint and exit (issue 30): the held-out loss equals the one the
training run logged at that step, nothing is written, and a DiLoCo config contacts no store."""

from __future__ import annotations

from zb.metrics import read_metrics
from zb.testing.procs import TINY, free_port, zb_process


def _snapshot(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_eval_only_reproduces_the_runs_held_out_loss_and_writes_nothing(tmp_path):
    ckpt = ["--ckpt.path", str(tmp_path / "ck"), "--ckpt.ram_dir", str(tmp_path / "ram")]
    diloco = ["@configs/debug/diloco.toml", *TINY, "--diloco.inner_steps", "3", "--eval.batches", "3"]
    # One DiLoCo node hosting its own store.
    trained = zb_process("train", *diloco, *ckpt, "--ckpt.interval", "3", "--optim.total_steps", "6",
                         "--eval.interval", "0", "--elastic.host_store", "--log.dir", str(tmp_path / "run"),
                         GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(free_port()), GLOBAL_WORLD_SIZE="1")
    assert trained.returncode == 0, trained.stderr
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl", "eval")[-1]
    before = _snapshot(tmp_path / "ck")
    # A DiLoCo config: nothing listens at its store, and none is needed.
    proc = zb_process("train", *diloco, *ckpt, "--eval.only", "--ckpt.resume", "latest", "--log.dir",
                      str(tmp_path / "eval"), GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(free_port()),
                      GLOBAL_WORLD_SIZE="2")
    assert proc.returncode == 0, proc.stderr
    (event,) = read_metrics(tmp_path / "eval" / "metrics.jsonl", "eval")
    assert event["step"] == logged["step"] == 6 and event["loss"] == logged["loss"]
    assert "eval.only: checkpoint" in proc.stderr and "held-out loss" in proc.stderr
    assert _snapshot(tmp_path / "ck") == before
    assert not read_metrics(tmp_path / "eval" / "metrics.jsonl", "step")


def test_eval_only_needs_a_checkpoint(tmp_path):
    proc = zb_process("train", *TINY, "--eval.only")
    assert proc.returncode == 2 and "eval.only = true (from flag --eval.only): evaluates a checkpoint" in proc.stderr
    proc = zb_process("train", *TINY, "--eval.only", "--ckpt.resume", "latest", "--ckpt.path", str(tmp_path / "none"))
    assert proc.returncode == 2 and "found no complete checkpoint" in proc.stderr, proc.stderr


def _checkpoint(meta: dict):
    from zb.position import RunPosition
    from zb.train.eval_only import Checkpoint

    return Checkpoint("ck/step-000000006", RunPosition(6, 2), meta)


def test_eval_only_takes_the_data_slot_its_checkpoint_records_unless_given(caplog):
    """Issue 37: eval.only evaluated data slot 0 of 1 whatever node wrote the checkpoint (a DiLoCo node of slot 1
    of 2 got another loss than it logged); the manifest now records the slot, and flags still win."""
    from zb.config import load_config
    from zb.train.eval_only import data_slot

    recorded = _checkpoint({"data_slot": {"rank": 1, "world_size": 2}, "config": {"diloco": {"inner_steps": 3}}})
    assert data_slot(load_config([], {}, environ={}), recorded) == (1, 2)
    assert data_slot(load_config([], {"data.data_rank": 0}, environ={}), recorded) == (0, 2)
    plain = _checkpoint({"config": {"data": {"data_rank": 3, "data_world_size": 4}}})   # older, without DiLoCo
    assert data_slot(load_config([], {}, environ={}), plain) == (3, 4) and not caplog.records
    older = _checkpoint({"config": {"diloco": {"inner_steps": 3}, "data": {}}})        # older, of a DiLoCo node
    assert data_slot(load_config([], {}, environ={}), older) == (0, 1)
    assert [r.getMessage() for r in caplog.records if "records no data slot" in r.getMessage()] != []
    caplog.clear()
    assert data_slot(load_config([], {"data.data_rank": 1, "data.data_world_size": 2}, environ={}), older) == (1, 2)
    assert not caplog.records
