"""diloco.overlap = eager: the outer step's all-reduce runs behind the next round's inner steps.

At each round boundary (`EagerAlgorithm`; the node runs the check-in and the hand-overs around these
steps, zb.diloco.arrival agrees on what arrived):
  1. `wait`: the average launched at the previous boundary arrives (the wait is the stall);
  2. `take_fresh`: this node's pseudo-gradient of the round ending now, from the params it started
     the round with (shared + own offset), into a buffer of its own;
  3. `apply_average`: the shared outer params and momentum step with that average, only when the
     check-in found it arrived whole on every contributor (else every node skips it alike);
  4. `own_step`: the node's own term applies its fresh share at once and withdraws its stale one
     (zb.diloco.eager: the paper's eager rule, split exactly into a shared and an own part);
  5. `launch`: the fresh pseudo-gradient's all-reduce starts in a thread, on the overlap's groups;
  6. `push_start`: the model takes shared + own offset, and the next round trains from there.

The shared part (OuterState: params and momentum) gets the same bits on every node, so it is what
the check-in digests and `params_hash` compare, what live snapshots serve and what joiners get. The
own term differs between nodes by design: each node's params carry its latest eager step.

At the end of the run `close_run` waits for the last average and applies it, and the model takes the
shared params: the consensus model, with every eager term dropped.

On a node with more local ranks than the run's stripes (zb.diloco.stripes), `take_fresh` reads the
model into stripes and `push_start` writes it back, each a collective over the node's local ranks.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from zb.config_schema import DilocoConfig
from zb.diloco.algorithm import (
    Boundary,
    adaptive_plan,
    end_round,
    log_skipped,
    run_position,
    share_weight,
    warn_non_finite_own,
)
from zb.diloco.arrival import OverlappedAlgorithm, Transfers, apply_arrived
from zb.diloco.background import Arrival, BackgroundAllReduce, HeldArrival
from zb.diloco.eager import OuterSGD, OwnTerm, own_step
from zb.diloco.error_feedback import ErrorFeedback
from zb.diloco.outer import OuterState
from zb.elastic import localsync
from zb.events import OuterReport
from zb.position import RunPosition

log = logging.getLogger("zb.diloco")


class EagerAlgorithm(OverlappedAlgorithm):
    """The eager rule at each round boundary; the check-in also says who holds the average launched at
    the last boundary: it is applied only when every contributor does."""

    name = "eager"

    def __init__(self, node: Boundary, outer: OuterState):
        super().__init__(node, outer)
        self.state = EagerOverlap(outer, node.dcfg, node.local.rank, node.cfg.elastic.pg_timeout, node.connect,
                                  self.feedback)
        self.extra_bytes = self.state.extra_bytes

    def _boundary(self, position: RunPosition, data_state: dict | None,
                  closing: bool) -> tuple[OuterReport, RunPosition | None]:
        node, ov = self.node, self.state
        arrival, report, done = self._arrive(position)
        view, plan = done.view, done.plan
        if plan is None:
            if not closing:
                log_skipped(done.attempts)   # nobody could be reached: the next check-in finds where this node stands
                end_round(node, report, view, None)
                return report, None
            log.error("the last average could not be agreed on after %d failed check-ins: the model ends on the "
                      "shared params without it", done.attempts)
            ov.reset_own()
            self.outer.push_to_model()
            return report, None
        plan, position = adaptive_plan(node, plan, position)
        me = view.global_rank
        contributing = me in plan.contributors
        weight = share_weight(node, plan, me)
        finite = localsync.all_ok(node.local_group, ov.take_fresh(contributing and not closing))
        was_recovered = node.roles.recovered
        report.applied = apply_arrived(node, self.outer, ov, view, plan, arrival)
        if contributing and not closing:
            if not finite:
                warn_non_finite_own()   # push_start below restarts the params from the outer ones
                node.optimizer.state.clear()
            ov.own_step(finite, world_size=len(plan.contributors), weight=weight)
        received = node.hand_over_state(view, plan, position)
        if received is not None or me in plan.receivers or closing:
            ov.reset_own()  # the run's shared state, with no eager term of this node's (at the end: every node's)
        if was_recovered and me in plan.appliers:
            received = run_position(plan, position)
            node.roles.caught_up()
        if closing:
            return node.close_on_shared(report), received
        # The store writes after the step go out before the launch: on a slow link they would otherwise queue
        # behind the bulk transfer and hold up the next inner steps.
        node.after_step(report, view, received or position, data_state)
        ov.launch(view, node.mesh.global_pg, world_size=max(1, len(plan.contributors)), weight=weight)
        ov.push_start()
        end_round(node, report, view, plan)
        return report, received


class EagerOverlap:
    """This rank's eager state: its own term, the two CPU buffers (one in flight, one free) and the
    background all-reduce."""

    def __init__(self, outer: OuterState, cfg: DilocoConfig, local_rank: int, pg_timeout_s: float,
                 connect: Callable[[], Any], feedback: ErrorFeedback | None = None):
        self.outer, self.cfg, self.feedback = outer, cfg, feedback
        self.opt = OuterSGD.of(outer.optimizer)
        self.own = OwnTerm.zeros_like(outer.flat.data, self.opt)
        self.fresh = torch.zeros_like(outer.flat.data)
        self.spare: torch.Tensor | None = outer.flat.grad  # the blocking path's gradient buffer, reused
        self.transfers = Transfers(cfg, local_rank, outer.layout.owner, pg_timeout_s, connect)
        self.job: BackgroundAllReduce | HeldArrival | None = None

    @property
    def extra_bytes(self) -> int:
        """CPU bytes held beside the blocking path's (outer params, momentum, one gradient buffer)."""
        own = [self.own.offset, self.own.momentum, self.own.last_share, self.fresh]
        return sum(t.numel() * t.element_size() for t in own if t is not None)

    # -- 1. the previous boundary's average --------------------------------------------------------
    def wait(self) -> Arrival | None:
        """The average launched at the last boundary (None: nothing in flight)."""
        if self.job is None:
            return None
        job, self.job = self.job, None
        arrival = job.wait()
        self.spare = job.buffer  # the thread has ended: the average (or garbage) is free after this boundary
        if not arrival.ok:
            log.warning("the background all-reduce launched at the last outer step failed: %s", arrival.error)
        return arrival

    # -- 2. this round's pseudo-gradient -------------------------------------------------------------
    @torch.no_grad()
    def take_fresh(self, contributing: bool) -> bool:
        """fresh := (shared + own offset) - the model's params; zeros for a node that does not
        contribute. Returns whether it is finite (the caller agrees on that over the local ranks). On a
        node that moves rows (zb.diloco.stripes) reading the model is a collective: every local rank
        calls this alike (`contributing` is local rank 0's plan's)."""
        if not contributing:
            self.fresh.zero_()
            return True
        torch.add(self.outer.flat.data, self.own.offset, out=self.fresh)
        self.outer.subtract_model(self.fresh)
        return bool(torch.isfinite(self.fresh).all())

    # -- 3. the shared step -----------------------------------------------------------------------------
    @torch.no_grad()
    def apply_average(self, average: torch.Tensor) -> None:
        """Step the shared outer params and momentum with the average every contributor received."""
        self.outer.flat.grad = average
        self.outer.step()

    # -- 4. the node's own term ---------------------------------------------------------------------------
    @torch.no_grad()
    def own_step(self, finite: bool, *, world_size: int, weight: float | None = None) -> None:
        """Apply the fresh share eagerly, withdraw the stale one. The share is fresh / world_size, or
        fresh * weight when the average weighs nodes by their round's work. A non-finite pseudo-gradient
        is not applied here (it still travels, so every node skips that average, as the blocking path does)."""
        # Non-finite: the stale share is still withdrawn, and the last share becomes zero (nothing of
        # this node's enters the average, which every node skips).
        own_step(self.own, self.fresh if finite else torch.zeros_like(self.fresh), world_size, self.opt,
                 weight=weight)

    def average_numel(self, part: int = -1) -> int:
        """Values in an average (what a late joiner receives from the donor): all params."""
        return self.outer.numel

    def part_in_flight(self) -> int:
        return -1  # the whole model

    def adopt_part(self, part: int) -> None:
        return None

    def reset_own(self) -> None:
        """A node that received the run's shared state starts with no eager term of its own."""
        self.own = OwnTerm.zeros_like(self.outer.flat.data, self.opt)

    # -- 5. launch ---------------------------------------------------------------------------------------
    def launch(self, view, global_pg, *, world_size: int, weight: float | None = None) -> None:
        """Start the all-reduce of `fresh` in the background (SUM / world_size; weighted: the SUM of each
        node's fresh * weight), on the overlap's groups (zb.diloco.arrival.Transfers)."""
        buffer = self.fresh
        if weight is not None:
            buffer.mul_(weight)   # the weights sum to 1 over the contributors: the SUM is the average
        self.fresh = self.spare if self.spare is not None else torch.zeros_like(buffer)
        self.spare = None  # back with the arrival
        self.job = self.transfers.start(buffer, view, global_pg, world_size if weight is None else 1,
                                        feedback=self.feedback.attempt if self.feedback is not None else None)

    # -- 6. where the next round starts -----------------------------------------------------------------
    @torch.no_grad()
    def push_start(self) -> None:
        """The model := shared + own offset (built in the free buffer; it is overwritten next boundary)."""
        torch.add(self.outer.flat.data, self.own.offset, out=self.fresh)
        self.outer.push_to_model(self.fresh)

    # -- checkpoints ------------------------------------------------------------------------------------
    def own_tensors(self) -> dict[str, torch.Tensor]:
        """The own term, for this node's checkpoint (never for joiners or snapshots: it is per node)."""
        out = {"own/offset": self.own.offset, "own/last_share": self.own.last_share}
        if self.own.momentum is not None:
            out["own/momentum"] = self.own.momentum
        return out

    @torch.no_grad()
    def load_own_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Resume the own term (the average in flight is zb.diloco.arrival's)."""
        if "own/offset" not in tensors:
            log.warning("the checkpoint holds no eager term (it was written with diloco.overlap = none): "
                        "this node resumes from the shared outer params")
            self.reset_own()
            self.outer.push_to_model()
            return
        self.own.offset.copy_(tensors["own/offset"])
        self.own.last_share.copy_(tensors["own/last_share"])
        if self.own.momentum is not None and "own/momentum" in tensors:
            self.own.momentum.copy_(tensors["own/momentum"])

    def close(self, grace_s: float) -> None:
        if self.job is not None:
            self.job.abandon(grace_s)
            self.job = None
