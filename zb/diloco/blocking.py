"""diloco.overlap = none: blocking DiLoCo. At each outer step every node checks in, the pseudo-gradients
are all-reduced while training waits, and the outer optimizer steps with their average (zb.diloco.sync,
zb.diloco.outer). With diloco.round_seconds (zb.diloco.rounds) the rounds end by time, the average is
weighted by tokens, and the run moves to the furthest contributor's step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from zb.diloco import rounds
from zb.diloco.algorithm import OuterAlgorithm, log_skipped, run_position
from zb.diloco.checkin import Arrived, Plan
from zb.diloco.outer import local_shard
from zb.diloco.sync import SyncStats, sync_pseudo_gradient
from zb.elastic import localsync
from zb.events import OuterReport
from zb.position import RunPosition

log = logging.getLogger("zb.diloco")


class BlockingAlgorithm(OuterAlgorithm):
    name = "none"

    def outer_step(self, position: RunPosition, data_state: dict | None) -> tuple[OuterReport, RunPosition | None]:
        node = self.node
        done = node.check_in(position, Arrived.NONE, sync=self._sync)
        view, plan = done.view, done.plan
        was_recovered = node.roles.recovered
        if node.rounds is not None and plan is not None and plan.contributors:
            # The run's step after an adaptive round is the furthest contributor's (zb.diloco.rounds).
            plan = replace(plan, run_step=rounds.run_step(plan.steps, plan.contributors))
            position = replace(position, step=plan.run_step)  # a joiner receives the run's step, not the donor's
        report = self._apply(view, plan, done.stats, done.attempts)
        received = node.hand_over_state(view, plan, position) if plan is not None else None
        if was_recovered and report.applied:
            assert plan is not None  # applied under a plan
            received = run_position(plan, position)
        report.stall_s = report.allreduce_s
        if node.rounds is not None and plan is not None:
            _report_round(report, view, plan)
        node.after_step(report, view, received or position, data_state)
        if node.rounds is not None:   # the outer step ended together on every node: the next round starts now
            furthest = max((plan.round_steps[r] for r in plan.contributors), default=0) if plan is not None else 0
            node.rounds.start(plan.run_step if plan is not None else None, furthest)
        return report, received

    def _sync(self, view, plan: Plan) -> SyncStats:
        node = self.node
        streams = node.streams.for_view(view, node.store)
        weight = None
        if node.weighted:   # the weights sum to 1: the SUM is the update
            weight = rounds.token_weight(plan.round_tokens, plan.contributors, view.global_rank)
        return sync_pseudo_gradient(self.outer, node.mesh.global_pg, node.dcfg, streams,
                                    zeros=view.global_rank not in plan.contributors, scale=len(plan.contributors),
                                    weight=weight)

    def _apply(self, view, plan: Plan | None, stats: SyncStats | None, attempts: int) -> OuterReport:
        node = self.node
        assert stats is None or plan is not None  # check_in returns stats only with the plan it synced under
        report = OuterReport(mesh_version=view.mesh_version, global_world_size=view.global_world_size,
                             num_peers=len(plan.contributors) if plan else 0, attempts=attempts)
        if stats is None:
            # Inner params stay as they are: the next outer step's pseudo-gradient covers these steps too.
            log_skipped(attempts)
            return report
        assert plan is not None
        report.allreduce_s, report.wire_bytes, report.wire_mbps = (round(stats.seconds, 4), stats.wire_bytes,
                                                                   round(stats.mbps, 2))
        me = view.global_rank
        if node.weighted and not any(plan.round_tokens[r] for r in plan.contributors):
            # Nobody trained in this round (only joiners, say): there is no update, not even momentum's.
            if me in plan.appliers:
                node.roles.caught_up()
            report.note = " | no node trained in this round: nothing to apply"
            return report
        report.d2h_s, report.reduce_s = round(stats.d2h_s, 4), round(stats.reduce_s, 4)
        if me not in plan.appliers:
            return report
        grad = self.outer.flat.grad
        assert grad is not None  # the pseudo-gradient buffer: set by OuterState, never cleared
        if not localsync.all_ok(node.local_group, bool(torch.isfinite(grad).all())):
            self._skip_non_finite()
            return report
        self.outer.step()
        t0 = time.perf_counter()
        self.outer.push_to_model()
        report.h2d_s = round(time.perf_counter() - t0, 4)
        report.applied = True
        node.roles.caught_up()
        return report

    def _skip_non_finite(self) -> None:
        """Some node sent NaN/Inf: every node skips the step; a node whose own params are non-finite
        (the offender) resets them to the outer params, and its inner optimizer state with them."""
        mine = all(bool(torch.isfinite(local_shard(p.detach())).all()) for p in self.outer.params)
        mine = localsync.all_ok(self.node.local_group, mine)
        log.warning("non-finite pseudo-gradient in this outer step: skipped on every node%s",
                    "" if mine else "; this node's params were non-finite: reset to the outer params")
        if not mine:
            self.outer.push_to_model()
            self.node.optimizer.state.clear()


def _report_round(report: OuterReport, view, plan: Plan) -> None:
    """diloco.round_seconds: the run's step, each contributor's steps and tokens, this node's weight."""
    report.run_step = plan.run_step
    report.round_steps = {uid: plan.round_steps[r] for r, uid in enumerate(view.nodes) if r in plan.contributors}
    report.round_tokens = sum(plan.round_tokens[r] for r in plan.contributors)
    report.round_weight = round(rounds.token_weight(plan.round_tokens, plan.contributors, view.global_rank), 6)
