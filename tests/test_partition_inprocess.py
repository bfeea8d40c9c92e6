"""Which side of a partition goes on (zb.elastic.partition), in one process: real `Membership` objects with
heartbeat threads, each node a thread, over two in-process stores with a failover list; a partition is a gate
on each node's clients that makes every operation on a store it is cut from fail, as a store that answers
nothing does. Each test cuts a shape, lets every node resolve as at its outer steps, heals, and checks that
only one world ever went on and that every node ends in it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import zb.elastic.stores as stores_module
from zb.addresses import StoreAddress
from zb.config_schema import ElasticConfig
from zb.elastic import keys
from zb.elastic.heartbeat import Heartbeat, Liveness
from zb.elastic.membership import Membership
from zb.elastic.partition import FOLLOW, GO, WAIT, drop_verdict, may_go_back, needs_look, settle_s, stale_arrival
from zb.elastic.store_state import Snapshot, Stayed
from zb.elastic.stores import StoreList
from zb.elastic.tcpstore import host
from zb.elastic.world import World
from zb.store_clients import StoreUnreachable
from zb.testing.threads import each_at_once

# A live member beats 25 times per timeout: a busy machine (the suite's two workers) does not make it look dead.
# Short deadlines, yet with room for a busy machine: a 0.5 s failover moved the nodes of one run to the standby
# during the fixture's join under a load of 5 on 2 cores (the heartbeat thread starved that long).
CFG = ElasticConfig(store_timeout=40, polling_interval=0.02, sync_deadline=3.0, heartbeat_interval=0.2,
                    heartbeat_timeout=3.0, store_failover_s=1.5)


# -- the rule ------------------------------------------------------------------------------------------------
def test_a_majority_or_a_single_store_goes_on_without_looking():
    assert not needs_look(counted=4, kept=3, silent=1, has_later=True)       # a majority stays
    assert not needs_look(counted=4, kept=2, silent=2, has_later=False)      # one store: the store decides
    assert not needs_look(counted=2, kept=1, silent=0, has_later=True)       # nobody silent: proven out
    assert needs_look(counted=4, kept=2, silent=2, has_later=True)           # half is no majority
    assert drop_verdict(4, 3, 1, settled=False, later=[None]) .action == GO


def test_a_member_late_at_the_sync_that_answered_is_on_this_side():
    """CI at a load of 2 workers: b missed the sync while d went silent; b answered here, so a, b and c are a
    majority of the four and drop d without looking at the later stores (the leader once followed d's join
    request to the standby instead)."""
    from types import SimpleNamespace

    from zb.elastic.partition_watch import PartitionWatch
    from zb.elastic.world import Observation

    world = World(version=3, nodes=["a", "b", "c", "d"], tokens=dict.fromkeys("abcd", "t"), run="r")
    stores = SimpleNamespace(has_next=True, peek=lambda *a: pytest.fail("looked at a later store"))
    liveness = SimpleNamespace(proven_dead=lambda m: False, silent_for=lambda m: 10.0 if m == "d" else 0.0)
    watch = PartitionWatch(CFG, stores, liveness)   # type: ignore[arg-type]
    snap = Snapshot(raw_world=b"", world=world, gone=set(), joins=[], answers=[])
    obs = Observation(answered={"a", "b", "c"}, gone=set(), excluded={"b", "d"}, joiners=[], join_end=0)
    assert watch.may_drop(None, world, snap, obs, since=10.0) == {"d": 3}   # type: ignore[arg-type]


@pytest.mark.parametrize("later, settled, action, to", [
    ([True], False, FOLLOW, 1),            # the silent ones are at the next store: follow at once
    ([False, True], True, FOLLOW, 2),      # the latest store holding the run
    ([False], False, WAIT, None),          # they may not have moved yet
    ([None], True, WAIT, None),            # a store that does not answer cannot tell
    ([False, None], True, WAIT, None),
    ([False, False], True, GO, None),      # they are gone: go on (after claiming the later stores)
])
def test_a_minority_looks_at_the_later_stores(later, settled, action, to):
    verdict = drop_verdict(counted=4, kept=2, silent=2, settled=settled, later=later, first_later=1)
    assert (verdict.action, verdict.to) == (action, to)
    assert (verdict.why != "") == (action == WAIT)


def test_the_minority_waits_for_the_silent_ones_to_have_moved():
    assert settle_s(failover_s=30, sync_deadline=60, heartbeat_timeout=10) == (40, 70)


def test_a_stale_arrival_and_going_back():
    claim = Stayed("run-1", index=0, version=5)
    assert stale_arrival(claim, "run-1", last_version=4, here=1)
    assert not stale_arrival(claim, "run-1", last_version=5, here=1)     # it was in that world: the claim is old
    assert not stale_arrival(claim, "run-2", last_version=4, here=1)     # another run's
    assert not stale_arrival(None, "run-1", last_version=4, here=1)
    assert may_go_back("run-1", left_version=4, held_run="run-1", held_version=5, moved_on=False)
    assert not may_go_back("run-1", left_version=4, held_run="run-1", held_version=4, moved_on=False)
    assert not may_go_back("run-1", left_version=4, held_run="run-1", held_version=5, moved_on=True)
    assert not may_go_back("run-1", left_version=4, held_run="run-9", held_version=5, moved_on=False)


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"run": "r", "index": -1, "version": 3}',
                                 b'{"run": "", "index": 0, "version": 3}', b'{"run": "r", "index": true, "version": 3}',
                                 b'{"run": "r", "index": 0, "version": 1e30}'])
def test_a_malformed_claim_reads_as_none(raw):
    assert Stayed.decode(raw) is None


# -- shapes, with real memberships -----------------------------------------------------------------------------
class Cut:
    """Which node is cut from which store (by index in elastic.addr), shared by every gate."""

    def __init__(self) -> None:
        self.pairs: set[tuple[str, int]] = set()
        self.lock = threading.Lock()

    def __call__(self, uid: str, index: int) -> bool:
        with self.lock:
            return (uid, index) in self.pairs

    def set(self, uids, index: int, on: bool) -> None:
        with self.lock:
            for uid in uids:
                (self.pairs.add if on else self.pairs.discard)((uid, index))


class Gated:
    """A node's client of one store: every operation fails while the node is cut from that store."""

    def __init__(self, inner, cut: Cut, uid: str, index: int) -> None:
        self._inner, self._cut, self._uid, self._index = inner, cut, uid, index

    def __getattr__(self, name):
        op = getattr(self._inner, name)

        def gated(*args, **kwargs):
            if self._cut(self._uid, self._index):
                raise dist.DistStoreError(f"cut from store {self._index}")
            return op(*args, **kwargs)

        return gated


