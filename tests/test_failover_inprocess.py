"""Store failover's decision paths in one process: real `Membership` objects with heartbeat threads, each node
a thread, over two in-process stores; the first is shut down for good and the run must re-form on the second
(with the quorum, the run's id and the refusals of zb.elastic.stores). The process tests
(tests/test_store_failover.py) keep what needs processes: `zb store`, the gloo groups, training."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from zb.addresses import StoreAddress
from zb.config_schema import ElasticConfig
from zb.elastic import keys
from zb.elastic.heartbeat import Heartbeat, Liveness
from zb.elastic.membership import Membership
from zb.elastic.stores import StoreList
from zb.elastic.world import World
from zb.errors import EnvironmentFailure
from zb.testing.threads import each_at_once

# A live member beats 25 times per timeout: a busy machine (the suite's two workers) does not make it look dead.
# A store answers within CONNECT_S, and moving takes STORE_FAILOVER_S of silence: under CI's load the in-process
# store once did not answer a starting node within 0.5 s, which then moved alone (now refused: see
# test_a_node_at_the_standby_alone_does_not_start_a_second_run).
CONNECT_S = 2.0
# ... except while a test starts its nodes together (Run.start), when both are START_S (the failover budget bounds
# a connect too): under the suite's load an in-process store has taken over 2 s to answer one starting node's
# handshake (three times in one session), which then moved to the standby alone, rightly refused to start a second
# run there, and failed the start of a test about something else.
START_S = 15.0
CFG = ElasticConfig(store_timeout=30, polling_interval=0.02, sync_deadline=5, heartbeat_interval=0.2,
                    heartbeat_timeout=5.0, store_failover_s=2.0)


def _master():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


class Run:
    """Nodes of one run over two stores, the second a standby."""

    def __init__(self, cfg: ElasticConfig = CFG) -> None:
        self.cfg = cfg
        self.first, self.second = _master(), _master()
        self.addresses = [StoreAddress("127.0.0.1", s.port) for s in (self.first, self.second)]
        self.nodes: dict[str, Membership] = {}
        self.beats: list[Heartbeat] = []
        self.connect_s = CONNECT_S

    def add(self, uid: str) -> Membership:
        stores = StoreList(self.addresses, self.cfg.store_failover_s)
        connect = lambda: stores.connect(self.connect_s, 10.0)  # noqa: E731
        m = Membership(self.cfg, uid, f"tok-{uid}", 1, Liveness(self.cfg.heartbeat_timeout), connect, stores=stores)
        hb = Heartbeat(uid, self.cfg.heartbeat_interval, m.liveness, connect,
                       lambda: list(m.world.nodes) if m.world else [], answered=stores.answered)
        m.heartbeat = hb
        hb.start()
        self.nodes[uid], self.beats = m, [*self.beats, hb]
        return m

    def together(self, uids: list[str], fn) -> dict[str, World | BaseException]:
        return each_at_once(self.nodes, uids, fn, self.cfg.store_timeout + 30)

    def start(self, uids: list[str]) -> dict[str, World]:
        self.connect_s = START_S
        for uid in uids:
            self.add(uid).stores.failover_s = START_S
        try:
            worlds = self.together(uids, lambda m: m.join(quorum=len(uids), quorum_timeout=10.0))
        finally:
            self.connect_s = CONNECT_S
            for uid in uids:
                self.nodes[uid].stores.failover_s = self.cfg.store_failover_s
        assert all(isinstance(w, World) and sorted(w.nodes) == sorted(uids) for w in worlds.values()), worlds
        return worlds  # type: ignore[return-value]

    def lose_first_store(self) -> None:
        del self.first          # the in-process server goes with its last reference: connections reset

    def close(self) -> None:
        for hb in self.beats:
            hb.stop()


@pytest.fixture
def run():
    r = Run()
    yield r
    r.close()


def test_the_run_reforms_on_the_next_store_with_every_node_and_its_id(run):
    before = run.start(["a", "b", "c"])["a"]
    assert before.run
    run.lose_first_store()
    after = run.together(["a", "b", "c"], lambda m: m.resolve())
    worlds = list(after.values())
    assert all(isinstance(w, World) for w in worlds), after
    assert len({w.encode() for w in worlds}) == 1            # one world, read by all
    world = worlds[0]
    assert sorted(world.nodes) == ["a", "b", "c"] and world.run == before.run and world.version > before.version
    assert world.joined == []                                # all were in the newest world: nobody needs state
    for m in run.nodes.values():
        assert [f.to_store for f in m.stores.failovers] == [str(run.addresses[1])]
        assert m.stores.failovers[0].silent_s >= CFG.store_failover_s


def test_a_node_that_never_arrives_is_left_behind_after_the_grace(run):
    run.start(["a", "b", "c"])
    run.beats[2].stop()                                      # c is gone with the store
    run.lose_first_store()
    after = run.together(["a", "b"], lambda m: m.resolve())
    assert all(isinstance(w, World) and sorted(w.nodes) == ["a", "b"] for w in after.values()), after


# A node re-forming at the next store waits for the last world's majority until the later of store_timeout and
# the quorum's grace (heartbeat_timeout) plus heartbeat_timeout: these bounds make that 5 s instead of 10 (still
# 25 beats per timeout).
NOT_ADMITTED = dataclasses.replace(CFG, store_timeout=3.0, heartbeat_interval=0.1, heartbeat_timeout=2.5)


def test_a_lone_node_of_a_larger_world_does_not_train_alone_at_the_next_store():
    r = Run(NOT_ADMITTED)
    try:
        r.start(["a", "b", "c"])
        for hb in r.beats[1:]:
            hb.stop()                                        # b and c never reach the next store
        r.lose_first_store()
        (outcome,) = r.together(["a"], lambda m: m.resolve()).values()
        assert isinstance(outcome, EnvironmentFailure) and "not admitted" in str(outcome)
    finally:
        r.close()


def test_half_of_the_world_does_not_reform_at_the_next_store():
    """One of two nodes at the next store: the other may still train on the earlier store (a partition cut only
    this one off it), so half is not enough to re-form, only a majority is (zb.elastic.stores.reform_quorum)."""
    r = Run(NOT_ADMITTED)
    try:
        r.start(["a", "b"])
        r.beats[1].stop()                                    # b never reaches the next store
        r.lose_first_store()
        (outcome,) = r.together(["a"], lambda m: m.resolve()).values()
        assert isinstance(outcome, EnvironmentFailure) and "not admitted" in str(outcome), outcome
    finally:
        r.close()


def test_a_next_store_holding_another_run_is_refused(run):
    run.start(["a"])
    client = dist.TCPStore("127.0.0.1", run.second.port, use_libuv=True, timeout=timedelta(seconds=10))
    client.set(keys.WORLD, World(version=7, nodes=["z"], tokens={"z": "t"}, run="another-run").encode())
    run.lose_first_store()
    (outcome,) = run.together(["a"], lambda m: m.resolve()).values()
    assert isinstance(outcome, EnvironmentFailure), outcome
    assert "holds another run (run id another-run" in str(outcome) and "\n" not in str(outcome)


def test_a_node_at_the_standby_alone_does_not_start_a_second_run():
    """A starting node that did not hear from the first store in time starts at the standby (StoreList._start's
    probe, or a move during its first join). Its peers start the run at the first store: after
    elastic.start_timeout the two of three there are a majority of elastic.world_size and start; the lone node
    never is, so it exits instead of training a second run."""
    r = Run(NOT_ADMITTED)
    try:
        for uid in ("a", "b", "c"):
            r.add(uid)
        r.nodes["a"].stores.follow(1)                        # its probe of the first store timed out
        out = r.together(["a", "b", "c"], lambda m: m.join(quorum=3, quorum_timeout=1.0))
        assert all(isinstance(out[u], World) and sorted(out[u].nodes) == ["b", "c"] for u in "bc"), out
        assert isinstance(out["a"], EnvironmentFailure), out
        assert "not admitted" in str(out["a"]) and "2 of the 3 nodes of elastic.world_size" in str(out["a"])
    finally:
        r.close()


def test_a_majority_of_the_quorum_that_moved_while_starting_starts_the_run_at_the_standby():
    """The first store dies while two of three starting nodes wait for the third: they move, and being a majority
    of elastic.world_size they start the run at the standby (after the re-form's grace), one world, a new run."""
    r = Run(NOT_ADMITTED)
    try:
        for uid in ("a", "b"):
            r.add(uid)
        threading.Timer(1.0, r.lose_first_store).start()
        out = r.together(["a", "b"], lambda m: m.join(quorum=3, quorum_timeout=30.0))
        worlds = list(out.values())
        assert all(isinstance(w, World) and sorted(w.nodes) == ["a", "b"] for w in worlds), out
        assert len({w.encode() for w in worlds}) == 1
        assert all(m.stores.index == 1 for m in r.nodes.values())
    finally:
        r.close()
