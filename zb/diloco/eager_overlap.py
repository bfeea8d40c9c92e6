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
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from zb.config_schema import DilocoConfig
from zb.diloco.algorithm import (
    Applied,
    NodeContext,
    Step,
    log_skipped,
    share_weight,
    warn_dropped,
    warn_non_finite_own,
)
from zb.diloco.arrival import OverlappedAlgorithm, Transfers, apply_arrived
from zb.diloco.background import Arrival, BackgroundAllReduce, HeldArrival
from zb.diloco.eager import OuterSGD, OwnTerm, own_step
from zb.diloco.error_feedback import ErrorFeedback
from zb.diloco.outer import OuterState
from zb.elastic import localsync
from zb.elastic.view import WorldView
from zb.overlap_modes import Eager, Mode
from zb.position import RunPosition

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")


class EagerAlgorithm(OverlappedAlgorithm):
    """The eager rule at each round boundary; the check-in also says who holds the average launched at
    the last boundary: it is applied only when every contributor does."""

    mode: ClassVar[type[Mode]] = Eager   # the naive delay (zb.diloco.delayed) is this without the eager term

    def __init__(self, ctx: NodeContext, outer: OuterState, *, own_term: bool = True):
        super().__init__(ctx, outer)
        self.state: EagerOverlap = EagerOverlap(outer, ctx.dcfg, ctx.local_rank, ctx.pg_timeout_s, ctx.connect,
                                                self.feedback, own_term=own_term)
        self.extra_bytes = self.state.extra_bytes

    def skip(self, attempts: int, closing: bool) -> None:
        if not closing:
            log_skipped(attempts)   # nobody could be reached: the next check-in finds where this node stands
            return
        log.error("the last average could not be agreed on after %d failed check-ins: the model ends on the "
                  "shared params without it", attempts)
        self.state.reset_own()
        self.outer.push_to_model()

    def apply(self, step: Step) -> Applied:
        """2-4 of the module's steps: this round's pseudo-gradient, the shared step with the average that
        arrived, the node's own term."""
        ov, plan, me = self.state, step.plan, step.me
        contributing = me in plan.contributors
        finite = localsync.all_ok(self.ctx.local_group, ov.take_fresh(contributing and not step.closing))
        step.report.applied = apply_arrived(self.ctx, self.outer, ov, step.view, plan, step.arrival)
        if contributing and not step.closing:
            if not finite:
                warn_non_finite_own()   # push_start at the launch restarts the params from the outer ones
                self.ctx.optimizer.state.clear()
            ov.own_step(finite, world_size=len(plan.contributors), weight=share_weight(self.ctx, plan, me))
        return Applied(joined_run=me in plan.appliers, caught_up=step.was_recovered and me in plan.appliers)

    def handed_over(self, step: Step, got_state: bool) -> None:
        if got_state or step.closing:
            self.state.reset_own()  # the run's shared state, with no eager term of this node's (at the end: every node's)

    def launch(self, step: Step, received: RunPosition | None) -> None:
        """5-6: the fresh pseudo-gradient's all-reduce starts, and the next round trains from shared + own."""
        plan = step.plan
        self.state.launch(step.view, self.ctx.mesh.global_pg, world_size=max(1, len(plan.contributors)),
                          weight=share_weight(self.ctx, plan, step.me))
        self.state.push_start()


class EagerOverlap:
    """This rank's eager state: its own term, the two CPU buffers (one in flight, one free) and the
    background all-reduce. Without an own term (`own_term` False: the naive one-round delay) the node
    trains from the shared params alone."""

    def __init__(self, outer: OuterState, cfg: DilocoConfig, local_rank: int, pg_timeout_s: float,
                 connect: Callable[[], StoreClient], feedback: ErrorFeedback | None = None, *, own_term: bool = True):
        self.outer, self.cfg, self.feedback = outer, cfg, feedback
        self.opt = OuterSGD.of(outer.optimizer)
        self.own: OwnTerm | None = OwnTerm.zeros_like(outer.flat.data, self.opt) if own_term else None
        self.fresh = torch.zeros_like(outer.flat.data)
        self.spare: torch.Tensor | None = outer.flat.grad  # the blocking path's gradient buffer, reused
        self.transfers = Transfers(cfg, local_rank, outer.layout.owner, pg_timeout_s, connect)
        self.job: BackgroundAllReduce | HeldArrival | None = None

    @property
    def extra_bytes(self) -> int:
        """CPU bytes held beside the blocking path's (outer params, momentum, one gradient buffer)."""
        own = [self.own.offset, self.own.momentum, self.own.last_share] if self.own is not None else []
        return sum(t.numel() * t.element_size() for t in [*own, self.fresh] if t is not None)

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
        self._start_params(self.fresh)
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
        assert self.own is not None  # the eager rule's
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
        if self.own is not None:
            self.own = OwnTerm.zeros_like(self.outer.flat.data, self.opt)

    # -- 5. launch ---------------------------------------------------------------------------------------
    def launch(self, view: WorldView, global_pg: dist.ProcessGroup, *, world_size: int,
               weight: float | None = None) -> None:
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
        self.outer.push_to_model(self._start_params(self.fresh))

    def _start_params(self, out: torch.Tensor) -> torch.Tensor:
        """out := the params a round starts from: shared + own offset (shared alone without an own term)."""
        if self.own is None:
            return out.copy_(self.outer.flat.data)
        return torch.add(self.outer.flat.data, self.own.offset, out=out)

    # -- checkpoints ------------------------------------------------------------------------------------
    def own_tensors(self) -> dict[str, torch.Tensor]:
        """The own term, for this node's checkpoint (never for joiners or snapshots: it is per node)."""
        if self.own is None:
            return {}
        out = {"own/offset": self.own.offset, "own/last_share": self.own.last_share}
        if self.own.momentum is not None:
            out["own/momentum"] = self.own.momentum
        return out

    @torch.no_grad()
    def load_own_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Resume the own term (the average in flight is zb.diloco.arrival's)."""
        if self.own is None:
            warn_dropped(tensors, "delayed", ("own/",))
            return
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
