"""The membership protocol's decision paths in one process: real `Membership` objects and heartbeat
threads over one in-process TCPStore, each node a thread. A dead leader, a node evicted while frozen
and a joiner take a second or two here instead of a process cluster's tens of seconds; the process
tests (tests/test_elastic_mesh.py) keep what needs processes: signals, the deathrattle, the gloo groups."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from zb.config_schema import ElasticConfig
from zb.elastic import keys, standby
from zb.elastic.heartbeat import Heartbeat, Liveness
from zb.elastic.membership import Membership
from zb.elastic.roll_call import RollCall, events_bound, wait_key
from zb.elastic.store_state import Finished, finished_without
from zb.elastic.world import World
from zb.errors import RunFinishedWithout
from zb.signed_store import authenticated, prefixed
from zb.swarm.registry import stage_namespace
from zb.testing.store_count import Tally
from zb.testing.threads import each_at_once

# A live member beats 15 times per timeout: a busy machine does not make it look dead.
CFG = ElasticConfig(store_timeout=60, polling_interval=0.02, sync_deadline=5, heartbeat_interval=0.2,
                    heartbeat_timeout=3.0)


class Members:
    """Nodes of one run: each a Membership and the heartbeat thread that keeps it alive."""

    def __init__(self, store: dist.TCPStore | None = None, namespace: str = "", secret: bytes | None = None) -> None:
        """`store`: another run's (several runs, each in its `namespace`, on one store); `secret`: the run's."""
        self.store = store or dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=10))
        self.namespace, self.secret = namespace, secret
        self.nodes: dict[str, Membership] = {}
        self.beats: dict[str, Heartbeat] = {}

    def client(self):
        client = self.raw()
        if self.secret is not None:
            client = authenticated(client, self.secret, "test", keys.is_counter)
        return prefixed(client, self.namespace) if self.namespace else client

    def raw(self):
        """A client of someone who reaches the store without the run's secret."""
        return dist.TCPStore("127.0.0.1", self.store.port, use_libuv=True, timeout=timedelta(seconds=10))

    def add(self, uid: str) -> Membership:
        m = Membership(CFG, uid, f"tok-{uid}", 1, Liveness(CFG.heartbeat_timeout), self.client)
        self.nodes[uid] = m
        self.beat(uid)
        return m

    def beat(self, uid: str) -> None:
        m = self.nodes[uid]
        hb = Heartbeat(uid, CFG.heartbeat_interval, m.liveness, self.client,
                       lambda: list(m.world.nodes) if m.world else [])
        m.heartbeat, self.beats[uid] = hb, hb
        hb.start()

    def freeze(self, uid: str) -> None:
        """The node stops beating (SIGSTOP, a dead process): its counter stands still."""
        self.beats[uid].stop()

    def together(self, uids: list[str], fn) -> dict[str, World]:
        out = each_at_once(self.nodes, uids, fn, CFG.store_timeout)
        errors = [e for e in out.values() if isinstance(e, BaseException)]
        if errors:
            raise errors[0]
        return out

    def close(self) -> None:
        for hb in self.beats.values():
            hb.stop()


@pytest.fixture
def members():
    run = Members()
    yield run
    run.close()


def start(members: Members, uids: list[str]) -> dict[str, World]:
    for uid in uids:
        members.add(uid)
    return members.together(uids, lambda m: m.join(quorum=len(uids), quorum_timeout=10.0))


