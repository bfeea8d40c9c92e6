"""Checkpoints of DiLoCo-SWARM stage workers (zb.swarm.checkpoints): a whole run killed and restarted
resumes one step on every stage and then trains exactly as the uninterrupted run does; a later stage
that lost its only worker continues from that worker's checkpoint (soak); the pieces underneath."""

from __future__ import annotations

import re
import signal
import threading
import time
from datetime import timedelta

import pytest
from conftest import SWARM

from zb.ckpt.durable.layout import complete_steps
from zb.testing.cluster import TrainCluster

RUN = ["--optim.total_steps", "200"]   # long enough that the kill lands mid-run


def _runs(cluster: TrainCluster, uid: str, event: str) -> list[list[dict]]:
    """The worker's events of `event`, one list per start (metrics files append across starts)."""
    from zb.metrics import read_metrics

    runs: list[list[dict]] = []
    for e in read_metrics(cluster.tmp / uid / "metrics.jsonl"):
        if e["event"] == "run_start":
            runs.append([])
        elif e["event"] == event and runs:
            runs[-1].append(e)
    return runs


def _start(cluster: TrainCluster, namespace: str, *, ckpt: bool, pinned: bool = True) -> None:
    for j in range(2):
        uid = f"{namespace}{j}"
        extra = ["--ckpt.path", str(cluster.tmp / "ckpt" / uid), "--ckpt.interval", "10", "--ckpt.resume", "latest"] \
            if ckpt else []
        stage = ["--swarm.stage", str(j)] if pinned else []
        cluster.start_train(uid, *SWARM, *stage, "--elastic.namespace", namespace, *RUN, *extra)


def test_whole_run_killed_and_restarted_resumes_one_step_and_trains_as_if_never_stopped(tmp_path):
    """Both stages SIGKILLed once their step-10 checkpoints are in; restarted unpinned against the same store
    (its records of the dead run still there), each takes its checkpoint's stage, both resume one step, and
    every step after it equals the uninterrupted run's."""
    cluster = TrainCluster(tmp_path, world_size=1)
    try:
        _start(cluster, "ref", ckpt=False)     # the uninterrupted run, beside the one to kill (own namespaces)
        _start(cluster, "ck", ckpt=True)
        cluster.wait_for("ck0", lambda: all(10 in complete_steps(tmp_path / "ckpt" / f"ck{j}") for j in (0, 1)),
                         "both stages' step-10 checkpoints", 200)
        for uid in ("ck0", "ck1"):
            cluster.procs[uid].send_signal(signal.SIGKILL)
            cluster.procs[uid].wait(10)
        assert cluster.metrics("ck0", "step")[-1]["step"] < 200, "the run ended before the kill: make it longer"
        for uid in ("ref0", "ref1"):
            assert cluster.finish(uid, 200) == 0, cluster.log(uid)
        expected = {e["step"]: e["loss"] for e in cluster.metrics("ref0", "step")}
        _start(cluster, "ck", ckpt=True, pinned=False)
        for uid in ("ck0", "ck1"):
            assert cluster.finish(uid, 200) == 0, cluster.log(uid)
        steps = set()
        for j in (0, 1):
            log = (tmp_path / f"ck{j}.log").read_text()
            assert f"stage {j}: the stage of the checkpoint" in log, log[-3000:]
            steps |= set(re.findall(rf"stage {j} resumed from \S+ at step (\d+)", log))
        assert len(steps) == 1 and int(steps.pop()) >= 10, steps    # one step for both stages
        resumed = _runs(cluster, "ck0", "step")[-1]
        assert [e["step"] for e in resumed] == list(range(resumed[0]["step"], 201)) and resumed[0]["step"] <= 200
        for e in resumed:
            assert abs(e["loss"] - expected[e["step"]]) <= 1e-6 * abs(expected[e["step"]]), (e, expected)
        # The final checkpoint of every stage is at the run's last step.
        assert all(complete_steps(tmp_path / "ckpt" / f"ck{j}")[-1] == 200 for j in (0, 1))
        # Bad input: a worker pinned to another stage than its checkpoint's is refused with one line, exit 2.
        cluster.start_train("ck0", *SWARM, "--swarm.stage", "1", "--elastic.namespace", "other", *RUN, "--ckpt.path",
                            str(tmp_path / "ckpt" / "ck0"), "--ckpt.resume", "latest")
        assert cluster.finish("ck0", 120) == 2
        log = (tmp_path / "ck0.log").read_text()
        assert "holds stage 0, but this worker runs stage 1 (swarm.stage)" in log and "Traceback" not in log
    finally:
        cluster.close()