class GatedStores(StoreList):
    """A node's StoreList whose looks at other stores pass the same gate."""

    cut: Cut
    uid: str

    def peek(self, index: int, namespace: str) -> Snapshot | None:
        return None if self.cut(self.uid, index) else super().peek(index, namespace)

    def claim(self, index: int, namespace: str, record: str) -> bool:
        return not self.cut(self.uid, index) and super().claim(index, namespace, record)


def _master():
    # As `zb store` hosts one: torch's own listening socket has a short backlog, and four nodes' clients and
    # looks at once outgrow it (the 25th client of an in-process master waits forever).
    return host("127.0.0.1", 0)


class Partitioned:
    """Four nodes over two stores (the second a standby), with a gate per node and store."""

    def __init__(self, uids=("a", "b", "c", "d")) -> None:
        self.stores = [_master(), _master()]
        self.addresses = [StoreAddress("127.0.0.1", s.port) for s in self.stores]
        self.cut = Cut()
        self.nodes: dict[str, Membership] = {}
        self.beats: list[Heartbeat] = []
        self.seen: dict[str, list[tuple[int, int, tuple[str, ...]]]] = {u: [] for u in uids}   # (store, version, nodes)
        for uid in uids:
            self._add(uid)
        worlds = self._together(list(uids), lambda m: m.join(quorum=len(uids), quorum_timeout=10.0))
        assert all(isinstance(w, World) for w in worlds.values()), worlds
        self.start = next(iter(worlds.values()))

    def _add(self, uid: str) -> None:
        stores = GatedStores(self.addresses, CFG.store_failover_s)
        stores.cut, stores.uid = self.cut, uid

        def connect():
            index = stores.index
            if self.cut(uid, index):
                raise StoreUnreachable(f"cut from store {index}")
            return Gated(stores.connect(30.0, 30.0), self.cut, uid, index)   # a busy machine accepts slowly

        m = Membership(CFG, uid, f"tok-{uid}", 1, Liveness(CFG.heartbeat_timeout), connect, stores=stores)
        hb = Heartbeat(uid, CFG.heartbeat_interval, m.liveness, connect,
                       lambda: list(m.world.nodes) if m.world else [], answered=stores.answered,
                       store_index=lambda: stores.index)
        m.heartbeat = hb
        hb.start()
        self.nodes[uid] = m
        self.beats.append(hb)

    def _together(self, uids, fn) -> dict:
        return each_at_once(self.nodes, uids, fn, CFG.store_timeout + 30)

    def outer_steps(self, until, bound: float = 40.0, uids=None) -> dict:
        """Every node (of `uids`) resolves as at its outer steps (an unreachable store: it tries again, as a node that may
        not train on waits for it) until `until(world)` holds for the world it got, or `bound` s passed."""
        def steps(m: Membership):
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline:
                try:
                    world = m.resolve()
                except StoreUnreachable:
                    time.sleep(0.1)
                    continue
                self.seen[m.uid].append((m.stores.index, world.version, tuple(world.nodes)))
                if until(world):
                    return world
                time.sleep(0.05)
            return TimeoutError(f"{m.uid}: no such world in {bound} s")
        return self._together(list(uids or self.nodes), steps)

    def heal_after(self, seconds: float, pairs) -> threading.Timer:
        timer = threading.Timer(seconds, lambda: [self.cut.set(uids, i, False) for uids, i in pairs])
        timer.start()
        return timer

    def world_on(self, index: int) -> World | None:
        client = dist.TCPStore("127.0.0.1", self.stores[index].port, use_libuv=True, timeout=timedelta(seconds=10))
        return World.decode(client.get(keys.WORLD)) if client.check([keys.WORLD]) else None

    def split(self) -> list[tuple]:
        """Worlds that went on apart: two worlds some node got, on different stores or versions, with
        disjoint members, each of more than one resolution."""
        worlds = {(s, v, n) for seen in self.seen.values() for s, v, n in seen}
        return [(w1, w2) for w1 in worlds for w2 in worlds if w1 < w2 and not set(w1[2]) & set(w2[2])]

    def close(self) -> None:
        for hb in self.beats:
            hb.stop()