def outer_steps_until_admitted(m: Membership, uid: str) -> World:
    """A member resolves at each outer step; the first resolution after `uid`'s request admits it. Bounded by
    a generous time, not a count of resolutions: on a loaded machine the joiner's thread may take a while to
    write its request while resolutions with nothing new return at once."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        world = m.resolve()
        if uid in world.nodes:
            return world
    raise AssertionError(f"{uid} was never admitted")


def test_the_next_in_line_leads_when_the_leader_dies(members):
    worlds = start(members, ["a", "b", "c"])
    leader = worlds["b"].leader
    assert {w.nodes[0] for w in worlds.values()} == {leader}
    members.freeze(leader)          # dead: no beat, no check-in
    survivors = [u for u in worlds["a"].nodes if u != leader]   # in rank order: the next in line first
    after = members.together(survivors, lambda m: m.resolve())
    assert all(w.nodes == survivors and leader in w.died for w in after.values())
    assert {w.leader for w in after.values()} == {survivors[0]}
    assert all(w.version > worlds["a"].version for w in after.values())


def test_a_node_evicted_while_frozen_rejoins_as_a_joiner(members):
    start(members, ["a", "b", "c"])
    members.freeze("c")
    evicted = members.together(["a", "b"], lambda m: m.resolve())
    assert sorted(evicted["a"].nodes) == ["a", "b"] and evicted["a"].died == ["c"]
    members.beat("c")               # c wakes up: it beats again and reaches its next outer step
    back = members.together(["a", "b", "c"], lambda m: m.resolve() if m.uid == "c"
                            else outer_steps_until_admitted(m, "c"))
    assert back["c"].nodes == back["a"].nodes and sorted(back["a"].nodes) == ["a", "b", "c"]
    assert back["c"].joined == ["c"]     # it receives the run's state before it contributes


def test_a_joiner_is_admitted_at_the_next_resolution(members):
    start(members, ["a", "b"])
    members.add("d")
    worlds = members.together(["a", "b", "d"], lambda m: m.join(quorum=1, quorum_timeout=10.0)
                              if m.uid == "d" else outer_steps_until_admitted(m, "d"))
    assert all(w.nodes == worlds["a"].nodes for w in worlds.values()) and sorted(worlds["a"].nodes) == ["a", "b", "d"]
    assert worlds["a"].joined == ["d"]


def test_a_node_of_an_older_world_stops_when_the_run_finished_without_it(members):
    """c was dropped (frozen, cut off) and the others finished the run in a later world: when c comes back it
    stops with one line instead of finding the world empty and training on alone; the nodes of the final world
    are not late."""
    start(members, ["a", "b", "c"])
    members.freeze("c")
    final = members.together(["a", "b"], lambda m: m.resolve())["a"]
    assert sorted(final.nodes) == ["a", "b"]
    assert members.nodes["a"].mark_finished(outer_step=12, step=120)
    assert members.nodes["b"].mark_finished(outer_step=12, step=120)      # the first record stays
    members.beat("c")
    with pytest.raises(RunFinishedWithout, match=r"finished without this node: .* outer step 12 \(step 120\)"):
        members.nodes["c"].resolve()
    # a and b finished it: not late. Both resolve (b alone would wait sync_deadline for a's check-in).
    assert all(w.version >= final.version for w in members.together(["a", "b"], lambda m: m.resolve()).values())


def test_each_stage_of_a_swarm_ends_in_its_own_namespace_and_its_late_worker_stops_without_a_resolution(members):
    """DiLoCo-SWARM: each stage is a DiLoCo run in a namespace of its own on the one store (zb.swarm.registry.
    stage_namespace). Stage 0 ends without its worker c: c stops at its next look at the store (check_finished:
    a first-stage worker whose later stages all left never reaches its next resolution), while stage 1, which
    has not ended, and the workers of stage 0's final world go on."""
    stage0 = Members(members.store, stage_namespace("", 0))
    stage1 = Members(members.store, stage_namespace("", 1))
    try:
        start(stage0, ["a", "b", "c"])
        start(stage1, ["c", "d"])                      # a worker id of stage 0 again: each stage has its own world
        stage0.freeze("c")
        final = stage0.together(["a", "b"], lambda m: m.resolve())["a"]
        assert stage0.nodes["a"].mark_finished(outer_step=3, step=30)
        stage0.beat("c")
        stage0.nodes["a"].check_finished()             # of the final world: not late
        with pytest.raises(RunFinishedWithout, match=r"finished without this node: its other nodes ended it at "
                                                     r"outer step 3 \(step 30\) at \d{4}-\d\d-\d\d .* UTC, in mesh "
                                                     rf"version {final.version} "):
            stage0.nodes["c"].check_finished()
        for m in stage1.nodes.values():
            m.check_finished()                         # stage 1's run has not ended
        assert sorted(stage1.together(["c", "d"], lambda m: m.resolve())["d"].nodes) == ["c", "d"]
        assert not members.store.check([keys.FINISHED])   # nothing at the store's root
    finally:
        stage0.close()
        stage1.close()


