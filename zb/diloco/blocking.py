"""diloco.overlap = none: blocking DiLoCo. At each outer step every node checks in, the pseudo-gradients
are all-reduced while training waits, and the outer optimizer steps with their average (zb.diloco.sync,
zb.diloco.outer). With diloco.round_seconds (zb.diloco.rounds) the rounds end by time, the average is
weighted by tokens, and the run moves to the furthest contributor's step.
"""

from __future__ import annotations

import logging
import time

import torch

from zb.diloco.algorithm import Applied, OuterAlgorithm, Step, share_weight
from zb.diloco.checkin import Plan
from zb.diloco.outer import local_shard
from zb.diloco.sync import SyncStats, sync_pseudo_gradient
from zb.elastic import localsync
from zb.elastic.view import WorldView
from zb.overlap_modes import Blocking

log = logging.getLogger("zb.diloco")


class BlockingAlgorithm(OuterAlgorithm):
    mode = Blocking
    exchanges = True

    def exchange(self, view: WorldView, plan: Plan) -> SyncStats:
        """The all-reduce of the pseudo-gradients while training waits (zb.diloco.sync)."""
        ctx = self.ctx
        streams = ctx.streams.for_view(view, ctx.store())
        # Weighted, the weights sum to 1: the SUM is the update.
        def sync(residual: torch.Tensor | None) -> SyncStats:
            return sync_pseudo_gradient(self.outer, ctx.mesh.global_pg, ctx.dcfg, streams,
                                        zeros=view.global_rank not in plan.contributors, scale=len(plan.contributors),
                                        weight=share_weight(ctx, plan, view.global_rank), residual=residual,
                                        clip=plan.scales[view.global_rank] if plan.scales else 1.0)

        if self.feedback is None:
            return sync(None)
        with self.feedback.attempt() as residual:   # a failed attempt leaves the residual as it was
            return sync(residual)

    def apply(self, step: Step) -> Applied:
        """The outer optimizer with the average the exchange brought, on every applier."""
        report, stats, plan, me = step.report, step.stats, step.plan, step.me
        assert stats is not None  # a check-in that succeeded synced
        report.allreduce_s, report.wire_bytes, report.wire_mbps = (round(stats.seconds, 4), stats.wire_bytes,
                                                                   round(stats.mbps, 2))
        report.stall_s = report.allreduce_s
        if self.ctx.weighted and not any(plan.round_tokens[r] for r in plan.contributors):
            # Nobody trained in this round (only joiners, say): there is no update, not even momentum's.
            report.note = " | no node trained in this round: nothing to apply"
            return Applied(caught_up=me in plan.appliers)
        report.d2h_s, report.reduce_s = round(stats.d2h_s, 4), round(stats.reduce_s, 4)
        if me not in plan.appliers:
            return Applied()
        grad = self.outer.flat.grad
        assert grad is not None  # the pseudo-gradient buffer: set by OuterState, never cleared
        if not localsync.all_ok(self.ctx.local_group, bool(torch.isfinite(grad).all())):
            self._skip_non_finite()
            return Applied()
        self.outer.step()
        t0 = time.perf_counter()
        self.outer.push_to_model()
        report.h2d_s = round(time.perf_counter() - t0, 4)
        report.applied = True
        return Applied(caught_up=True, joined_run=True)

    def _skip_non_finite(self) -> None:
        """Some node sent NaN/Inf: every node skips the step; a node whose own params are non-finite
        (the offender) resets them to the outer params, and its inner optimizer state with them."""
        mine = all(bool(torch.isfinite(local_shard(p.detach())).all()) for p in self.outer.params)
        mine = localsync.all_ok(self.ctx.local_group, mine)
        log.warning("non-finite pseudo-gradient in this outer step: skipped on every node%s",
                    "" if mine else "; this node's params were non-finite: reset to the outer params")
        if not mine:
            self.outer.push_to_model()
            self.ctx.optimizer.state.clear()

