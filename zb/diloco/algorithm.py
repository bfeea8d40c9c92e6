"""How a pseudo-gradient becomes an update: the interface of an outer-step algorithm, and the typed
context it gets from the node that runs it.

The node runs every outer step in one fixed order (zb.diloco.outer_step): the average in flight
arrives, the world is resolved and the nodes check in, the update is applied, joiners get the state,
the node keeps its books, the round ends. An algorithm (blocking, eager, streaming, delayed; the
registry is zb.diloco.algorithms) is asked only what differs between them, in that order:

    arrive        the average launched at an earlier boundary (the wait is the stall); None: nothing
    exchange      during each check-in attempt: blocking's all-reduce (the others send nothing then)
    apply         the update, returned as `Applied`
    handed_over   after the hand-over to joiners (eager: its own term restarts)
    launch        after the bookkeeping: what travels behind the next round
    round_started after the round ended (a round budget's next part)

It never calls the node: what it may use is `NodeContext`, data and the run's groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
import torch.distributed as dist

from zb.config_schema import DilocoConfig
from zb.diloco import rounds
from zb.diloco.background import Arrival
from zb.diloco.checkin import Plan
from zb.diloco.error_feedback import ErrorFeedback, drop_unused, enabled
from zb.diloco.outer import OuterState
from zb.diloco.rounds import RoundClock
from zb.diloco.streams import StreamGroups
from zb.diloco.sync import SyncStats
from zb.elastic.view import WorldView
from zb.events import OuterReport
from zb.overlap_modes import Mode
from zb.position import RunPosition

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")


class Mesh(Protocol):
    """The world an algorithm's transfers run over (zb.elastic.ElasticDeviceMesh, or a fake world's)."""

    @property
    def view(self) -> WorldView | None: ...

    @property
    def global_pg(self) -> dist.ProcessGroup: ...

    def report_failure(self, rank: int | None) -> None: ...


@dataclass(frozen=True)
class NodeContext:
    """What an algorithm may use of its node: settings, the local ranks, the inner optimizer (a node
    whose own params went non-finite clears it), the world and its groups, and store clients."""

    dcfg: DilocoConfig
    pg_timeout_s: float
    local_rank: int
    local_group: dist.ProcessGroup | None     # the node's gloo control group; None alone
    optimizer: torch.optim.Optimizer
    mesh: Mesh
    streams: StreamGroups
    connect: Callable[[], StoreClient]        # a new client of the run's store (for a background thread)
    store: Callable[[], StoreClient | None]   # the node's store client, for the blocking path's extra groups
    rounds: RoundClock | None                  # diloco.round_seconds' clock
    weighted: bool                             # the average weighs contributors by their round's work


@dataclass(frozen=True)
class CheckInResult:
    """The world and plan an outer step runs under. After the last failed attempt `ok` is False, `plan` is
    that attempt's (None if its check-in failed) and `stats` is None."""

    view: WorldView
    plan: Plan | None
    stats: SyncStats | None
    attempts: int
    ok: bool
    resolve_s: float = 0.0  # resolving the world (the store's roll call), every attempt
    checkin_s: float = 0.0  # the check-in collective, waiting for the slowest node included

    def report(self) -> OuterReport:
        """The outer step's report as far as the check-in knows it."""
        clipped = [self.view.nodes[r] for r in self.plan.clipped()] if self.plan and self.stats else []
        unbacked = [self.view.nodes[r] for r in self.plan.discredited() if r not in self.plan.outsized()] \
            if self.plan else []
        return OuterReport(mesh_version=self.view.mesh_version, global_world_size=self.view.global_world_size,
                           num_peers=len(self.plan.contributors) if self.plan else 0, attempts=self.attempts,
                           resolve_s=round(self.resolve_s, 4), checkin_s=round(self.checkin_s, 4),
                           clipped=clipped or None, discredited=unbacked or None)


@dataclass
class Step:
    """One outer step as the algorithm sees it once the check-in agreed on a plan."""

    view: WorldView
    plan: Plan
    position: RunPosition          # this node's, before the step (diloco.round_seconds: at the run's step)
    arrival: Arrival | None        # what arrived of the average in flight
    stats: SyncStats | None        # blocking: what the exchange sent
    attempts: int
    report: OuterReport            # filled as the step goes
    closing: bool                  # the run's end: the last average in flight, then the shared params
    was_recovered: bool            # this node held a recovered snapshot before the step

    @property
    def me(self) -> int:
        return self.view.global_rank


@dataclass(frozen=True)
class Applied:
    """What `apply` did for this node."""

    caught_up: bool = False        # this node now stands where the run stands (RoleKeeper.caught_up)
    joined_run: bool = False       # a recovered node applied the run's update: it is at the run's position


