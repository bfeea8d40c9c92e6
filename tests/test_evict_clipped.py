"""diloco.evict_clipped: the decision (zb.diloco.clip, a pure function of the check-in tables), the plan without
the evicted ranks (zb.diloco.checkin), and the generic membership feature it uses (zb.elastic: keys.EVICTED,
read like the goodbyes; the judge leaves those ids out and never admits them; the node itself is refused).
The whole path across DiLoCo nodes is in tests/test_node_inprocess.py."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from test_membership_inprocess import CFG, Members

from zb.diloco.checkin import Role, make_plan
from zb.diloco.clip import clipped_in_a_row, to_evict
from zb.elastic import keys
from zb.elastic.heartbeat import Liveness
from zb.elastic.judge import RoundDeadlines, admissible_joiners, judge, members_all_out
from zb.elastic.membership import Membership, exclude, refuse_if_evicted
from zb.elastic.store_state import Answer, Snapshot, encode_line, evicted_ids, read_snapshot
from zb.elastic.world import JoinRequest, World
from zb.errors import InvalidInput


def test_a_node_is_counted_only_while_clipped_in_a_row():
    counts: dict[str, int] = {}
    for clipped in (["b"], ["b", "c"], ["b"]):
        counts = clipped_in_a_row(counts, clipped)
    assert counts == {"b": 3}            # c was clipped once, then not: it starts again from zero
    assert clipped_in_a_row(counts, []) == {}


def test_to_evict_names_each_node_once_when_it_reaches_the_bound():
    assert to_evict({"b": 2, "c": 1}, 3) == []
    assert to_evict({"d": 3, "b": 4, "c": 2}, 3) == ["b", "d"]
    assert to_evict({"d": 3, "b": 4}, 3, evicted={"b"}) == ["d"]


def test_the_plan_leaves_evicted_ranks_out_of_every_role():
    contributor, joiner = Role.CONTRIBUTOR, Role.NEEDS_STATE
    plan = make_plan([contributor, contributor, contributor, joiner], [5, 5, 5, 0], norms=[1.0, 1000.0, 1.2, 0.0],
                     clip=2.0, evicted=[0])
    assert plan.contributors == [1, 2] and plan.appliers == [1, 2] and plan.receivers == [3] and plan.donor == 2
    assert plan.scales[0] == 1.0 and plan.clipped() == [1]     # the median is over the contributors left
    assert make_plan([contributor] * 3, [5] * 3).contributors == [0, 1, 2]


W = World(version=3, resolution=7, nodes=["a", "b", "c"], tokens={"a": "ta", "b": "tb", "c": "tc"}, join_cursor=0)
DL = RoundDeadlines(suspect_grace=1.0, sync_deadline=10.0, stuck_after=25.0)


def snap(answers=(), evicted=(), joins=()) -> Snapshot:
    return Snapshot(raw_world=W.encode().encode(), world=W, gone=set(), joins=list(joins), answers=list(answers),
                    evicted=set(evicted))


def test_the_judge_leaves_an_evicted_member_out_at_once_and_never_admits_its_id():
    live = Liveness(timeout=5.0)
    v = judge(W, snap([Answer("a", "ta"), Answer("c", "tc")], evicted={"b"}), "a", live, 0.1, DL)
    assert v.settled and v.observation.excluded == {"b"}        # not waited for: no deadline passed
    assert not judge(W, snap([Answer("a", "ta"), Answer("c", "tc")]), "a", live, 0.1, DL).settled
    v = judge(W, snap([Answer("b", "tb"), Answer("c", "tc")], evicted={"a"}), "c", live, 0.1, DL)
    assert v.acting_leader == "b" and "a" in v.observation.excluded
    v = judge(W, snap([Answer("a", "ta")], evicted={"a"}), "a", live, 0.1, DL)    # itself: not the leader either
    assert v.acting_leader == "b" and "a" in v.observation.excluded
    requests = [JoinRequest("b", "tb2", 0, seen=W.resolution), JoinRequest("d", "td", 1, seen=W.resolution)]
    assert [r.uid for r in admissible_joiners(W, snap(evicted={"b"}, joins=requests), live)] == ["d"]
    assert members_all_out(World(nodes=["b"], tokens={"b": "tb"}), snap(evicted={"b"}), live)


def test_the_list_is_read_with_the_snapshot_and_refuses_its_ids():
    store = dist.HashStore()
    assert read_snapshot(store, None).evicted == set()
    exclude(store, ["b"])
    exclude(store, ["b", "c"])           # an id listed already is not appended again
    assert store.get(keys.EVICTED) == b"b\nc\n" and read_snapshot(store, 4).evicted == {"b", "c"}
    assert evicted_ids(b"b\n\nnot one id\nc") == {"b", "c"}
    refuse_if_evicted("a", {"b", "c"})
    with pytest.raises(InvalidInput, match="the run evicted node id 'b'") as e:
        refuse_if_evicted("b", {"b", "c"})
    assert e.value.exit_code == 2


@pytest.fixture
def members():
    run = Members()
    yield run
    run.close()


def test_an_evicted_id_leaves_the_world_and_is_never_admitted_again(members):
    """Real Membership objects over one TCPStore: after `exclude`, the next resolution leaves b out without waiting
    for any deadline; b itself, at its next boundary or restarted under its id, is refused (exit 2); a request
    under its id that b appends anyway (a node that ignores the refusal) is read and never admitted."""
    for uid in ("a", "b", "c"):
        members.add(uid)
    members.together(["a", "b", "c"], lambda m: m.join(quorum=3, quorum_timeout=10.0))
    exclude(members.store, ["b"])
    t0 = time.monotonic()
    after = members.together(["a", "c"], lambda m: m.resolve())
    # mesh order follows join order (threads race), so compare sets; both must agree on the order itself
    assert after["a"].nodes == after["c"].nodes and sorted(after["a"].nodes) == ["a", "c"] and "b" in after["a"].died
    assert time.monotonic() - t0 < CFG.sync_deadline      # b was not waited for
    with pytest.raises(InvalidInput, match="the run evicted node id 'b'"):
        members.nodes["b"].resolve()
    restarted = Membership(CFG, "b", "tok-b2", 1, Liveness(CFG.heartbeat_timeout), members.client)
    with pytest.raises(InvalidInput, match="the run evicted node id 'b'"):
        restarted.join(quorum=1, quorum_timeout=1.0)
    members.store.append(keys.JOINS, encode_line({"uid": "b", "token": "tok-b3", "stripes": 1}))   # b still beats
    lines = len(members.store.get(keys.JOINS).decode().splitlines())
    again = members.together(["a", "c"], lambda m: m.resolve())
    assert sorted(again["a"].nodes) == ["a", "c"] and again["a"].join_cursor == lines


def test_a_mild_clip_of_an_honest_node_does_not_count_toward_eviction():
    """K = 1 scales every contribution above the median: honest nodes a few percent over it are clipped every
    round, but only a norm over clip.OUTSIZED x the median counts toward a node clipped in a row."""
    from zb.diloco.checkin import make_plan

    plan = make_plan([0, 0, 0, 0], [5] * 4, norms=[1.0, 1.03, 0.98, 1000.0], clip=1.0)
    assert plan.clipped() == [1, 3] and plan.outsized() == [3]
    assert make_plan([0, 0, 0], [5] * 3, norms=[1.0, 1.5, 1.9], clip=1.0).outsized() == []
