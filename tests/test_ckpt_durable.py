"""Durable checkpoints: bit-exact resume in a new process (1 rank and FSDP2 x 2), crashes mid-copy,
corruption, config mismatch, topk pruning, remote copies, multi-node agreement on the step."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_states import Recorder, manager, save_steps, small_state

from zb.ckpt.durable.agree import agree_on_latest, newest_common_step, parse_publications
from zb.ckpt.durable.layout import complete_steps
from zb.ckpt.durable.manager import CheckpointManager, TrainState
from zb.ckpt.format.catalog import verify_snapshot
from zb.ckpt.format.manifest import snapshot_name
from zb.config_schema import CkptConfig
from zb.errors import InvalidInput
from zb.position import RunPosition
from zb.testing.procs import free_port, subprocess_env

DRIVER = str(Path(__file__).parent / "drivers" / "ckpt_resume.py")
TIMEOUT = 150


def run_driver(args: list[str], ranks: int, port: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, DRIVER, *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
        str(port), DRIVER, *args]
    env = {**subprocess_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)


def outputs(proc: subprocess.CompletedProcess, out: Path, mode: str, rc: int = 0) -> dict[int, dict]:
    assert proc.returncode == rc, proc.stderr[-3000:]
    docs = [json.loads(p.read_text()) for p in out.glob(f"out-{mode}-*.json")]
    return {d["rank"]: d for d in docs}


@pytest.mark.parametrize("ranks", [1, 2])
def test_resume_is_bit_exact_in_a_new_process(tmp_path, ranks):
    """With one rank the first process also dies in the middle of copying a later checkpoint to disk:
    complete only in RAM, that one is copied to disk at the next start and resumed from."""
    port, steps = free_port(), 3 if ranks == 1 else 2
    first = run_driver(["first", str(tmp_path), str(steps)] + (["die"] if ranks == 1 else []), ranks, port)
    if ranks == 1:
        check_killed_mid_copy(first, tmp_path / "disk", steps)
    straight = outputs(first, tmp_path, "first", rc=9 if ranks == 1 else 0)
    resumed = outputs(run_driver(["resume", str(tmp_path), str(steps)], ranks, port), tmp_path, "resume")
    assert set(straight) == set(resumed) == set(range(ranks))
    start = 2 * steps if ranks == 1 else steps     # the RAM-only step 2 x STEPS, or the checkpoint at STEPS
    if ranks == 1:
        assert complete_steps(tmp_path / "disk") == [steps, 2 * steps]
    for rank in range(ranks):
        assert resumed[rank]["step"] == straight[rank]["step"] == 2 * steps
        assert resumed[rank]["losses"] == straight[rank]["losses"][start:]  # exact floats, not approx
        assert resumed[rank]["params"] == straight[rank]["params"]


def check_killed_mid_copy(proc: subprocess.CompletedProcess, disk: Path, steps: int) -> None:
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert complete_steps(disk) == [steps]
    half = disk / snapshot_name(2 * steps)
    assert (half / ".tmp-rank-0").is_dir() and not (half / "rank-0").exists()
    verify_snapshot(disk / snapshot_name(steps) / "rank-0")  # checksums of the survivor still hold


# -- in-process tests on a small model ------------------------------------------------------------


def test_resume_restores_state_in_place(tmp_path):
    sink = Recorder()
    m = manager(tmp_path, sink)
    state = small_state()
    save_steps(m, state, [2])
    event = sink.of("checkpoint")[0]
    assert event["ok"] and event["bytes"] > 0 and event["blocking_s"] < event["background_s"]
    m.close()
    fresh = small_state(seed=1)
    got = manager(tmp_path, resume="latest").resume(fresh)
    assert got.position.step == 2 and got.data_state == {"kind": "fake", "batch": 2}
    for a, b in zip(state.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
        sa, sb = state.optimizer.state[a], fresh.optimizer.state[b]
        assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert fresh.scheduler.last_epoch == state.scheduler.last_epoch
    assert fresh.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]


def test_failure_mid_copy_is_not_listed_and_previous_survives(tmp_path, monkeypatch):
    import zb.ckpt.durable.copies as durable

    m, state = manager(tmp_path, topk=1), small_state()
    save_steps(m, state, [1])
    real = durable.copy_file
    calls = []

    def fail_second_file(src, dst):
        calls.append(src)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(durable, "copy_file", fail_second_file)
    save_steps(m, state, [2])
    assert m.committed_steps() == [1]  # the half copy is not listed and topk=1 did not prune step 1
    m.close()


def test_corrupted_latest_is_skipped_and_explicit_bad_path_refused(tmp_path, caplog):
    m, state = manager(tmp_path), small_state()
    save_steps(m, state, [1, 2])
    m.close()
    bad = tmp_path / "disk" / snapshot_name(2) / "rank-0" / "model.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        got = manager(tmp_path, resume="latest").resume(small_state(seed=1))
    assert got.position.step == 1
    assert any("sha256" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidInput, match="sha256"):
        manager(tmp_path, resume=str(bad.parent.parent)).resume(small_state(seed=1))
    # A path that is not there says so (it said "not a committed snapshot": issue 30, minor).
    with pytest.raises(InvalidInput, match="step-000000009'?: no such file or directory; give latest"):
        manager(tmp_path, resume=str(tmp_path / "disk" / snapshot_name(9))).resume(small_state(seed=1))


def test_config_mismatch_names_the_keys(tmp_path):
    m = manager(tmp_path)
    save_steps(m, small_state(), [1])
    m.close()
    other = small_state()
    other.fingerprint = {"model.dim": 128, "local_world_size": 1}
    with pytest.raises(InvalidInput, match=r"model\.dim \(checkpoint: 64, this node: 128\)"):
        manager(tmp_path, resume="latest").resume(other)
    wider = small_state(width=32)
    wider.fingerprint = {"model.dim": 64, "local_world_size": 1}
    with pytest.raises(InvalidInput, match="expected"):
        manager(tmp_path, resume="latest").resume(wider)


def test_topk_prunes_only_older_than_committed(tmp_path):
    m, state = manager(tmp_path, topk=2), small_state()
    save_steps(m, state, [1, 2, 3, 4])
    assert m.committed_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == [snapshot_name(3), snapshot_name(4)]
    assert [p.name for p in (tmp_path / "ram" / "n0").glob("step-*")] == [snapshot_name(4)]  # newest only
    m.close()


def test_final_checkpoint_goes_straight_to_disk_and_warns_on_inexact_data(tmp_path, caplog):
    m, state = manager(tmp_path), small_state()
    state.data_exact = False
    state.position = RunPosition(step=7)
    m.save(7, state, final=True)
    assert m.wait(30)
    m.close()
    assert m.committed_steps() == [7] and not (tmp_path / "ram" / "n0").exists()  # no RAM copy was made
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        manager(tmp_path, resume="latest").resume(small_state(seed=1))
    assert any("cannot resume exactly" in r.getMessage() for r in caplog.records)


def test_remote_copy_and_failing_remote(tmp_path, caplog):
    sink = Recorder()
    m = manager(tmp_path, sink, remote=str(tmp_path / "remote"))
    save_steps(m, small_state(), [1])
    m.close()
    part = tmp_path / "remote" / "n0" / snapshot_name(1) / "rank-0"
    assert (part / "COMMITTED").is_file() and (part / "model.safetensors").is_file()
    assert sink.of("upload")[0]["ok"] is True and sink.of("upload")[0]["bytes"] > 0
    (tmp_path / "blocker").write_text("a file where the remote directory should be")
    sink = Recorder()
    m = manager(tmp_path, sink, remote=str(tmp_path / "blocker" / "remote"))
    state = small_state()
    save_steps(m, state, [2, 3])  # training goes on: save returns, copies finish
    assert [u["ok"] for u in sink.of("upload")] == [False, False]
    assert sum("failed (attempt" in r.getMessage() and "upload" in r.getMessage() for r in caplog.records) == 6
    assert m.committed_steps()[-2:] == [2, 3]
    m.close()


def _same_params(a: TrainState, b: TrainState) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_resume_from_the_remote_copy_when_the_disk_is_gone(tmp_path, caplog):
    """A replaced spot instance has only the remote copy: `latest` finds it, downloads this rank's
    part (verified), commits it locally and resumes; a cut or damaged upload is skipped."""
    import shutil

    remote = tmp_path / "remote"
    state = small_state()
    m = manager(tmp_path, remote=str(remote))
    save_steps(m, state, [1, 2])
    m.close()
    shutil.rmtree(tmp_path / "disk")
    shutil.rmtree(tmp_path / "ram")

    m = manager(tmp_path, remote=str(remote), resume="latest")
    assert m.committed_steps() == [1, 2]
    fresh = small_state(seed=1)
    assert m.resume(fresh).position.step == 2 and _same_params(state, fresh)
    assert complete_steps(tmp_path / "disk") == [2]
    verify_snapshot(tmp_path / "disk" / snapshot_name(2) / "rank-0")

    # A damaged local copy is replaced by the remote one.
    bad = tmp_path / "disk" / snapshot_name(2) / "rank-0" / "optim.safetensors"
    bad.write_bytes(bytes(b ^ 0xFF for b in bad.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        assert manager(tmp_path, remote=str(remote), resume="latest").resume(small_state(seed=1)).position.step == 2
    assert any("using the remote copy" in r.getMessage() for r in caplog.records)

    # Remote only again, with a damaged newest upload: the older one is used, with a warning.
    shutil.rmtree(tmp_path / "disk")
    part = remote / "n0" / snapshot_name(2) / "rank-0" / "model.safetensors"
    part.write_bytes(bytes(b ^ 0xFF for b in part.read_bytes()))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        assert manager(tmp_path, remote=str(remote), resume="latest").resume(small_state(seed=1)).position.step == 1
    assert any("skipping checkpoint step 2" in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "disk" / snapshot_name(2) / "rank-0").exists()  # nothing half-downloaded looks committed

    # An upload cut before its marker is not a checkpoint at all.
    (remote / "n0" / snapshot_name(2) / "rank-0" / "COMMITTED").unlink()
    assert manager(tmp_path, remote=str(remote)).committed_steps() == [1]


def test_resume_from_a_named_remote_step(tmp_path):
    remote = tmp_path / "remote"
    state = small_state()
    m = manager(tmp_path, remote=str(remote))
    save_steps(m, state, [3])
    m.close()
    url = f"file://{remote}/n0/{snapshot_name(3)}"
    fresh = small_state(seed=1)
    assert manager(tmp_path / "elsewhere", resume=url).resume(fresh).position.step == 3
    assert _same_params(state, fresh)
    with pytest.raises(InvalidInput, match="must name its step directory"):
        manager(tmp_path / "x", resume=f"file://{remote}/n0").resume(small_state())
    with pytest.raises(InvalidInput, match="not a committed part"):
        manager(tmp_path / "y", resume=f"file://{remote}/n0/{snapshot_name(9)}").resume(small_state())
    with pytest.raises(InvalidInput, match="ckpt.remote.path 'nope://b/run': .*nope"):
        manager(tmp_path / "z", remote="nope://b/run")  # at start, not at the first upload hours later


def test_incomplete_multi_rank_checkpoint_is_not_listed(tmp_path):
    m = CheckpointManager(CkptConfig(interval=1, path=str(tmp_path / "disk"), ram_dir=str(tmp_path / "ram")),
                          uid="n0", local_rank=0, local_world_size=2, sink=Recorder())
    save_steps(m, small_state(), [5])
    assert m.committed_steps() == []  # rank-1's part is missing
    m.close()


def test_newest_common_step():
    assert newest_common_step({"a": [2, 4, 6], "b": [2, 4], "c": [4, 8]}) == 4
    assert newest_common_step({"a": [2], "b": [4]}) is None
    assert newest_common_step({}) is None
    assert parse_publications(b'{"uid":"a","steps":[1,2]}\nnot json\n{"uid":"a","steps":[3]}\n') == {"a": [3]}


def test_agree_on_latest_through_the_store():
    import threading

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    results = {}
    steps = {"a": [10, 20, 30], "b": [10, 20], "c": [20, 30]}
    threads = [threading.Thread(target=lambda u=u: results.__setitem__(u, agree_on_latest(store, u, steps[u], 3, 20, "v1")))
               for u in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {"a": 20, "b": 20, "c": 20}
    assert agree_on_latest(store, "late", [30], 3, 1, "v1") is None  # decided already; it lacks step 20
    # The next start of the run against the same store agrees anew: the old decision is not its own.
    assert agree_on_latest(store, "a", [10, 20, 30, 40], 1, 5, "v2") == 40


def test_benchmark_smoke():
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_checkpoint import main

    res = main(["--model", "debug", "--dim", "64", "--repeats", "1", "--steps", "1", "--interval", "10", "--json"])
    assert res["sync_s"] > 0 and res["blocking_s"] > 0 and res["state_bytes"] > 0


def test_queued_checkpoint_keeps_its_staging_buffers(tmp_path, monkeypatch):
    """Saves in a row while the first is still copying: each checkpoint holds its own step's weights."""
    import threading

    import zb.ckpt.durable.worker as worker

    gate, real = threading.Event(), worker.copy_part
    monkeypatch.setattr(worker, "copy_part", lambda *a: (gate.wait(30), real(*a))[1])
    m, state = manager(tmp_path, topk=5), small_state()
    for step in (1, 2, 3):
        with torch.no_grad():
            state.model[0].weight.fill_(float(step))
        state.position = RunPosition(step=step)
        if step == 3:
            threading.Timer(0.5, gate.set).start()  # save 3 must wait for step 2's RAM write, not step 1's end
        m.save(step, state)
    assert m.wait(30)
    m.close()
    for step in (1, 2, 3):
        fresh = small_state(seed=9)
        manager(tmp_path, resume=str(tmp_path / "disk" / snapshot_name(step))).resume(fresh)
        assert float(fresh.model[0].weight.detach()[0, 0]) == step


def test_by_default_the_newest_three_are_kept_and_topk_0_keeps_every_one(tmp_path):
    """ckpt.topk kept every checkpoint by default, filling the disk (issue 30, minor)."""
    m, state = manager(tmp_path / "a"), small_state()
    save_steps(m, state, [1, 2, 3, 4, 5])
    assert m.committed_steps() == [3, 4, 5]
    m.close()
    m, state = manager(tmp_path / "b", topk=0), small_state()
    save_steps(m, state, [1, 2, 3, 4, 5])
    assert m.committed_steps() == [1, 2, 3, 4, 5]
    m.close()
