"""diloco.overlap = none: blocking DiLoCo. At each outer step every node checks in, the pseudo-gradients
are all-reduced while training waits, and the outer optimizer steps with their average (zb.diloco.sync,
zb.diloco.outer). With diloco.round_seconds (zb.diloco.rounds) the rounds end by time, the average is
weighted by tokens, and the run moves to the furthest contributor's step.
"""

from __future__ import annotations

import logging
import time

import torch

from zb.diloco.algorithm import (
    CheckIn,
    OuterAlgorithm,
    adaptive_plan,
    end_round,
    log_skipped,
    run_position,
    share_weight,
)
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
        plan, position = adaptive_plan(node, plan, position)
        report = self._apply(done, plan)
        received = node.hand_over_state(view, plan, position) if plan is not None else None
        if was_recovered and report.applied:
            assert plan is not None  # applied under a plan
            received = run_position(plan, position)
        report.stall_s = report.allreduce_s
        node.after_step(report, view, received or position, data_state)
        end_round(node, report, view, plan)
        return report, received

    def _sync(self, view, plan: Plan) -> SyncStats:
        node = self.node
        streams = node.streams.for_view(view, node.store)
        # Weighted, the weights sum to 1: the SUM is the update.
        def sync(residual: torch.Tensor | None) -> SyncStats:
            return sync_pseudo_gradient(self.outer, node.mesh.global_pg, node.dcfg, streams,
                                        zeros=view.global_rank not in plan.contributors, scale=len(plan.contributors),
                                        weight=share_weight(node, plan, view.global_rank), residual=residual,
                                        clip=plan.scales[view.global_rank] if plan.scales else 1.0)

        if self.feedback is None:
            return sync(None)
        with self.feedback.attempt() as residual:   # a failed attempt leaves the residual as it was
            return sync(residual)

    def _apply(self, done: CheckIn, plan: Plan | None) -> OuterReport:
        """`plan`: the check-in's, with diloco.round_seconds' run step."""
        node, view, stats = self.node, done.view, done.stats
        assert stats is None or plan is not None  # check_in returns stats only with the plan it synced under
        report = done.report()
        if stats is None:
            # Inner params stay as they are: the next outer step's pseudo-gradient covers these steps too.
            log_skipped(done.attempts)
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

