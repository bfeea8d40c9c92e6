"""Unit tests of DiLoCo's pure parts: the check-in plan, data slots, the fingerprint, the schedule."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from zb.config import load_config
from zb.diloco import slots
from zb.diloco.checkin import Arrived, Role, make_plan
from zb.errors import EnvironmentFailure, InvalidInput
from zb.fingerprint import check_against, encode, fingerprint
from zb.testing.procs import free_port


def test_plan_static_world():
    plan = make_plan([Role.CONTRIBUTOR] * 3, [4, 4, 4], [40, 40, 40])
    assert plan.contributors == plan.appliers == [0, 1, 2] and plan.receivers == [] and plan.donor is None


def test_plan_blocking_joiner_receives_from_lowest_contributor():
    plan = make_plan([Role.NEEDS_STATE, Role.CONTRIBUTOR, Role.CONTRIBUTOR], [0, 4, 4], [0, 40, 40])
    assert plan.contributors == [1, 2] and plan.appliers == [1, 2]
    assert plan.receivers == [0] and plan.donor == 1 and (plan.run_outer_step, plan.run_step) == (4, 40)


def test_plan_recovered_joiner_applies_only_when_current():
    current = make_plan([Role.CONTRIBUTOR, Role.RECOVERED], [4, 4], [40, 35])
    assert current.appliers == [0, 1] and current.receivers == []
    stale = make_plan([Role.CONTRIBUTOR, Role.RECOVERED], [5, 4], [50, 35])
    assert stale.appliers == [0] and stale.receivers == [1] and stale.donor == 0


def test_plan_applies_the_average_in_flight_only_when_every_contributor_holds_it():
    """diloco.overlap: a transfer can end on some nodes and fail on others; nobody applies it then.
    Non-contributors (a joiner, a receiver) never held it and do not count."""
    ok = make_plan([Role.CONTRIBUTOR] * 3, [4, 4, 4], arrived=[Arrived.OK] * 3)
    assert ok.average_ok
    one_failed = make_plan([Role.CONTRIBUTOR] * 3, [4, 4, 4], arrived=[Arrived.OK, Arrived.FAILED, Arrived.OK])
    assert not one_failed.average_ok
    first_round = make_plan([Role.CONTRIBUTOR] * 2, [1, 1], arrived=[Arrived.NONE] * 2)
    assert not first_round.average_ok
    joiner = make_plan([Role.CONTRIBUTOR, Role.CONTRIBUTOR, Role.NEEDS_STATE], [4, 4, 0], arrived=[Arrived.OK, Arrived.OK, Arrived.NONE])
    assert joiner.average_ok and joiner.receivers == [2]
    lagging = make_plan([Role.CONTRIBUTOR] * 3, [4, 4, 3], arrived=[Arrived.OK, Arrived.OK, Arrived.FAILED])
    assert lagging.average_ok and lagging.contributors == [0, 1], "a lagging node's flag is not the run's"


def test_plan_without_contributors():
    fresh = make_plan([Role.NEEDS_STATE, Role.NEEDS_STATE], [0, 0])
    assert fresh.contributors == [0, 1] and fresh.receivers == []
    survivors = make_plan([Role.NEEDS_STATE, Role.RECOVERED], [0, 7], [0, 70])
    assert survivors.contributors == [1] and survivors.receivers == [0] and survivors.donor == 1


def test_plan_contributor_behind_the_run_receives_the_state():
    # Frozen past the heartbeat timeout and back at its own old outer step 11 while two others went on.
    plan = make_plan([Role.CONTRIBUTOR] * 3, [20, 11, 20], [200, 110, 200])
    assert plan.contributors == [0, 2] and plan.receivers == [1] and plan.donor == 0
    assert (plan.run_outer_step, plan.run_step) == (20, 200) and plan.discredited() == []
    # Even when the stale node has the lowest rank, the run's position is the majority's.
    assert make_plan([Role.CONTRIBUTOR, Role.CONTRIBUTOR, Role.CONTRIBUTOR], [11, 20, 20]).receivers == [0]


def test_plan_a_claim_of_being_ahead_never_outvotes_the_others():
    """Issue 40: an insider that says it is 1000 outer steps ahead was the donor of every round and the honest
    nodes took its state. Now the run stands where most contributors stand; the one ahead receives that
    state and its claim is discredited (it counts toward eviction)."""
    liar = make_plan([Role.CONTRIBUTOR] * 3, [1007, 7, 7], [10070, 70, 70])
    assert liar.contributors == [1, 2] and liar.donor == 2 and liar.receivers == [0]   # in turn: 7 % 2
    assert (liar.run_outer_step, liar.run_step) == (7, 70) and liar.ahead == [0] and liar.discredited() == [0]
    # Two nodes: neither outvotes the other, and the older position is kept (a claim of being ahead is what a
    # liar makes; on a whole-run restart from checkpoints of different steps the newer one loses its extra).
    pair = make_plan([Role.CONTRIBUTOR] * 2, [20, 11], [200, 110])
    assert pair.contributors == [1] and pair.receivers == [0] and pair.run_outer_step == 11
    # Four nodes, two ahead: an even split keeps the older; three of four ahead move the run.
    assert make_plan([Role.CONTRIBUTOR] * 4, [9, 9, 8, 8]).run_outer_step == 8
    assert make_plan([Role.CONTRIBUTOR] * 4, [9, 9, 9, 8]).run_outer_step == 9


def test_plan_the_run_step_is_the_contributors_median_not_the_first_ones():
    plan = make_plan([Role.CONTRIBUTOR] * 3, [7, 7, 7], [250, 70, 70])
    assert plan.run_step == 70 and plan.donor is None


def test_plan_contributor_with_other_params_receives_from_the_majority():
    plan = make_plan([Role.CONTRIBUTOR] * 3, [7, 7, 7], [70, 70, 70], [5, 9, 5])
    assert plan.contributors == [0, 2] and plan.receivers == [1] and plan.donor == 2   # in turn: 7 % 2
    # The donor is taken in turn by outer step: one that lies about its params is not the donor twice in a row.
    assert make_plan([Role.CONTRIBUTOR] * 3, [8, 8, 8], [80, 80, 80], [5, 9, 5]).donor == 0
    tie = make_plan([Role.CONTRIBUTOR] * 2, [7, 7], [70, 70], [9, 5])
    assert tie.contributors == [0] and tie.receivers == [1], "a tie goes to the lowest rank's params"
    unknown = make_plan([Role.CONTRIBUTOR] * 2, [7, 7], [70, 70], [0, 5])
    assert unknown.contributors == [0, 1], "a node that did not hash (drift guard off) is not judged"
    recovered = make_plan([Role.CONTRIBUTOR, Role.CONTRIBUTOR, Role.RECOVERED], [7, 7, 7], None, [5, 5, 6])
    assert recovered.appliers == [0, 1] and recovered.receivers == [2]


def test_check_in_carries_digests_over_a_real_group():
    import threading

    from zb.diloco.checkin import check_in, digest_value

    port, plans = free_port(), {}
    master = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=10), use_libuv=True,
                           wait_for_workers=False)

    def rank(r: int) -> None:
        store = master if r == 0 else dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), r, 2, timedelta(seconds=10))
        digest = digest_value(bytes([r + 1] * 32))
        plans[r] = check_in(pg, r, 2, Role.CONTRIBUTOR, outer_step=3, step=30, deadline_s=10.0, digest=digest)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert plans[0] == plans[1] and plans[0].contributors == [0] and plans[0].receivers == [1]


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10), use_libuv=True)


def test_slots_are_kept_reused_and_exclusive(store):
    assert slots.claim_slot(store, "a", ["a"], 3, preferred=1) == 1
    assert slots.claim_slot(store, "b", ["a", "b"], 3, preferred=1) in (0, 2)
    assert slots.claim_slot(store, "a", ["a", "b"], 3) == 1, "a node keeps its own slot"
    slots.save_position(store, 1, 0, {"doc": 17})
    # "a" died: a newcomer may take its slot and continues from its position.
    assert slots.claim_slot(store, "c", ["b", "c"], 3, preferred=1) == 1
    assert slots.load_position(store, 1, 0) == {"doc": 17}
    with pytest.raises(EnvironmentFailure, match="no free data slot"):
        slots.claim_slot(store, "d", ["b", "c", "x"], 2)


def test_fingerprint_names_the_differing_keys():
    a = fingerprint(load_config([], {"diloco.inner_steps": "10"}, environ={}), 2, 320)
    b = fingerprint(load_config([], {"diloco.inner_steps": "10", "model.n_layers": "3", "optim.lr": "1e-2"},
                                environ={}), 2, 320)
    check_against(a, encode(a))
    with pytest.raises(InvalidInput, match="model.n_layers") as e:
        check_against(b, encode(a))
    assert "optim.lr" not in str(e.value), "the LR may differ per node"
    # A long value (a swarm stage's parameter list) is cut: the message stays one readable line.
    with pytest.raises(InvalidInput, match=r"stage_params \(run: 'a{56}\.\.\. \(402 chars\)") as e:
        check_against({**a, "stage_params": "b" * 400}, encode({**a, "stage_params": "a" * 400}))
    assert len(str(e.value)) < 300
    # A node of another wire format (an older build's fingerprint has no such key) is refused, naming it.
    older = {k: v for k, v in a.items() if k != "wire_format"}
    with pytest.raises(InvalidInput, match=r"wire_format \(run: .*, this node: 2\)"):
        check_against(a, encode(older))


def test_live_recovery_that_cannot_catch_up_falls_back_instead_of_failing(monkeypatch, tmp_path):
    """The run moves on and prunes the step being fetched: each such miss is a try at the newer step;
    after FETCH_ROUNDS the joiner uses the blocking transfer (None) instead of exiting 1. A run that
    stands still while no peer serves its step is a real failure."""
    from zb.diloco import live

    steps = iter([20, 30, 40, 50])
    monkeypatch.setattr(live, "read_progress", lambda store: (lambda s: {"step": s, "outer_step": s // 10})(next(steps)))
    asked = []

    def gone(peers, token, dest, *, expect_step, **kw):
        asked.append(expect_step)
        raise EnvironmentFailure(f"no peer serves a snapshot of step {expect_step}")

    monkeypatch.setattr(live, "fetch_snapshot", gone)
    assert live._fetch_current(None, ["p"], "t", tmp_path, {"step": 10, "outer_step": 1}, "fp") is None
    assert asked == [10, 20, 30]
    monkeypatch.setattr(live, "read_progress", lambda store: {"step": 10, "outer_step": 1})
    with pytest.raises(EnvironmentFailure, match="step 10"):
        live._fetch_current(None, ["p"], "t", tmp_path, {"step": 10, "outer_step": 1}, "fp")


def test_fragments_stride_the_blocks_and_balance_the_rest():
    from zb.diloco.streaming import fragment_of_params

    names = ["tok_embeddings.weight", *[f"layers.{i}.attention.wq.weight" for i in range(4)], "norm.weight",
             "output.weight"]
    numels = [1000, 10, 10, 10, 10, 1, 1000]
    owner = fragment_of_params(names, numels, 2)
    assert owner[1:5] == [0, 1, 0, 1], "block i goes to fragment i mod P"
    assert owner[0] != owner[6], "the two large non-block params go to different fragments"
    assert fragment_of_params(names, numels, 2) == owner, "a pure function: every node gets the same layout"
    assert set(fragment_of_params(names, numels, 1)) == {0}


def test_streaming_sync_points_launch_tau_steps_before_each_fragment_syncs():
    from types import SimpleNamespace

    from zb.diloco.streaming import StreamingOverlap

    sched = SimpleNamespace(cfg=SimpleNamespace(inner_steps=12, fragments=3, fragment_delay=2), per=4)
    points = {s: StreamingOverlap.sync_points(sched, s) for s in range(1, 25)}
    launches = [s for s, (launch, _) in points.items() if launch is not None]
    applies = [s for s, (_, apply) in points.items() if apply is not None]
    assert launches == [2, 6, 10, 14, 18, 22] and applies == [4, 8, 12, 16, 20, 24]
    assert [points[s][1] for s in applies] == [0, 1, 2, 0, 1, 2]
    assert [points[s][0] for s in launches] == [0, 1, 2, 0, 1, 2]
    blocking = SimpleNamespace(cfg=SimpleNamespace(inner_steps=4, fragments=1, fragment_delay=0), per=4)
    assert StreamingOverlap.sync_points(blocking, 8) == (0, 0), "tau = 0: launch and apply at the same step"


def test_streaming_settings_are_checked():
    with pytest.raises(InvalidInput, match="diloco.fragments"):
        load_config([], {"diloco.overlap": "streaming", "diloco.inner_steps": "10", "diloco.fragments": "3"},
                    environ={})
    with pytest.raises(InvalidInput, match="diloco.fragment_delay"):
        load_config([], {"diloco.overlap": "streaming", "diloco.inner_steps": "10", "diloco.fragments": "2",
                         "diloco.fragment_delay": "5"}, environ={})
    with pytest.raises(InvalidInput, match="diloco.fragment_alpha"):
        load_config([], {"diloco.overlap": "streaming", "diloco.fragment_alpha": "1.5"}, environ={})
