"""The outer-step template (zb.diloco.outer_step, issue 38): one order for every algorithm, run with a
scripted algorithm on the in-process fake world (tests/fake_world.py). An algorithm is asked what
differs and returns results; the node does the rest, always in the same order."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fake_world import TinyModel, start_world, together

from zb.collectives import PeerFailure
from zb.diloco.algorithm import Applied, NodeContext, OuterAlgorithm, Step
from zb.diloco.algorithms import ALGORITHMS
from zb.diloco.background import Arrival
from zb.diloco.checkin import Plan
from zb.diloco.sync import SyncStats
from zb.elastic.stores import may_train_on
from zb.elastic.view import WorldView
from zb.errors import EnvironmentFailure
from zb.events import OuterReport
from zb.overlap_modes import MODES, Blocking
from zb.position import RunPosition


class Scripted(OuterAlgorithm):
    """Records every question the template asks it; `fail` makes every exchange fail (every attempt)."""

    mode = Blocking
    exchanges = True

    def __init__(self, ctx: NodeContext, outer, calls: list[str], fail: bool = False):
        super().__init__(ctx, outer)
        self.calls, self.fail = calls, fail

    def arrive(self) -> Arrival | None:
        self.calls.append("arrive")
        return None

    def exchange(self, view: WorldView, plan: Plan) -> SyncStats:
        self.calls.append("exchange")
        if self.fail:
            raise PeerFailure("scripted failure", rank=None)
        return SyncStats()

    def note_arrival(self, report: OuterReport, arrival: Arrival | None) -> None:
        self.calls.append("note_arrival")

    def skip(self, attempts: int, closing: bool) -> None:
        self.calls.append(f"skip after {attempts}")

    def apply(self, step: Step) -> Applied:
        self.calls.append("apply")
        step.report.applied = True
        return Applied(caught_up=True)

    def handed_over(self, step: Step, got_state: bool) -> None:
        self.calls.append("handed_over")

    def launch(self, step: Step, received: RunPosition | None) -> None:
        self.calls.append("launch")

    def round_started(self, report: OuterReport, position: RunPosition) -> None:
        self.calls.append("round_started")


def _scripted(node, calls: list[str], fail: bool = False) -> None:
    """Swap the node's algorithm for a scripted one, and record when the node keeps its books."""
    steps = node.diloco.steps
    steps.algorithm = Scripted(node.diloco.algorithm.ctx, node.diloco.outer, calls, fail)
    keep_books = steps._keep_books

    def books(*args, **kwargs):
        calls.append("books")
        return keep_books(*args, **kwargs)

    steps._keep_books = books


def test_every_outer_step_runs_in_one_order():
    _, (a, b) = start_world(["a", "b"])
    calls = {"a": [], "b": []}
    for node in (a, b):
        _scripted(node, calls[node.uid])
    reports = together([a, b], lambda n: n.outer_step())
    expected = ["arrive", "exchange", "note_arrival", "apply", "handed_over", "books", "launch", "round_started"]
    assert calls["a"] == calls["b"] == expected
    assert all(r.applied and r.params_hash for r in reports)


def test_every_attempt_failing_skips_everything_after_the_check_in():
    _, (a,) = start_world(["a"], **{"diloco.retry_all_reduce": "1"})
    calls: list[str] = []
    _scripted(a, calls, fail=True)
    report = a.outer_step()
    assert calls == ["arrive", "exchange", "exchange", "note_arrival", "skip after 2", "round_started"]
    assert not report.applied and report.attempts == 2


def test_the_run_end_applies_what_is_in_flight_and_skips_the_books():
    world, nodes = start_world(["a", "b"], **{"diloco.overlap": "delayed"})
    for node, move in zip(nodes, [torch.full((TinyModel().flat().numel(),), 0.01)] * 2):
        node.train(move)
    together(nodes, lambda n: n.outer_step())
    calls: list[str] = []
    steps = nodes[0].diloco.steps
    keep_books = steps._keep_books
    steps._keep_books = lambda *a, **k: calls.append("books") or keep_books(*a, **k)
    reports = together(nodes, lambda n: n.diloco.close_run(n.position))
    assert all(r is not None and r.applied for r in reports) and calls == []
    assert together(nodes, lambda n: n.diloco.close_run(n.position)) == [None, None]   # nothing in flight now


def test_every_mode_has_an_algorithm_and_every_algorithm_a_mode():
    assert set(ALGORITHMS) == set(MODES)
    assert all(ALGORITHMS[name].mode is MODES[name] for name in MODES)


def _cut_from_store(node, resolves: int) -> list[bool]:
    """The node's next `resolves` resolutions find the store silent (the previous world, store_ok False); the
    store_ok of every resolution is recorded."""
    real, left, seen = node.mesh.resolve, [resolves], []

    def resolve() -> WorldView:
        view = real()
        if left[0] > 0:
            left[0] -= 1
            view = dataclasses.replace(view, store_ok=False)
        seen.append(view.store_ok)
        return view

    node.mesh.resolve = resolve
    node.diloco.steps.fresh_view = False           # the view start() took is not this outer step's
    return seen


def test_without_the_store_and_part_of_its_world_a_node_waits_for_the_store(caplog):
    """The check-in failed (a member is gone) and the store does not answer: this node may be the side of a
    partition the rest dropped, so it asks the store again before it trains another round (may_train_on)."""
    _, (a,) = start_world(["a"], **{"diloco.retry_all_reduce": "1", "elastic.heartbeat_interval": "0.1"})
    calls: list[str] = []
    _scripted(a, calls, fail=True)
    seen = _cut_from_store(a, resolves=4)          # the 2 attempts' resolutions, then 2 more while it waits
    with caplog.at_level("WARNING", logger="zb.diloco"):
        report = a.outer_step()
    assert seen == [False, False, False, False, True] and not report.applied
    assert calls[-2:] == ["skip after 2", "round_started"]
    assert any("waiting for the store" in r.message for r in caplog.records)


def test_a_whole_world_without_the_store_trains_on():
    """Every member checked in: a store outage all nodes share does not stop the run."""
    _, (a,) = start_world(["a"])
    calls: list[str] = []
    _scripted(a, calls)
    seen = _cut_from_store(a, resolves=10)
    report = a.outer_step()
    assert seen == [False] and report.applied


def test_the_wait_for_the_store_ends_at_the_store_timeout():
    _, (a,) = start_world(["a"], **{"diloco.retry_all_reduce": "0", "elastic.store_timeout": "1.5"})
    _scripted(a, [], fail=True)
    _cut_from_store(a, resolves=1000)
    with pytest.raises(EnvironmentFailure, match="stops rather than train apart"):
        a.outer_step()


def test_only_the_store_or_the_whole_world_lets_a_node_train_on():
    assert may_train_on(store_ok=True, synced=False) and may_train_on(store_ok=False, synced=True)
    assert may_train_on(store_ok=True, synced=True) and not may_train_on(store_ok=False, synced=False)
