"""DiLoCo with real nodes on loopback: agreement every outer step (fp32 and int8, 2 local ranks),
a join mid-run, a node killed mid-run, a node frozen past the heartbeat timeout that comes back,
and a joiner with another model refused.

Nodes are real `zb train` processes (through torch's launcher for 2 local ranks) around a real
`zb store`, with the short-timeout profile of the elastic tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zb.metrics import read_metrics
from zb.testing.cluster import PROFILE, TrainCluster, agree_with_joiner, hashes_by_mesh, join_late
from zb.testing.procs import REPO, free_port, subprocess_env


# fp32 over one stream under soak: int8 over two streams covers more of the path (suite time)
@pytest.mark.parametrize("compression, streams", [pytest.param("none", "1", marks=pytest.mark.soak), ("int8", "2")])
def test_two_nodes_of_two_ranks_agree_every_outer_step(make_run, compression, streams):
    run = make_run(2)
    for i in range(2):
        run.start_train(f"n{i}", "--optim.total_steps", "15", "--diloco.compression", compression, "--diloco.streams",
                  streams, "--diloco.drift_guard", local_ranks=2, rank=i)
    for i in range(2):
        assert run.finish(f"n{i}") == 0, run.log(f"n{i}")
        # every rank's gloo groups share its one device, whose listener admits only the members (no warning)
        assert "elastic.peer_filter" not in (run.tmp / f"n{i}.log").read_text()
    a, b = run.hashes("n0"), run.hashes("n1")
    assert sorted(a) == [1, 2, 3] and a == b
    assert all(e["num_peers"] == 2 for e in run.metrics("n0", "outer_step"))
    assert all(e["wire_bytes"] > 0 for e in run.metrics("n0", "outer_step"))
    for e in run.metrics("n0", "outer_step"):
        # The sync's seconds split: copies and collectives overlap inside allreduce_s (4 decimals each).
        assert 0 <= e["d2h_s"] <= e["allreduce_s"] + 1e-3 and 0 < e["reduce_s"] <= e["allreduce_s"] + 1e-3, e
        assert e["h2d_s"] >= 0, e


# int2 under soak (suite time): the same path as int4, another kernel width (held against the twins in test_kernels)
@pytest.mark.parametrize("compression", ["int4", pytest.param("int2", marks=pytest.mark.soak), "sparse"])
def test_three_nodes_agree_every_outer_step_at_4_and_2_bits(make_run, compression):
    """Packed 4- and 2-bit pseudo-gradients with error feedback (their default), and sparse top-k with its
    accumulator: every node holds the same params at every outer step."""
    run = make_run(3)
    for i in range(3):
        run.start_train(f"n{i}", "--optim.total_steps", "20", "--diloco.compression", compression, rank=i)
    for i in range(3):
        assert run.finish(f"n{i}") == 0, run.log(f"n{i}")
    hashes = [run.hashes(f"n{i}") for i in range(3)]
    assert sorted(hashes[0]) == [1, 2, 3, 4] and hashes[0] == hashes[1] == hashes[2]
    assert "error feedback (diloco.compression = " + compression in (run.tmp / "n0.log").read_text()
    assert all(e["applied"] and e["wire_bytes"] > 0 for e in run.metrics("n0", "outer_step"))


def test_joiner_mid_run_ends_identical(make_run):
    run = make_run(2)
    join_late(run)
    agree_with_joiner(run)
    joined = [e for e in run.metrics("n0", "membership") if "late" in e["joined"]]
    assert joined, "the leader never logged the join"
    late_steps = run.metrics("late", "step")
    assert late_steps[0]["step"] > 10, "the joiner should continue the run's step count, not start at 0"


def test_live_recovery_joiner_downloads_the_outer_state(make_run):
    run = make_run(2)
    run.env["ZB_CKPT_TOKEN"] = "test-token-0123456789abcdef"
    join_late(run, "--ckpt.live_recovery", "--diloco.blocking_join", "false", "--ckpt.ram_dir",
               str(run.tmp / "shm"), "--diloco.inner_steps", "60")  # slower outer steps: the joiner lands in time
    recovery = run.metrics("late", "recovery")
    assert recovery and recovery[0]["bytes"] > 0 and recovery[0]["peers"]
    left = [str(p) for p in (run.tmp / "shm").rglob("*") if p.is_file()]
    assert not left, f"RAM copies outlived their runs: {left}"  # served snapshots, the joiner's download
    agree_with_joiner(run)
    # Normally the joiner applies the run's update in its first outer step; if the run moved on
    # between its download and its admission, it falls back to the blocking transfer (also correct).
    first = run.metrics("late", "outer_step")[0]
    log = (run.tmp / "late.log").read_text()
    fell_back = "received the run's state from rank" in log.split("zb.train: outer step")[0]
    assert first["applied"] != fell_back


def test_killed_node_does_not_stop_the_others(make_run):
    run = make_run(3)
    for i in range(3):
        run.start_train(f"n{i}", "--optim.total_steps", "25", rank=i)
    run.wait_outer("n2", 1)
    run.procs["n2"].kill()
    for uid in ("n0", "n1"):
        assert run.finish(uid) == 0, run.log(uid)
    last = max(run.hashes("n0"))
    assert run.hashes("n0")[last] == run.hashes("n1")[last]
    assert run.metrics("n0", "outer_step")[-1]["global_world_size"] == 2


def test_joiner_with_another_model_is_refused(make_run):
    run = make_run(1)
    run.start_train("n0", "--optim.total_steps", "30")
    run.wait_outer("n0", 1)
    bad = run.start_train("odd", "--optim.total_steps", "30", "--model.n_layers", "3", rank=1)
    assert bad.wait(120) == 2
    log = (run.tmp / "odd.log").read_text()
    assert "model.n_layers" in log and "Traceback" not in log
    # zb status shows it refused, with the reason, not "left" (issue 30, defect 4)
    from zb.elastic.keys import is_counter
    from zb.status.reader import RunReader
    from zb.store_clients import reading_client

    doc = RunReader(reading_client("127.0.0.1", run.port, 10.0, counters=is_counter), "test").read()
    odd = next(n for n in doc["nodes"] if n["uid"] == "odd")
    assert odd["state"] == "refused", odd
    assert run.finish("n0") == 0, run.log("n0")
    assert all(e["global_world_size"] == 1 for e in run.metrics("n0", "outer_step"))


def test_a_node_at_a_store_whose_run_ended_is_told_so_not_to_join_it(make_run):
    """Issue 37: a new run with other settings on a store whose run had ended (every node said goodbye)
    was told "Use the run's settings to join it": there is nothing to join. It is told that run ended
    and how to start a new one; the namespace it is pointed to works."""
    run = make_run(1)
    run.start_train("n0", "--optim.total_steps", "10")
    assert run.finish("n0") == 0, run.log("n0")
    late = run.start_train("late", "--optim.total_steps", "10", "--train.seed", "5")
    assert late.wait(120) == 2, run.log("late")
    errors = [line for line in (run.tmp / "late.log").read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.log("late")
    assert re.search(r"this store holds a run that has ended \(every node of its last world, mesh version \d+, left: "
                     r"n0\) and this node's settings differ from that run's: train.seed \(run: \d+, this node: 5\)\. "
                     r"For a new run start a new `zb store`, or pick a new namespace on this one with "
                     r"--elastic.namespace$", errors[0]), errors[0]
    run.start_train("fresh", "--optim.total_steps", "10", "--train.seed", "5", "--elastic.namespace", "second")
    assert run.finish("fresh") == 0, run.log("fresh")


def test_non_finite_pseudo_gradient_is_skipped_everywhere(make_run):
    run = make_run(2)
    run.start_train("n0", "--optim.total_steps", "10", rank=0)
    run.start_train("bad", "--optim.total_steps", "10", "--optim.lr", "1e30", rank=1)  # diverges to NaN
    for uid in ("n0", "bad"):
        assert run.finish(uid) == 0, run.log(uid)
    outer = run.metrics("n0", "outer_step")
    assert outer and not any(e["applied"] for e in outer), "a NaN pseudo-gradient must skip the step on every node"
    assert all(isinstance(s["loss"], float) for s in run.metrics("n0", "step")), "the healthy node stayed finite"
    assert "reset to the outer params" in (run.tmp / "bad.log").read_text()


def test_whole_run_restart_resumes_the_agreed_checkpoint(make_run):
    ck = lambda uid: ["--ckpt.path", str(make_run_dir(run, uid)), "--ckpt.interval", "5",  # noqa: E731
                      "--ckpt.ram_dir", str(run.tmp / "shm")]
    run = make_run(2)
    for i in range(2):
        run.start_train(f"n{i}", "--optim.total_steps", "20", "--train.max_steps", "10", *ck(f"n{i}"), rank=i)
    for i in range(2):
        assert run.finish(f"n{i}") == 0, run.log(f"n{i}")
    restart = make_run(2)
    restart.tmp = run.tmp
    for i in range(2):
        restart.start_train(f"n{i}", "--optim.total_steps", "20", "--ckpt.resume", "latest", *ck(f"n{i}"), rank=i)
    for i in range(2):
        assert restart.finish(f"n{i}") == 0, restart.log(f"n{i}")
        assert "resumed from" in (restart.tmp / f"n{i}.log").read_text()
    # Both runs log into the same metrics files: the restart continues at step 10, outer step 2.
    events = restart.metrics("n0", "outer_step")
    assert [(e["outer_step"], e["step"]) for e in events] == [(1, 5), (2, 10), (3, 15), (4, 20)]
    assert restart.hashes("n0")[4] == restart.hashes("n1")[4]


def test_whole_run_killed_restarts_against_the_store_that_outlived_it(make_run):
    """Every node SIGKILLed (no goodbye): the store still holds their world. Restarted under the same ids, each
    sees the old members' heartbeats move (the new incarnations bump the same counters); a member that asked
    to join again under a new token counts as gone, so the restart seeds a new world and resumes (it used to
    wait out elastic.store_timeout for a leader that never came, then exit 1)."""
    from zb.ckpt.durable.layout import complete_steps

    run = make_run(2)
    args = lambda uid: ["--optim.total_steps", "100", "--ckpt.path", str(make_run_dir(run, uid)),  # noqa: E731
                        "--ckpt.interval", "5", "--ckpt.resume", "latest"]
    for i in range(2):
        run.start_train(f"n{i}", *args(f"n{i}"), rank=i)
    # At least step 10 on both (not step 10 itself: on a fast machine it is pruned before a poll sees it).
    run.wait_for("n0", lambda: all(max(complete_steps(make_run_dir(run, f"n{i}")), default=0) >= 10 for i in range(2)),
                 "both nodes' checkpoints of step 10 or later")
    for i in range(2):
        os.killpg(run.procs[f"n{i}"].pid, signal.SIGKILL)
        run.procs[f"n{i}"].wait(10)
    assert run.metrics("n0", "step")[-1]["step"] < 100, "the run ended before the kill: make it longer"
    for i in range(2):
        run.start_train(f"n{i}", *args(f"n{i}"), rank=i)
    for i in range(2):
        assert run.finish(f"n{i}") == 0, run.log(f"n{i}")
    steps = {re.search(r"resumed from \S+ at step (\d+)", (run.tmp / f"n{i}.log").read_text()).group(1)
             for i in range(2)}
    assert len(steps) == 1, steps
    assert run.hashes("n0")[20] == run.hashes("n1")[20]     # the last outer step: step 100


def make_run_dir(run: TrainCluster, uid: str) -> Path:
    return run.tmp / "ckpt" / uid



# With the drift guard off only the readmission rule protects the run: that case runs by default; the
# rule itself runs in-process (tests/test_node_inprocess.py, a node readmitted after an eviction).
@pytest.mark.parametrize("drift_guard, overlap", [pytest.param("true", "none", marks=pytest.mark.soak), ("false", "none"),
                                                  pytest.param("true", "eager", marks=pytest.mark.soak)])
def test_node_evicted_while_frozen_gets_the_state_before_it_contributes(make_run, drift_guard, overlap):
    """SIGSTOP a node past the heartbeat timeout, let the other train alone, SIGCONT it: it is
    admitted again and must hold the run's params at every all-reduce from then on (it used to
    average its stale params in and the two trained apart while both exited 0). Without the
    check-in digest (drift_guard false) the rejoin alone must send it the state. Under
    diloco.overlap = eager its background transfer fails too, and it drops its own eager term."""
    run = make_run(2)
    for i in range(2):
        run.start_train(f"n{i}", "--optim.total_steps", "100000", "--diloco.drift_guard", drift_guard,
                        "--diloco.overlap", overlap, rank=i)
    run.wait_outer("n1", 2)
    os.killpg(run.procs["n1"].pid, signal.SIGSTOP)
    alone = lambda: sum(e["global_world_size"] == 1 for e in run.metrics("n0", "outer_step")) >= 2  # noqa: E731
    try:
        run.wait_for("n0", alone, "two outer steps alone")
    finally:
        os.killpg(run.procs["n1"].pid, signal.SIGCONT)
    frozen_at = max(e["mesh_version"] for e in run.metrics("n0", "outer_step") if e["global_world_size"] == 1)
    back = lambda: sum(k[0] > frozen_at for k in hashes_by_mesh(run, "n1")) >= 3  # noqa: E731
    run.wait_for("n1", back, "three all-reduces with the run after the thaw")
    for uid in ("n0", "n1"):
        run.procs[uid].send_signal(signal.SIGTERM)
    for uid in ("n0", "n1"):
        assert run.finish(uid) == 128 + signal.SIGTERM, run.log(uid)
    a, b = hashes_by_mesh(run, "n0"), hashes_by_mesh(run, "n1")
    shared = sorted(set(a) & set(b))
    assert sum(k[0] > frozen_at for k in shared) >= 3, f"the thawed node did not train with the run: {a} {b}"
    assert [k for k in shared if a[k] != b[k]] == [], "params differ at all-reduces both nodes took"
    log = (run.tmp / "n1.log").read_text()
    assert "receives the run's state" in log
    # It says why the others dropped it (issue 30, defect 6: a live node evicted on a busy machine).
    assert "this node's own heartbeats were up to" in log and "raise elastic.heartbeat_timeout" in log, log[-3000:]


def test_a_node_can_host_the_store_itself(tmp_path):
    """Prime style (--elastic.host_store): no `zb store`; a second node joins through the first. The
    host used to check the run fingerprint against the store before it hosted it, and fail."""
    port = str(free_port())
    env = subprocess_env(GLOBAL_WORLD_SIZE="2", GLOBAL_PORT=port, OMP_NUM_THREADS="1", **PROFILE)
    procs = []
    for uid, extra in (("host", ["--elastic.host_store"]), ("guest", [])):
        node_env = dict(env, GLOBAL_UNIQUE_ID=uid, GLOBAL_ADDR="127.0.0.1")
        procs.append(subprocess.Popen([sys.executable, "-m", "zb", "train", *TrainCluster.ARGS, "--optim.total_steps",
                                       "15", *extra, "--log.dir", str(tmp_path / uid)], env=node_env, cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=150) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    host, guest = (read_metrics(tmp_path / u / "metrics.jsonl", "outer_step") for u in ("host", "guest"))
    assert [e["params_hash"] for e in host] == [e["params_hash"] for e in guest]
    assert all(e["global_world_size"] == 2 for e in host)
