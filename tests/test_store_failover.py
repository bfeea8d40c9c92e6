"""A run that outlives its store (elastic.addr with a standby, zb.elastic.stores), with real processes on
loopback: a `zb store` SIGKILLed for good, the run re-formed on the next store, and what must not happen
(a store that comes back splits nobody off; a list that differs between nodes is refused)."""

from __future__ import annotations

import re
import signal
import time

import pytest

from zb.testing.cluster import Cluster, TrainCluster, hashes_by_mesh
from zb.testing.procs import wait_until

FAILOVER = {"ZB_ELASTIC_STORE_FAILOVER_S": "3"}


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, **FAILOVER)
    c.add_standby()
    yield c
    c.close()


def _moved(node, to_port: int) -> list[dict]:
    return [e for e in node.events("store_failover") if e["to_store"].endswith(f":{to_port}")]


def test_three_nodes_move_to_the_standby_when_the_store_dies_for_good(cluster):
    cluster.start_store()
    standby = cluster.start_store(cluster.standby_ports[0])
    assert standby.poll() is None
    a, b, c = cluster.start_world(3)
    first = cluster.agreement([a, b, c], 3)
    cluster.kill_store()                      # never restarted
    killed = time.time()
    view = cluster.agreement([a, b, c], 3, after=killed, store_ok=True, timeout=90)
    assert view["version"] > first["version"] and sorted(view["nodes"]) == ["a", "b", "c"]
    for node in (a, b, c):
        (moved,) = _moved(node, cluster.standby_ports[0])
        assert moved["silent_s"] >= 3.0 and moved["failovers"] == 1
        assert moved["from_store"] == f"127.0.0.1:{cluster.port}"


def test_three_nodes_move_to_the_standby_when_the_store_goes_silent(cluster):
    """The store stopped (SIGSTOP): connections stay open, nothing answers, nothing is reset. Every operation
    of the nodes' clients is bounded by the failover budget (zb.elastic.stores.op_budget), not by TCP: they move
    as they do from a killed store, within store_failover_s plus a few operation timeouts."""
    cluster.start_store()
    cluster.start_store(cluster.standby_ports[0])
    a, b, c = cluster.start_world(3)
    first = cluster.agreement([a, b, c], 3)
    cluster.silence_store()
    silenced = time.time()
    view = cluster.agreement([a, b, c], 3, after=silenced, store_ok=True, timeout=90)
    assert view["version"] > first["version"] and sorted(view["nodes"]) == ["a", "b", "c"]
    for node in (a, b, c):
        (moved,) = _moved(node, cluster.standby_ports[0])
        assert moved["silent_s"] >= 3.0 and moved["from_store"] == f"127.0.0.1:{cluster.port}"


def test_a_node_hosts_the_next_store(cluster):
    cluster.start_store()
    a = cluster.start("a", 0, 3, ZB_ELASTIC_HOST_STORE="1")   # the first store is taken: a hosts the second
    b, c = cluster.start("b", 1, 3), cluster.start("c", 2, 3)
    first = cluster.agreement([a, b, c], 3)
    assert f"hosts the store 127.0.0.1:{cluster.standby_ports[0]}" in a.err.read_text()
    cluster.kill_store()
    view = cluster.agreement([a, b, c], 3, after=time.time(), store_ok=True, timeout=90)
    assert view["version"] > first["version"]
    assert all(_moved(n, cluster.standby_ports[0]) for n in (a, b, c))


def test_a_store_that_comes_back_after_the_failover_is_ignored_and_a_new_node_finds_the_run(cluster):
    cluster.start_store()
    cluster.start_store(cluster.standby_ports[0])
    a, b = cluster.start("a", 0, 2), cluster.start("b", 1, 2)
    cluster.agreement([a, b], 2)
    cluster.kill_store()
    moved = cluster.agreement([a, b], 2, after=time.time(), store_ok=True, timeout=90)
    cluster.start_store()                     # the first address answers again, empty
    c = cluster.start("c", 2, 2)              # starts where the run is: the store holding its world
    view = cluster.agreement([a, b, c], 3, after=time.time(), store_ok=True, timeout=90)
    assert view["version"] > moved["version"]
    assert all(len(n.events("store_failover")) == 1 for n in (a, b)) and not c.events("store_failover")
    assert f"starting on store 127.0.0.1:{cluster.standby_ports[0]}" in c.err.read_text()


