"""Unit tests of DiLoCo's pure parts: the check-in plan, data slots, the fingerprint, the schedule."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from conftest import free_port
from zb.config import load_config
from zb.diloco import slots
from zb.diloco.checkin import CONTRIBUTOR, NEEDS_STATE, RECOVERED, make_plan
from zb.diloco.fingerprint import check_against, encode, fingerprint
from zb.errors import EnvironmentFailure, InvalidInput


def test_plan_static_world():
    plan = make_plan([CONTRIBUTOR] * 3, [4, 4, 4], [40, 40, 40])
    assert plan.contributors == plan.appliers == [0, 1, 2] and plan.receivers == [] and plan.donor is None


def test_plan_blocking_joiner_receives_from_lowest_contributor():
    plan = make_plan([NEEDS_STATE, CONTRIBUTOR, CONTRIBUTOR], [0, 4, 4], [0, 40, 40])
    assert plan.contributors == [1, 2] and plan.appliers == [1, 2]
    assert plan.receivers == [0] and plan.donor == 1 and (plan.run_outer_step, plan.run_step) == (4, 40)


def test_plan_recovered_joiner_applies_only_when_current():
    current = make_plan([CONTRIBUTOR, RECOVERED], [4, 4], [40, 35])
    assert current.appliers == [0, 1] and current.receivers == []
    stale = make_plan([CONTRIBUTOR, RECOVERED], [5, 4], [50, 35])
    assert stale.appliers == [0] and stale.receivers == [1] and stale.donor == 0


def test_plan_without_contributors():
    fresh = make_plan([NEEDS_STATE, NEEDS_STATE], [0, 0])
    assert fresh.contributors == [0, 1] and fresh.receivers == []
    survivors = make_plan([NEEDS_STATE, RECOVERED], [0, 7], [0, 70])
    assert survivors.contributors == [1] and survivors.receivers == [0] and survivors.donor == 1


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