@pytest.mark.soak  # several process starts and a heartbeat timeout: about a minute on 2 busy cores
def test_a_later_stage_that_lost_its_only_worker_continues_from_its_checkpoint(tmp_path):
    cluster = TrainCluster(tmp_path, world_size=1)
    run = ["--optim.total_steps", "60", "--ckpt.interval", "10", "--ckpt.resume", "latest"]
    try:
        for j in range(2):
            cluster.start_train(f"s{j}", *SWARM, "--swarm.stage", str(j), *run, "--swarm.stage_wait", "120",
                                "--ckpt.path", str(tmp_path / "ckpt" / f"s{j}"))
        cluster.wait_for("s1", lambda: 10 in complete_steps(tmp_path / "ckpt" / "s1"), "the step-10 checkpoint", 200)
        cluster.procs["s1"].send_signal(signal.SIGKILL)
        cluster.procs["s1"].wait(10)
        killed_at = len(cluster.metrics("s0", "step"))
        cluster.start_train("s1", *SWARM, "--swarm.stage", "1", *run, "--swarm.stage_wait", "120",
                            "--ckpt.path", str(tmp_path / "ckpt" / "s1"))
        for uid in ("s0", "s1"):
            assert cluster.finish(uid, 300) == 0, cluster.log(uid)
        log = (tmp_path / "s1.log").read_text()
        assert "continues it from its checkpoint of step" in log and "afresh" not in log, cluster.log("s1")
        losses = [e["loss"] for e in cluster.metrics("s0", "step")]
        assert [e["step"] for e in cluster.metrics("s0", "step")] == list(range(1, 61))
        # Stage 1 came back with what it had learned by its checkpoint, not with its initial weights: the loss
        # after the restart stays well below the loss of step 1.
        assert max(losses[killed_at + 1:]) < losses[0] - 0.5, (losses[0], losses[killed_at:])
    finally:
        cluster.close()


def test_first_stage_training_tells_a_live_run_from_records_of_a_dead_or_restarting_one():
    import torch.distributed as dist

    from zb.swarm import registry

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    link = registry.StoreLink(lambda: store)
    assert not registry.first_stage_training(link, 1.0)             # nobody registered: a fresh run
    dead = registry.Worker("dead", "-", 0, "t0")
    registry.register(store, 0, dead)
    store.add(registry.heartbeat_keys(0, ["dead"])[0], 12)
    t0 = time.monotonic()
    assert not registry.first_stage_training(link, 1.0)             # registered, but its heartbeat never moves
    assert time.monotonic() - t0 >= 1.0
    # The same worker restarting (a new process under its id announced itself): known at once.
    registry.announce_start(store, 0, "dead", "t9")
    t0 = time.monotonic()
    assert not registry.first_stage_training(link, 30.0) and time.monotonic() - t0 < 5
    live = registry.Worker("live", "-", 0, "t1")
    registry.register(store, 0, live)
    stop = threading.Event()
    beat = registry.heartbeat_keys(0, ["live"])[0]
    thread = threading.Thread(target=lambda: [store.add(beat, 1) for _ in range(10**6) if not stop.wait(0.1)])
    thread.start()
    try:
        assert registry.first_stage_training(link, 5.0)
    finally:
        stop.set()
        thread.join()
    assert len(registry.registrations(store, 0)) == 2      # the resume epoch counts registrations, left or not
