"""A run that outlives its store (elastic.addr with a standby, zb.elastic.stores), with real processes on
loopback: a `zb store` SIGKILLed for good, the run re-formed on the next store, and what must not happen
(a store that comes back splits nobody off; a list that differs between nodes is refused)."""

from __future__ import annotations

import signal
import time

import pytest

from zb.testing.cluster import Cluster, TrainCluster

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
    assert "starting on store 127.0.0.1:%d" % cluster.standby_ports[0] in c.err.read_text()


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