@pytest.fixture
def four(monkeypatch):
    # The gates cut a store at once; nothing here is a store that goes silent, so a longer floor for an operation
    # (a handshake included) costs no shape anything, and a busy machine (a load of 10 on 2 cores) whose
    # in-process store answered a handshake after 5 s no longer splits the fixture's join over two stores.
    monkeypatch.setattr(stores_module, "OP_FLOOR_S", 30.0)
    p = Partitioned()
    yield p
    p.close()


def _all_four(world: World) -> bool:
    return len(world.nodes) == 4


def test_half_cut_from_the_store_all_follow_to_the_next_one(four):
    """c and d lose store 0 (a and b keep it): they move to store 1; a and b, no majority, find them there
    and follow instead of training on without them."""
    four.cut.set(["c", "d"], 0, True)
    out = four.outer_steps(_all_four)
    assert all(isinstance(w, World) for w in out.values()), out
    assert {w.encode() for w in out.values()} == {out["a"].encode()}       # one world, read by all
    assert all(m.stores.index == 1 for m in four.nodes.values())
    old = four.world_on(0)
    assert old is not None and old.version == four.start.version           # store 0's world never dropped c, d
    assert not four.split(), four.split()


def test_one_cut_from_the_store_goes_back_when_it_answers_again(four):
    """d alone loses store 0: a, b and c (a majority) drop it and go on; d waits at store 1 for a majority
    that never comes, and once store 0 answers it again, goes back and rejoins there."""
    four.cut.set(["d"], 0, True)
    timer = four.heal_after(CFG.heartbeat_timeout * 3, [(["d"], 0)])
    out = four.outer_steps(_all_four)
    timer.cancel()
    assert all(isinstance(w, World) for w in out.values()), out
    assert {w.encode() for w in out.values()} == {out["a"].encode()}
    assert all(m.stores.index == 0 for m in four.nodes.values())
    assert four.world_on(1) is None                                        # d never re-formed at store 1
    assert any(n == ("a", "b", "c") or set(n) == {"a", "b", "c"} for _, _, n in four.seen["a"])
    assert not four.split(), four.split()