class OuterAlgorithm:
    """One outer-step algorithm. Subclasses set `mode` (the diloco.overlap value, zb.overlap_modes) and
    implement `apply`; the other steps default to doing nothing."""

    mode: ClassVar[type[Mode]]
    feedback_layout: ClassVar[str] = "params"   # the order of the values it all-reduces (zb.diloco.error_feedback)
    exchanges: ClassVar[bool] = False           # it sends the pseudo-gradient during the check-in (`exchange`)
    extra_bytes = 0   # CPU bytes held beside the blocking path's outer state

    def __init__(self, ctx: NodeContext, outer: OuterState):
        self.ctx, self.outer = ctx, outer
        d = ctx.dcfg
        self.feedback = ErrorFeedback(outer.numel, self.feedback_layout) \
            if enabled(d.compression, d.error_feedback) else None

    # -- when ---------------------------------------------------------------------------------
    def sync_points(self, step: int) -> tuple[int | None, int | None]:
        """(fragment to launch, fragment to apply) after inner step `step`: here one whole-model outer
        step every H steps, or, with diloco.round_seconds, when this node's round budget is spent."""
        if self.ctx.rounds is not None:
            return None, (0 if self.ctx.rounds.over(step) else None)
        return None, (0 if step % self.ctx.dcfg.inner_steps == 0 else None)

    def begin_rounds(self, position: RunPosition) -> None:
        """diloco.round_seconds: the training loop starts at `position` (the round clock has started)."""
        return None

    def launch_fragment(self, fragment: int, contributing: bool) -> None:
        raise AssertionError(f"diloco.overlap = {self.mode.name} launches no fragment")  # sync_points names none

    # -- the outer step, in the order zb.diloco.outer_step runs it --------------------------------------
    def arrive(self) -> Arrival | None:
        """The average launched at an earlier boundary (the wait is the stall); None: nothing was in flight."""
        return None

    def exchange(self, view: WorldView, plan: Plan) -> SyncStats | None:
        """During each check-in attempt: what travels while training waits (None: nothing). A PeerFailure
        fails the attempt."""
        return None

    def note_arrival(self, report: OuterReport, arrival: Arrival | None) -> None:
        """The arrival's figures in the report."""
        return None

    def skip(self, attempts: int, closing: bool) -> None:
        """Every check-in attempt failed: nothing is applied."""
        log_skipped(attempts)

    def apply(self, step: Step) -> Applied:
        raise NotImplementedError

    def handed_over(self, step: Step, got_state: bool) -> None:
        """After the hand-over; `got_state`: this node received the run's state (or was to)."""
        return None

    def launch(self, step: Step, received: RunPosition | None) -> None:
        """After the bookkeeping: what travels behind the next round (not at the run's end)."""
        return None

    def round_started(self, report: OuterReport, position: RunPosition) -> None:
        """After the round ended (`position`: where this node stood before this outer step)."""
        return None

    def in_flight(self) -> bool:
        """An average is in flight (the run's end waits for it)."""
        return False

    # -- state ----------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors of this node's own beside the shared outer state, for its checkpoint."""
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        warn_dropped(tensors, self.mode.name, ("own/", "inflight/"))

    def close(self, grace_s: float) -> None:
        """The node leaves: stop what runs in the background."""
        return None

    def feedback_tensors(self) -> dict[str, torch.Tensor]:
        """This node's error-feedback residual, for its checkpoint (nothing in flight touches it: a checkpoint
        waits for the average in flight first)."""
        return self.feedback.state_tensors() if self.feedback is not None else {}

    def load_feedback(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.feedback is not None:
            self.feedback.load_state_tensors(tensors)
        else:
            drop_unused(tensors)

    def took_state(self) -> None:
        """This node received the run's state: its residual starts again at zero."""
        if self.feedback is not None:
            self.feedback.reset()


_KEPT_BY = {"own/": ("this node's eager term", "eager"),
            "inflight/": ("the average in flight", "eager, streaming or delayed")}


def warn_dropped(tensors: dict[str, torch.Tensor], overlap: str, prefixes: tuple[str, ...]) -> None:
    """One line for each part of a checkpoint that this algorithm has no use for (written under another
    diloco.overlap): the node resumes from its model params and the shared outer params without it."""
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in tensors):
            what, writer = _KEPT_BY[prefix]
            log.warning("the checkpoint holds %s (diloco.overlap = %s); with overlap = %s it is dropped: the node "
                        "resumes from its model params and the shared outer params", what, writer, overlap)


def log_skipped(attempts: int) -> None:
    """Every attempt failed: training goes on, and the next outer step's pseudo-gradient covers these
    inner steps too."""
    log.error("outer step skipped after %d failed check-ins; training goes on and the world is resolved again at "
              "the next outer step", attempts)


def warn_non_finite_own() -> None:
    log.warning("this node's pseudo-gradient is non-finite: its params restart from the outer params, its inner "
                "optimizer state is cleared, and every node skips the average it poisons")


def adaptive_plan(clock: RoundClock | None, plan: Plan, position: RunPosition) -> tuple[Plan, RunPosition]:
    """diloco.round_seconds: the run's step after a round is the furthest credible contributor's
    (zb.diloco.checkin.run_step), and a joiner receives that step, not the donor's."""
    if clock is None or not plan.contributors:
        return plan, position
    return plan, replace(position, step=plan.run_step)


def end_round(clock: RoundClock | None, report: OuterReport, view: WorldView, plan: Plan | None) -> None:
    """diloco.round_seconds: the round's figures in the report, and the next round starts now (the outer
    step ended together on every node)."""
    if clock is None:
        return
    if plan is not None:
        report.run_step = plan.run_step
        report.round_steps = {uid: plan.round_steps[r] for r, uid in enumerate(view.nodes) if r in plan.contributors}
        report.round_tokens = sum(plan.round_tokens[r] for r in plan.contributors)
        report.round_weight = round(rounds.token_weight(plan.round_tokens, plan.contributors, view.global_rank), 6)
    furthest = max((plan.round_steps[r] for r in plan.contributors), default=0) if plan is not None else 0
    clock.start(plan.run_step if plan is not None else None, furthest, carry=plan is None)


def share_weight(ctx: NodeContext, plan: Plan, rank: int) -> float | None:
    """This rank's weight in the average when contributors weigh by their round's work (tokens, or the
    swarm's micro-batches); None for the plain mean over the contributors."""
    return rounds.token_weight(plan.round_tokens, plan.contributors, rank) if ctx.weighted else None


def run_position(plan: Plan, position: RunPosition) -> RunPosition:
    """Where a recovered joiner stands once it applied the run's update: at the run's step and outer step."""
    return RunPosition(step=plan.run_step, outer_step=plan.run_outer_step, tokens=0, run_tokens=position.run_tokens)