def test_the_run_end_record_is_checked_field_by_field():
    good = Finished("r1", 3, 12, 120, 1_700_000_000.0)
    assert Finished.decode(good.encode().encode()) == good
    for bad in [b"", b"[]", b"{", b'{"run": "r1"}', b'{"run": "", "version": 1, "outer_step": 1, "step": 1, "time": 1}',
                b'{"run": "r1", "version": -1, "outer_step": 1, "step": 1, "time": 1}',
                b'{"run": "r1", "version": true, "outer_step": 1, "step": 1, "time": 1}',
                b'{"run": "r1", "version": 1, "outer_step": 1, "step": 1, "time": 1e12}',
                b'{"run": "r1", "version": 1, "outer_step": "1", "step": 1, "time": 1}']:
        assert Finished.decode(bad) is None, bad


def test_only_a_node_of_an_older_world_of_the_same_run_is_late():
    done = Finished("r1", 5, 12, 120, 1.0)
    assert finished_without(done, World(version=4, nodes=["c"], run="r1"))
    assert not finished_without(done, World(version=5, nodes=["a"], run="r1"))   # the final world
    assert not finished_without(done, World(version=2, nodes=["c"], run="r2"))   # another run on this store
    assert not finished_without(done, None) and not finished_without(None, World(version=1, run="r1"))
    assert not finished_without(done, World(version=1, nodes=["c"], run=""))     # no run yet


def test_a_bumped_roll_call_counter_does_not_size_the_cleanup(members):
    """keys.roll_call_events is an unsealed counter: one `add` of 10**9 by anyone who reaches the store made the
    leader build and delete a billion key names (killed by the kernel at 22 GB). The cleanup stays bounded."""
    start(members, ["a", "b"])
    leader = members.nodes["a"]
    client = members.client()
    client.add(keys.roll_call_events(0), 10**9)
    deleted: list[str] = []
    real = leader.client

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def delete_key(self, key):
            deleted.append(key)
            return real.delete_key(key)

    RollCall(Counting(), 0).forget(2)
    assert len(deleted) == 3 + events_bound(2)   # the answers, the counter, the end's wake-up (written)


def test_a_roll_call_counter_that_is_no_integer_does_not_break_the_cleanup(members):
    """`add` on a value that is no integer makes the store drop the connection: the cleanup reads it instead."""
    start(members, ["a", "b"])
    members.client().set(keys.roll_call_events(0), b"x")
    leader = members.nodes["a"]
    RollCall(leader.client, 0).forget(2)
    assert leader.client.check([keys.WORLD])       # the same client still answers
    assert not members.client().check([keys.roll_call_events(0)])


def test_a_heartbeat_counter_written_with_junk_does_not_eject_its_node(members):
    """Anyone who reaches the store can write a node's heartbeat counter: a value that is no integer made the store
    drop every `add` of it, so the node stopped beating and was evicted as "STORE UNREACHABLE". Its heartbeat now
    starts the counter over, and the node stays in the world."""
    worlds = start(members, ["a", "b"])
    members.client().set(keys.heartbeat("b"), b"junk")
    beats, deadline = members.beats["b"].beats, time.monotonic() + 30
    while members.beats["b"].beats < beats + 1.5 * CFG.heartbeat_timeout / CFG.heartbeat_interval:   # past the timeout
        assert time.monotonic() < deadline, "b's heartbeat never beat again"
        time.sleep(CFG.heartbeat_interval)
    after = members.together(["a", "b"], lambda m: m.resolve())
    assert all(w.nodes == worlds["a"].nodes and w.version == worlds["a"].version for w in after.values()), after


