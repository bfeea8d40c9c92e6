"""DiLoCo-SWARM runs as real `zb train` processes around a real `zb store`: equivalence with a plain run,
a 2 x 2 grid whose stage replicas agree, a killed worker, a joiner, and bad input. The joiner, the
stage left without workers and mismatched models within a stage are `soak` (run: pytest -m soak)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import SWARM

from zb.addresses import StoreAddress
from zb.status.reader import open_reader
from zb.swarm import registry
from zb.testing.cluster import TrainCluster
from zb.testing.procs import zb_process


def _losses(cluster: TrainCluster, uid: str) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in cluster.metrics(uid, "step")}


def _start_grid(cluster: TrainCluster, per_stage: int, *args: str, namespace: str = "", stages: int = 2) -> list[str]:
    uids = []
    for j in range(stages):
        for m in range(per_stage):
            uid = f"s{j}{'abc'[m]}"
            extra = ["--elastic.namespace", namespace] if namespace else []
            cluster.start_train(uid, *SWARM, "--swarm.stage", str(j), *args, *extra, "--swarm.stages", str(stages),
                                rank=m)
            uids.append(uid)
    return uids


def test_one_worker_per_stage_with_h1_equals_a_plain_run(tmp_path):
    """Pipelined over 3 stages (first, middle, last: every kind of hop; H=1, clipping off: a stage clips its own
    norm) = one process on the same data."""
    cluster = TrainCluster(tmp_path, world_size=1)
    run = ["--optim.total_steps", "5", "--diloco.inner_steps", "1", "--optim.grad_clip", "0", "--model.n_layers", "3"]
    try:
        uids = _start_grid(cluster, 1, *run, "--swarm.max_in_flight", "2", namespace="piped", stages=3)
        cluster.start_train("plain", *run, "--elastic.namespace", "plain")
        for uid in [*uids, "plain"]:
            assert cluster.finish(uid, 150) == 0, cluster.log(uid)
        piped, plain = _losses(cluster, "s0a"), _losses(cluster, "plain")
        assert sorted(piped) == sorted(plain) == [1, 2, 3, 4, 5]
        for step, loss in plain.items():
            assert abs(piped[step] - loss) / abs(loss) < 1e-5, (step, piped[step], loss)
    finally:
        cluster.close()


def test_unpinned_workers_are_spread_over_the_stages_by_the_store(tmp_path):
    cluster = TrainCluster(tmp_path, world_size=1)
    try:
        for i, uid in enumerate(("ua", "ub")):
            cluster.start_train(uid, *SWARM, "--optim.total_steps", "10", rank=i)
        for uid in ("ua", "ub"):
            assert cluster.finish(uid, 150) == 0, cluster.log(uid)
        chosen = sorted(e["stage"] for uid in ("ua", "ub") for e in cluster.metrics(uid, "swarm")[-1:])
        assert chosen == [0, 1]
    finally:
        cluster.close()


def _hashes_by_stage(cluster: TrainCluster, uids: list[str]) -> dict[int, dict[int, set[str]]]:
    out: dict[int, dict[int, set[str]]] = {}
    for uid in uids:
        for e in cluster.metrics(uid, "outer_step"):
            if e["applied"]:
                out.setdefault(e["stage"], {}).setdefault(e["outer_step"], set()).add(e["params_hash"])
    return out


def _check_owners_counted_each_micro_batch_once(cluster: TrainCluster, owners: list[str], steps: int) -> None:
    for uid in owners:
        events = cluster.metrics(uid, "step")
        assert [e["step"] for e in events] == list(range(1, steps + 1)), uid
        assert all(e["micro_batches"] == 2 for e in events), uid   # TINY: batch 4, micro_bs 2


# int4 (with error feedback) and sparse under soak: a stage's outer step is a DiLoCo node's, whatever the width
# (suite time)
@pytest.mark.parametrize("compression", ["none", pytest.param("int4", marks=pytest.mark.soak),
                                         pytest.param("sparse", marks=pytest.mark.soak)])
def test_two_stages_two_workers_replicas_agree_at_every_outer_step(tmp_path, compression):
    cluster = TrainCluster(tmp_path, world_size=2)
    try:
        uids = _start_grid(cluster, 2, "--optim.total_steps", "10", "--diloco.compression", compression)
        for uid in uids:
            assert cluster.finish(uid, 170) == 0, cluster.log(uid)
        hashes = _hashes_by_stage(cluster, uids)
        assert sorted(hashes) == [0, 1]
        for stage, by_step in hashes.items():
            assert sorted(by_step) == [1, 2], (stage, by_step)
            assert all(len(h) == 1 for h in by_step.values()), (stage, by_step)
        _check_owners_counted_each_micro_batch_once(cluster, ["s0a", "s0b"], 10)
        served = {uid: cluster.metrics(uid, "swarm")[-1]["backward"] for uid in ("s1a", "s1b")}
        assert sum(served.values()) == 2 * 2 * 10, served     # every micro-batch's backward exactly once
        # The weights of stage 1's average: the micro-batches each replica processed in the round, 2 x 2 x H in all.
        for k in (1, 2):
            weights = [e["round_micro_batches"] for u in ("s1a", "s1b") for e in cluster.metrics(u, "outer_step")
                       if e["outer_step"] == k]
            assert sum(weights) == 2 * 2 * 5, weights
        # Each stage's workers sealed its end in the stage's own namespace: a late worker of the stage would stop.
        for stage in (0, 1):
            reader = open_reader([StoreAddress("127.0.0.1", cluster.port)], 10.0,
                                 namespace=registry.stage_namespace("", stage))
            end = reader.read()["run"]["finished"]
            assert end is not None and (end["outer_step"], end["step"]) == (2, 10), (stage, end)
    finally:
        cluster.close()


def test_killed_worker_the_run_goes_on_and_no_micro_batch_is_lost(tmp_path):
    cluster = TrainCluster(tmp_path, world_size=2)
    try:
        _start_grid(cluster, 2, "--optim.total_steps", "40")
        cluster.wait_for("s0a", lambda: len(cluster.metrics("s0a", "step")) >= 8, "step 8", 150)
        cluster.procs["s1b"].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for uid in ("s0a", "s0b", "s1a"):
            assert cluster.finish(uid, 170) == 0, cluster.log(uid)
        assert time.monotonic() - killed_at < 160
        _check_owners_counted_each_micro_batch_once(cluster, ["s0a", "s0b"], 40)
        # The survivor of stage 1 served every micro-batch after the kill; its stage run went on without s1b.
        last = cluster.metrics("s1a", "outer_step")[-1]
        assert last["global_world_size"] == 1 and last["applied"]
        assert cluster.metrics("s1a", "swarm")[-1]["micro_batches"] == 4
        # Each owner held pooled connections to s1b: its next request there failed and went to s1a.
        reissued = sum(cluster.metrics(u, "swarm")[-1]["reissued"] for u in ("s0a", "s0b"))
        warned = sum((tmp_path / f"{u}.log").read_text().count("re-issued") for u in ("s0a", "s0b"))
        assert reissued >= 1 and warned == reissued
    finally:
        cluster.close()


@pytest.mark.soak  # a few process starts: tens of seconds on 2 busy cores
def test_a_joiner_takes_the_stage_state_from_a_live_peer_and_gets_work(tmp_path):
    cluster = TrainCluster(tmp_path, world_size=1)
    try:
        long = ["--optim.total_steps", "100000"]
        uids = _start_grid(cluster, 1, *long)
        cluster.wait_outer("s1a", 1)
        cluster.start_train("s1b", *SWARM, "--swarm.stage", "1", *long, rank=1)
        cluster.wait_for("s1b", lambda: len(cluster.metrics("s1b", "outer_step")) >= 3, "3 outer steps")
        for uid in ["s0a", "s1a", "s1b"]:   # stop the run as a preemption would: every worker leaves cleanly
            cluster.procs[uid].send_signal(signal.SIGTERM)
        for uid in [*uids, "s1b"]:
            assert cluster.finish(uid, 60) == 128 + signal.SIGTERM, cluster.log(uid)
        mine = {e["outer_step"]: e["params_hash"] for e in cluster.metrics("s1b", "outer_step") if e["applied"]}
        theirs = {e["outer_step"]: e["params_hash"] for e in cluster.metrics("s1a", "outer_step") if e["applied"]}
        assert len(mine) >= 2 and all(theirs[k] == v for k, v in mine.items() if k in theirs), (mine, theirs)
        assert cluster.metrics("s1b", "swarm")[-1]["backward"] > 0
        log = (tmp_path / "s1b.log").read_text()
        assert "received the run's state" in log and "joined stage 1 at step" in log
    finally:
        cluster.close()


CGROUP = Path("/sys/fs/cgroup/cpu")


@pytest.mark.soak
@pytest.mark.skipif(os.geteuid() != 0 or not (CGROUP / "cpu.cfs_quota_us").exists(),
                    reason="slowing a worker needs root and the cgroup v1 cpu controller")
def test_a_worker_slowed_by_the_os_receives_fewer_micro_batches(tmp_path):
    """s1b is held to a fifth of a core by a CPU quota (the OS slows it; nothing in zb sleeps)."""
    cluster = TrainCluster(tmp_path, world_size=2)
    group = CGROUP / f"zb-test-swarm-{os.getpid()}"
    try:
        uids = _start_grid(cluster, 2, "--optim.total_steps", "60", "--optim.batch_size", "8")
        group.mkdir()
        (group / "cpu.cfs_quota_us").write_text("20000")
        (group / "cgroup.procs").write_text(str(cluster.procs["s1b"].pid))
        for uid in uids:
            assert cluster.finish(uid, 170) == 0, cluster.log(uid)
        served = {uid: cluster.metrics(uid, "swarm")[-1]["backward"] for uid in ("s1a", "s1b")}
        assert sum(served.values()) == 2 * 4 * 60 and served["s1b"] < 0.8 * served["s1a"], served
    finally:
        cluster.close()
        if group.exists():
            group.rmdir()


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--swarm.stages", "3"], "swarm.stages = 3"),                                    # the debug model has 2 blocks
    (["--swarm.stages", "2", "--swarm.split", "1,2"], "swarm.split"),
    (["--swarm.stages", "2", "--swarm.stage", "2"], "must be below swarm.stages"),
])
def test_bad_swarm_settings_exit_2_with_one_line(args, words):
    proc = zb_process("train", "--model.name", "debug", "--diloco.inner_steps", "2", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_swarm_without_diloco_says_what_to_add():
    proc = zb_process("train", "--swarm.stages", "2", timeout=120)
    assert proc.returncode == 2 and "needs a [diloco] table" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.soak  # a few process starts: tens of seconds on 2 busy cores
def test_a_stage_without_workers_past_the_deadline_exits_1(tmp_path):
    cluster = TrainCluster(tmp_path, world_size=1)
    try:
        cluster.start_train("s0a", "--swarm.stages", "2", "--swarm.stage", "0", "--swarm.stage_wait", "2",
                            "--optim.total_steps", "5")
        assert cluster.finish("s0a", 120) == 1
        log = cluster.log("s0a")
        assert "stage 1 has had no live worker for 2 s" in log and "Traceback" not in log
    finally:
        cluster.close()


@pytest.mark.soak  # a few process starts: tens of seconds on 2 busy cores
def test_mismatched_models_within_a_stage_refused_with_exit_2(tmp_path):
    cluster = TrainCluster(tmp_path, world_size=1)
    try:
        cluster.start_train("s1a", *SWARM, "--swarm.stage", "1", "--optim.total_steps", "100")
        cluster.wait_for("s1a", lambda: "serving on" in (tmp_path / "s1a.log").read_text(), "serving", 120)
        cluster.start_train("s1b", *SWARM, "--swarm.stage", "1", "--model.n_heads", "2", rank=1)
        assert cluster.finish("s1b", 120) == 2
        log = cluster.log("s1b")
        assert "settings differ from the run's" in log and "model.n_heads" in log and "Traceback" not in log
    finally:
        cluster.close()