def test_a_node_that_saw_the_store_revived_follows_the_run_to_the_next_one(cluster):
    """a and b give up on the store after 2 s, c would wait 60: the store comes back in between. c must not
    train on there alone (a revived store is seeded by at least half the world) and follows the run once the
    others mark the revived store as left (keys.MOVED)."""
    cluster.start_store()
    cluster.start_store(cluster.standby_ports[0])
    a, b = cluster.start("a", 0, 3, ZB_ELASTIC_STORE_FAILOVER_S="2"), cluster.start("b", 1, 3, ZB_ELASTIC_STORE_FAILOVER_S="2")
    c = cluster.start("c", 2, 3, ZB_ELASTIC_STORE_FAILOVER_S="60")
    first = cluster.agreement([a, b, c], 3)
    cluster.kill_store()
    killed = time.time()
    wait_until(lambda: _moved(a, cluster.standby_ports[0]) and _moved(b, cluster.standby_ports[0]), 60,
               "a and b on the standby", alive=[a.proc, b.proc])
    cluster.start_store()                     # revived, empty: c reconnects to it
    view = cluster.agreement([a, b, c], 3, after=time.time(), store_ok=True, timeout=90)
    assert view["version"] > first["version"]
    assert _moved(c, cluster.standby_ports[0]), "c followed the run to the standby"
    assert not [s for s in c.events("step") if s["time"] > killed and s["size"] < 3 and s["store_ok"]], \
        "c trained in a world of its own on the revived store"


def test_a_node_naming_other_stores_is_refused_at_join(cluster):
    cluster.start_store()
    a = cluster.start("a", 0, 1)
    cluster.agreement([a], 1)
    other = cluster.start("x", 1, 1, GLOBAL_ADDR=f"127.0.0.1:{cluster.port},127.0.0.1:1")
    assert other.proc.wait(60) == 2
    message = other.events("error")[0]["message"]
    assert "every node must list the same stores in the same order" in message and "\n" not in message
    assert a.proc.poll() is None


def test_a_node_that_reaches_no_store_of_the_list_exits_1(tmp_path):
    c = Cluster(tmp_path, ZB_ELASTIC_CONNECT_TIMEOUT="2")    # no store started at either address
    c.add_standby()
    try:
        node = c.start("a")
        assert node.proc.wait(60) == 1
        assert "unreachable after 2 s" in node.events("error")[0]["message"]
    finally:
        c.close()


def test_sigterm_during_the_wait_for_a_silent_store_exits_at_once(cluster):
    cluster.start_store()
    cluster.start_store(cluster.standby_ports[0])
    a = cluster.start("a", 0, 1, ZB_ELASTIC_STORE_FAILOVER_S="60")
    cluster.agreement([a], 1)
    cluster.kill_store()
    time.sleep(2.0)                           # a is now waiting at a boundary for the silent store
    a.signal(signal.SIGTERM)
    assert a.proc.wait(30) in (128 + signal.SIGTERM, -signal.SIGTERM, 143, 0)


def test_training_nodes_apply_every_outer_step_once_and_agree_across_the_failover(tmp_path):
    """Three `zb train` nodes; the store SIGKILLed for good after outer step 2: every node applies each of the
    run's 12 outer steps exactly once, on the same params, whatever the moment the kill landed in."""
    run = TrainCluster(tmp_path, 3, **FAILOVER)
    try:
        run.start_store(run.add_standby())
        for i in range(3):
            run.start_train(f"n{i}", "--optim.total_steps", "60", rank=i)
        run.wait_outer("n0", 2)
        run.kill_store()
        for i in range(3):
            assert run.finish(f"n{i}") == 0, run.log(f"n{i}")
        outer = [[e["outer_step"] for e in run.metrics(f"n{i}", "outer_step")] for i in range(3)]
        assert outer == [list(range(1, 13))] * 3, outer                     # none skipped, none twice
        hashes = [run.hashes(f"n{i}") for i in range(3)]
        assert hashes[0] == hashes[1] == hashes[2] and len(hashes[0]) == 12
        for i in range(3):
            (moved,) = run.metrics(f"n{i}", "store_failover")
            assert moved["silent_s"] >= 3.0 and moved["global_world_size"] == 3
            steps = [e["step"] for e in run.metrics(f"n{i}", "step")]
            assert steps == sorted(set(steps)), "an inner step done twice"
    finally:
        run.close()


# -- the kill aimed at a moment: inside an all-reduce, inside a joiner's state transfer (soak). Several stores
# in a row are killed, each aimed, until the metrics show one kill landed there; every node must agree at every
# all-reduce they took together, whatever the moments were. ---------------------------------------------------
# An all-reduce longer than the round's compute: 8 layers of dim 256, fp32, 8 tokens per inner step, H = 1.
BIG = ("--model.type", "llama3", "--model.name", "debugmodel", "--data.seq_length", "8", "--optim.batch_size", "1",
       "--train.micro_bs", "1", "--diloco.inner_steps", "1", "--diloco.compression", "none")