def test_a_replayed_join_request_is_not_admitted(members):
    """Anyone who reaches the store can append: a copy of a node's old (sealed) join request appended again, with its
    heartbeat counter bumped so the node looks alive, admitted a dead node and stalled the run for the sync
    deadline at every outer step. A request is admissible for JOIN_FRESH resolutions only."""
    from zb.elastic.world import JOIN_FRESH

    start(members, ["a", "b"])
    members.add("d")
    members.together(["a", "b", "d"], lambda m: m.join(quorum=1, quorum_timeout=10.0)
                     if m.uid == "d" else outer_steps_until_admitted(m, "d"))
    raw = members.client()
    request = [line for line in raw.get(keys.JOINS).decode().splitlines() if json.loads(line).get("uid") == "d"][-1]
    members.freeze("d")                                   # d is gone: the others drop it
    for _ in range(JOIN_FRESH + 2):
        world = members.together(["a", "b"], lambda m: m.resolve())["a"]
    assert sorted(world.nodes) == ["a", "b"]
    raw.append(keys.JOINS, request + "\n")                # the replay, and d's counter kept moving by the attacker
    for _ in range(3):
        raw.add(keys.heartbeat("d"), 1)
        world = members.together(["a", "b"], lambda m: m.resolve())["a"]
        assert sorted(world.nodes) == ["a", "b"], world


def test_a_replayed_older_world_is_written_over_not_taken(members, caplog):
    """Issue 40: a world record is sealed to its key and run, not to its resolution, so an old one copied back over
    the current one opened, and every node took the old world (its resolution and mesh version went back). A
    world never goes back: the nodes write theirs over it and go on."""
    caplog.set_level("WARNING", logger="zb.elastic")
    start(members, ["a", "b"])
    raw = members.client()
    old = raw.get(keys.WORLD)
    for _ in range(3):
        before = members.together(["a", "b"], lambda m: m.resolve())["a"]
    raw.set(keys.WORLD, old)                               # the replay
    after = members.together(["a", "b"], lambda m: m.resolve())
    assert after["a"].encode() == after["b"].encode()
    assert after["a"].resolution == before.resolution + 1 and after["a"].version >= before.version
    assert World.decode(raw.get(keys.WORLD)).resolution == after["a"].resolution
    assert "a replayed record, written over with the current world" in caplog.text


@pytest.mark.parametrize("forged", ["junk", "unsealed"])
def test_a_world_record_that_is_no_world_is_written_over_not_read_as_a_restarted_store(forged, caplog):
    """A world record written by someone without the run secret does not open, so it read as absent: as a restarted
    store's. A node then rejoined and seeded a world of its own, the other wrote its own world back over that one (a
    replay, to it), and the run split: one node finished, the other exited 1 (tests/test_secret_run.py failed so,
    now and then). The key is there, so the store did not restart: the nodes write their world back and go on.
    Junk in a run without a secret is the same case."""
    caplog.set_level("WARNING", logger="zb.elastic")
    members = Members(secret=b"a run secret of thirty-two bytes" if forged == "unsealed" else None)
    try:
        start(members, ["a", "b"])
        raw = members.raw()
        for _ in range(2):
            before = members.together(["a", "b"], lambda m: m.resolve())["a"]
        record = json.loads(members.client().get(keys.WORLD))
        raw.set(keys.WORLD, b"junk" if forged == "junk" else json.dumps(
            dict(record, nodes=[*record["nodes"], "rogue"], version=record["version"] + 1)))
        after = members.together(["a", "b"], lambda m: m.resolve())
        assert after["a"].encode() == after["b"].encode()
        assert after["a"].resolution == before.resolution + 1 and after["a"].version == before.version
        assert sorted(after["a"].nodes) == ["a", "b"]
        assert World.decode(members.client().get(keys.WORLD)).resolution == after["a"].resolution
        assert "world record is no world" in caplog.text and "rejoining" not in caplog.text
    finally:
        members.close()