def test_both_sides_wait_while_the_minority_cannot_see_the_next_store(four):
    """c and d lose store 0 and move to store 1, which a and b cannot reach: neither side is a majority it can
    prove, so nobody trains apart; once a and b reach store 1 they find c and d there and follow."""
    four.cut.set(["c", "d"], 0, True)
    four.cut.set(["a", "b"], 1, True)
    timer = four.heal_after(sum(settle_s(CFG.store_failover_s, CFG.sync_deadline, CFG.heartbeat_timeout)),
                            [(["a", "b"], 1)])
    out = four.outer_steps(_all_four)
    timer.cancel()
    assert all(isinstance(w, World) for w in out.values()), out
    assert {w.encode() for w in out.values()} == {out["a"].encode()}
    assert all(m.stores.index == 1 for m in four.nodes.values())
    old = four.world_on(0)
    assert old is not None and old.version == four.start.version           # a and b never went on without c, d
    assert not any(store == 0 and len(n) < 4 for seen in four.seen.values() for store, _, n in seen)
    assert not four.split(), four.split()


def test_a_minority_that_went_on_sends_late_movers_back(four):
    """c and d are cut from both stores: a and b, after the wait, find no later store holding the run, claim
    store 1 and train on. c and d then reach store 1 only: the claim sends them back, and they rejoin at
    store 0 once it answers them, instead of re-forming a second world at store 1."""
    four.cut.set(["c", "d"], 0, True)
    four.cut.set(["c", "d"], 1, True)
    settle = sum(settle_s(CFG.store_failover_s, CFG.sync_deadline, CFG.heartbeat_timeout))
    timer1 = four.heal_after(settle + 4, [(["c", "d"], 1)])
    timer0 = four.heal_after(settle + 10, [(["c", "d"], 0)])
    out = four.outer_steps(_all_four, bound=60)
    timer1.cancel()
    timer0.cancel()
    assert all(isinstance(w, World) for w in out.values()), out
    assert {w.encode() for w in out.values()} == {out["a"].encode()}
    assert all(m.stores.index == 0 for m in four.nodes.values())
    assert four.world_on(1) is None                                        # no second world at store 1
    assert any(set(n) == {"a", "b"} for _, _, n in four.seen["a"])          # a and b went on alone meanwhile
    assert not four.split(), four.split()


def test_two_drops_in_a_row_count_the_first_one(four):
    """d loses store 0, then c: each drop alone keeps a majority of the world before it (3 of 4, then 2 of 3), but
    c and d may meet at store 1 as a majority of the world d last knew. The second drop counts d too, so a and b,
    half of it, look at store 1, find them and follow; and at store 1, d (not in c's last world) does not make
    c a majority of it. One world, at store 1, never a, b training on alone at store 0."""
    four.cut.set(["d"], 0, True)
    out = four.outer_steps(lambda w: "d" not in w.nodes and len(w.nodes) == 3, uids=["a", "b", "c"])
    assert all(isinstance(w, World) for w in out.values()), out
    assert four.world_on(0).silent == {"d": four.start.version}
    four.cut.set(["c"], 0, True)
    out = four.outer_steps(_all_four, bound=60)
    assert all(isinstance(w, World) for w in out.values()), out
    assert {w.encode() for w in out.values()} == {out["a"].encode()}
    assert all(m.stores.index == 1 for m in four.nodes.values())
    assert not any(store == 0 and set(n) == {"a", "b"} for seen in four.seen.values() for store, _, n in seen)
    assert not four.split(), four.split()
