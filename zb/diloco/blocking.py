"""diloco.overlap = none: blocking DiLoCo. At each outer step every node checks in, the pseudo-gradients
are all-reduced while training waits, and the outer optimizer steps with their average (zb.diloco.sync,
zb.diloco.outer). With diloco.round_seconds (zb.diloco.rounds) the rounds end by time, the average is
weighted by tokens, and the run moves to the furthest contributor's step.
"""

from __future__ import annotations

import logging
import time

import torch

from zb.diloco import verify
from zb.diloco.algorithm import Applied, OuterAlgorithm, Step, share_weight
from zb.diloco.checkin import Plan
from zb.diloco.clip import squared_norm
from zb.diloco.outer import local_shard
from zb.diloco.sync import SyncStats, sync_pseudo_gradient
from zb.elastic import localsync
from zb.elastic.view import WorldView
from zb.overlap_modes import Blocking

log = logging.getLogger("zb.diloco")


class _CheckFailed(Exception):
    """The average failed the check: raised inside the error-feedback attempt so the residual is restored."""


class BlockingAlgorithm(OuterAlgorithm):
    mode = Blocking
    exchanges = True

    def exchange(self, view: WorldView, plan: Plan) -> SyncStats:
        """The all-reduce of the pseudo-gradients while training waits (zb.diloco.sync); with diloco.clip, the
        checked average (zb.diloco.verify)."""
        if self.feedback is None:
            stats = self._sync(view, plan, plan.contributors, None)
            if self._passes(view, plan, plan.contributors, residual=0.0):
                return stats
        else:
            try:
                with self.feedback.attempt() as residual:   # a failed attempt leaves the residual as it was
                    stats = self._sync(view, plan, plan.contributors, residual)
                    if self._passes(view, plan, plan.contributors, residual=self._residual_sum(plan)):
                        return stats
                    raise _CheckFailed   # the residual goes back to what it was: the parts run without it
            except _CheckFailed:
                pass
        return self._checked_in_parts(view, plan, stats)

    def _sync(self, view: WorldView, plan: Plan, part: list[int], residual: torch.Tensor | None) -> SyncStats:
        """All-reduce `part`'s pseudo-gradients (the rest of the group sends zeros), each weighed and scaled as the
        plan says, divided by the plan's contributor count: the parts of a checked average add up to it."""
        ctx = self.ctx
        streams = ctx.streams.for_view(view, ctx.store())
        # Weighted, the weights sum to 1: the SUM is the update.
        return sync_pseudo_gradient(self.outer, ctx.mesh.global_pg, ctx.dcfg, streams,
                                    zeros=view.global_rank not in part, scale=len(plan.contributors),
                                    weight=share_weight(ctx, plan, view.global_rank), residual=residual,
                                    clip=plan.scales[view.global_rank] if plan.scales else 1.0, view=view)

    def _weights(self, plan: Plan) -> list[float]:
        """Each rank's weight in the sum the all-reduce brings (1/M for the plain mean over M contributors)."""
        weights = [share_weight(self.ctx, plan, r) for r in range(len(plan.norms))]
        return [1.0 / len(plan.contributors) if w is None else w for w in weights]

    def _residual_sum(self, plan: Plan) -> float:
        """The error-feedback residuals every rank's ring adds, in the units of the sum (stated at the check-in)."""
        per = 1.0 if self.ctx.weighted else 1.0 / len(plan.contributors)
        return per * sum(plan.residuals)

    def _passes(self, view: WorldView, plan: Plan, part: list[int], residual: float) -> bool:
        """Whether the sum in the pseudo-gradient buffer is what `part`'s stated norms allow (always true
        without diloco.clip: nothing to check against)."""
        if self.ctx.dcfg.clip is None:
            return True
        grad = self.outer.flat.grad
        assert grad is not None  # the pseudo-gradient buffer: set by OuterState, never cleared
        norm_sq = squared_norm(grad)
        limit = verify.bound(part, self._weights(plan), plan.scales, plan.norms, residual)
        return verify.passes(norm_sq, limit, verify.slack(self.ctx.dcfg.compression, view.global_world_size))

    def _checked_in_parts(self, view: WorldView, plan: Plan, stats: SyncStats) -> SyncStats:
        """The average failed its check: reduce it again in halves down to the contributions that fail alone
        (zb.diloco.verify); the update is the kept parts' sum over their weight."""
        grad = self.outer.flat.grad
        assert grad is not None  # the pseudo-gradient buffer: set by OuterState, never cleared
        weights = self._weights(plan)
        kept, kept_weight, failed = torch.zeros_like(grad), 0.0, []
        todo = verify.halves(plan.contributors)
        while todo:
            part = todo.pop(0)
            if not part:
                continue
            more = self._sync(view, plan, part, None)
            stats.seconds += more.seconds
            stats.wire_bytes += more.wire_bytes
            if self._passes(view, plan, part, residual=0.0):
                kept += grad
                kept_weight += sum(weights[r] for r in part)
            elif len(part) == 1:
                failed += part
            else:
                todo += verify.halves(part)
        if kept_weight > 0:
            torch.div(kept, kept_weight, out=grad)
        else:
            grad.fill_(float("nan"))   # nothing passed: the non-finite skip takes the outer step on every node
        stats.failed = sorted(failed)
        log.warning("diloco.clip: the average failed its check (non-finite, or larger than the stated norms allow); "
                    "reduced again in parts: %s left out", ", ".join(view.nodes[r] for r in failed) or "nobody")
        return stats

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
        if me in plan.non_finite:
            # diloco.clip left this node's NaN/Inf out and it applied the others' average: its params restart from
            # the outer params (just pushed), and its inner optimizer state, which the same NaN reached, with them.
            self.ctx.optimizer.state.clear()
            log.warning("this node's pseudo-gradient was non-finite: left out of the average; it applied the others' "
                        "and restarts from the outer params with a fresh inner optimizer state")
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