def test_a_leader_whose_connection_drops_after_its_write_keeps_its_place(members):
    """Found by the chaos harness's store-tamper event: junk written into the closing roll call's counter between the
    leader's write of the next world and its wake-up `add` there makes the store drop the leader's connection. The
    leader then read its own new world as one that "moved on without this node", rejoined under a new token, and
    every node logged it dead. A newer world that holds the node is this outer step's world: it takes it."""
    start(members, ["a", "b"])
    raw = members.client()
    leader = members.nodes[World.decode(raw.get(keys.WORLD)).nodes[0]]
    wrote = leader.write_world

    def write_then_junk(expected, new):
        ok = wrote(expected, new)
        raw.set(keys.roll_call_events(new.resolution - 1), b"junk")
        return ok

    leader.write_world = write_then_junk
    worlds = members.together(["a", "b"], lambda m: m.resolve())
    leader.write_world = wrote
    assert worlds["a"].encode() == worlds["b"].encode()
    assert not worlds["a"].died and not worlds["a"].joined, worlds["a"]
    again = members.together(["a", "b"], lambda m: m.resolve())
    assert again["a"].encode() == again["b"].encode() and not again["a"].died, again["a"]


def test_a_join_request_is_fresh_for_a_few_resolutions():
    from zb.elastic.world import JOIN_FRESH, JoinRequest

    request = JoinRequest("d", "tok-d", 0, seen=5)
    assert request.fresh(5) and request.fresh(5 + JOIN_FRESH) and not request.fresh(6 + JOIN_FRESH)


def test_a_roll_call_counter_written_with_junk_costs_one_attempt_not_the_run(members):
    """The current roll call's wake-up counter overwritten with junk: the `add` that answers it loses its connection,
    and the client made again starts that counter over, so the resolution still ends with every member."""
    worlds = start(members, ["a", "b"])
    members.client().set(keys.roll_call_events(worlds["a"].resolution), b"junk")
    after = members.together(["a", "b"], lambda m: m.resolve())
    assert all(sorted(w.nodes) == ["a", "b"] for w in after.values()), after


def test_a_wait_of_no_time_returns_at_once(members):
    """A joiner's wait is what is left of its pace, which can be spent by the time it waits: torch's TCPStore
    takes a zero or negative timeout as none and blocked the joiner for good (a lone node at the next store never
    gave up on the quorum under the suite's load)."""
    members.add("a").ensure_store()
    out = each_at_once(members.nodes, ["a"], lambda m: (wait_key(m.client, "zb/absent", 0.0), wait_key(m.client, "zb/absent", -1.0)),
                       timeout=20)
    assert out["a"] == (False, False)


@pytest.mark.parametrize("marker", [b"junk", b"999999", None])
def test_a_wrong_or_missing_end_marker_still_ends_every_resolution(members, marker):
    """keys.ENDED is a hint anyone reaching the store can overwrite or delete: junk (read as no roll call ended), one
    far ahead (every member takes the full path and judges) or none (the light reads go key by key). Each costs
    reads; every member still ends in the next world, twice over."""
    uids = ["a", "b", "c", "d", "e"]
    start(members, uids)
    for _ in range(2):
        if marker is None:
            members.client().delete_key(keys.ENDED)
        else:
            members.client().set(keys.ENDED, marker)
        after = members.together(uids, lambda m: m.resolve())
        assert len({w.encode() for w in after.values()}) == 1 and sorted(after["a"].nodes) == uids


def test_a_junk_end_marker_costs_a_read_not_a_busy_loop(members):
    """A member not in line whose roll call has ended (keys.written set) while keys.ENDED holds junk: the wait on
    keys.written decides, so it reads the world once and takes it: 8 requests, not a loop of reads that the
    hint keeps saying are early."""
    uids = ["a", "b", "c", "d", "e"]
    old = start(members, uids)["a"]
    last = old.nodes[-1]   # the last in rank order (the ring's, not the ids')
    after = members.together(uids, lambda m: m.resolve())["a"]
    node = members.nodes[last]
    assert not standby.judges(old, last, node.liveness, set())
    members.client().set(keys.ENDED, b"junk")
    tally = Tally()
    node.store = tally.client(node.client)
    taken = each_at_once(members.nodes, [last], lambda m: m._roll_call(old), timeout=30)[last]
    assert isinstance(taken, World) and taken.encode() == after.encode()
    assert tally.totals()["requests"] <= 8, tally.totals()