TRIES = 4


def _window(e: dict) -> tuple[float, float]:
    """(start, end) on the wall clock of the all-reduce an outer_step event reports."""
    end = e["time"] - e["h2d_s"]
    return end - e["allreduce_s"], end


def _aimed_kills(run: TrainCluster, uids: list[str], landed) -> int:
    """Kill the run's current store at the moment `landed(killed_at)` is about, TRIES times at most (a standby
    after each), until `landed` says a kill landed there; returns the try that did (-1: none)."""
    ports = [run.port, *run.standby_ports]
    for k in range(TRIES):
        aim = landed(None)                   # when to kill
        time.sleep(max(0.0, aim - time.time()))
        killed = time.time()
        run.kill_store(ports[k])
        for uid in uids:
            run.wait_for(uid, lambda u=uid, k=k: len(run.metrics(u, "store_failover")) == k + 1, f"move {k + 1}")
        if landed(killed):
            return k
    return -1


def _stop_and_agree(run: TrainCluster, uids: list[str]) -> None:
    for uid in uids:
        run.procs[uid].send_signal(signal.SIGTERM)
    for uid in uids:
        assert run.finish(uid) == 128 + signal.SIGTERM, run.log(uid)
    hashes = [hashes_by_mesh(run, uid, len(uids)) for uid in uids]
    shared = sorted(set.intersection(*(set(h) for h in hashes)))
    assert len(shared) >= 3, hashes
    for key in shared:
        assert len({h[key] for h in hashes}) == 1, f"all-reduce {key} (mesh version, index)"
    for uid in uids:
        outer = [e["outer_step"] for e in run.metrics(uid, "outer_step")]
        assert outer == sorted(set(outer)), f"{uid}: an outer step done twice"


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_the_store_killed_inside_an_all_reduce(tmp_path):
    run = TrainCluster(tmp_path, 3, **FAILOVER)
    try:
        for _ in range(TRIES):
            run.start_store(run.add_standby())
        uids = [f"n{i}" for i in range(3)]
        for i, uid in enumerate(uids):
            run.start_train(uid, *BIG, "--optim.total_steps", "100000", rank=i)
        run.wait_outer("n0", 3)

        def landed(killed: float | None):
            events = [e for e in run.metrics("n0", "outer_step") if "allreduce_s" in e]
            if killed is None:               # aim at the middle of the next all-reduce, from the last two
                last, prev = events[-1], events[-2]
                start, end = _window(last)
                return end + (last["time"] - prev["time"]) - (end - start) / 2
            return any(_window(e)[0] <= killed <= _window(e)[1] for u in uids
                       for e in run.metrics(u, "outer_step") if "allreduce_s" in e)

        assert _aimed_kills(run, uids, landed) >= 0, f"no kill of {TRIES} landed inside an all-reduce"
        run.wait_outer("n0", len(run.metrics("n0", "outer_step")) + 3)
        _stop_and_agree(run, uids)
    finally:
        run.close()


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_the_store_killed_while_a_joiner_receives_the_state(tmp_path):
    """A joiner is admitted, the store is killed as the state transfer starts (the donor's hand-over follows
    the membership event that admits it); the joiner must end up with the run's params."""
    for attempt in range(TRIES):
        (tmp_path / str(attempt)).mkdir()
        run = TrainCluster(tmp_path / str(attempt), 2, **FAILOVER)   # two start the run, the third joins
        try:
            run.start_store(run.add_standby())
            for i in range(2):
                run.start_train(f"n{i}", *BIG, "--optim.total_steps", "100000", rank=i)
            run.wait_outer("n0", 2)
            run.start_train("late", *BIG, "--optim.total_steps", "100000", rank=2)
            run.wait_for("late", lambda run=run: any("late" in e["joined"] for e in run.metrics("late", "membership")),
                         "admitted")
            killed = time.time()
            run.kill_store()
            run.wait_for("late", lambda run=run: len(run.metrics("late", "store_failover")) == 1,
                         "moved to the standby")
            run.wait_outer("late", 4)
            _stop_and_agree(run, ["n0", "n1", "late"])
            # The hand-over follows the admission at once (check-in, then the transfer): it ran from the membership
            # event that admitted the joiner for as long as the joiner's log says the transfer took.
            admitted = next(e["time"] for e in run.metrics("late", "membership") if "late" in e["joined"])
            took = re.search(r"received the run's state from rank \d+ in ([\d.]+) s", (run.tmp / "late.log").read_text())
            assert took, run.log("late")
            if admitted <= killed <= admitted + float(took.group(1)) + 0.1:
                return
        finally:
            run.close()
    raise AssertionError(f"the kill never landed inside the joiner's state transfer in {TRIES} attempts")
