"""How a pseudo-gradient becomes an update: the interface of an outer-step algorithm, and what it may
ask of the node that runs it.

A `DilocoNode` (zb.diloco.node) orchestrates what every algorithm shares: joining the run,
resolving the world, the check-in, roles, handing the state to joiners, live snapshots and the
data slot. An algorithm (blocking, eager, streaming; the registry is zb.diloco.algorithms) owns the
rest of the outer step: when the boundaries fall, what travels, and how an average is applied. A
new algorithm is one module with a subclass of `OuterAlgorithm` and one line in the registry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Protocol, overload

import torch

from zb.config_schema import Config, DilocoConfig
from zb.diloco import rounds
from zb.diloco.checkin import Plan
from zb.diloco.error_feedback import ErrorFeedback, drop_unused, enabled
from zb.diloco.outer import OuterState
from zb.diloco.roles import RoleKeeper
from zb.diloco.rounds import RoundClock
from zb.diloco.streams import StreamGroups
from zb.diloco.sync import SyncStats
from zb.events import OuterReport
from zb.position import RunPosition

log = logging.getLogger("zb.diloco")


@dataclass
class CheckIn:
    """The world and plan an outer step runs under (`Boundary.check_in`). After the last failed attempt
    `ok` is False, `plan` is that attempt's (None if its check-in failed) and `stats` is None."""

    view: Any             # zb.elastic.WorldView
    plan: Plan | None
    stats: SyncStats | None
    attempts: int
    ok: bool
    resolve_s: float = 0.0  # resolving the world (the store's roll call), every attempt
    checkin_s: float = 0.0  # the check-in collective, waiting for the slowest node included

    def report(self) -> OuterReport:
        """The outer step's report as far as the check-in knows it."""
        clipped = [self.view.nodes[r] for r in self.plan.clipped()] if self.plan and self.stats else []
        return OuterReport(mesh_version=self.view.mesh_version, global_world_size=self.view.global_world_size,
                           num_peers=len(self.plan.contributors) if self.plan else 0, attempts=self.attempts,
                           resolve_s=round(self.resolve_s, 4), checkin_s=round(self.checkin_s, 4),
                           clipped=clipped or None)


class Boundary(Protocol):
    """What the node (zb.diloco.node.DilocoNode) offers the algorithm it runs."""

    cfg: Config
    dcfg: DilocoConfig
    optimizer: torch.optim.Optimizer
    local: Any                      # zb.local_world.LocalWorld
    local_group: Any                # the node's gloo control group (None alone)
    roles: RoleKeeper
    mesh: Any                       # zb.elastic.ElasticDeviceMesh, or a fake world's mesh in tests
    streams: StreamGroups
    store: Any
    rounds: RoundClock | None

    @property
    def weighted(self) -> bool: ...

    def connect(self) -> Any: ...

    def check_in(self, position: RunPosition, arrived: int,
                 sync: Callable[[Any, Plan], SyncStats] | None = None) -> CheckIn: ...

    def hand_over_state(self, view: Any, plan: Plan, position: RunPosition) -> RunPosition | None: ...

    def send_each(self, ranks: list[int], send: Callable[[int], Any], what: str) -> None: ...

    def after_step(self, report: OuterReport, view: Any, position: RunPosition, data_state: dict | None) -> None: ...

    def close_on_shared(self, report: OuterReport) -> OuterReport: ...


class OuterAlgorithm:
    """One outer-step algorithm, run by a node (`Boundary`). Subclasses set `name` (the value of
    diloco.overlap that selects it) and implement `outer_step`."""

    name: ClassVar[str]
    feedback_layout: ClassVar[str] = "params"   # the order of the values it all-reduces (zb.diloco.error_feedback)
    extra_bytes = 0   # CPU bytes held beside the blocking path's outer state

    def __init__(self, node: Boundary, outer: OuterState):
        self.node, self.outer = node, outer
        d = node.dcfg
        self.feedback = ErrorFeedback(outer.numel, self.feedback_layout) \
            if enabled(d.compression, d.error_feedback) else None

    def sync_points(self, step: int) -> tuple[int | None, int | None]:
        """(fragment to launch, fragment to apply) after inner step `step`: here one whole-model outer
        step every H steps, or, with diloco.round_seconds, when this node's round budget is spent."""
        if self.node.rounds is not None:
            return None, (0 if self.node.rounds.over(step) else None)
        return None, (0 if step % self.node.dcfg.inner_steps == 0 else None)

    def begin_rounds(self, position: RunPosition) -> None:
        """diloco.round_seconds: the training loop starts at `position` (the round clock has started)."""
        return None

    def launch_fragment(self, fragment: int) -> None:
        raise AssertionError(f"diloco.overlap = {self.name} launches no fragment")  # sync_points names none

    def outer_step(self, position: RunPosition, data_state: dict | None) -> tuple[OuterReport, RunPosition | None]:
        """Run one outer step from `position` (this node's, before it). Returns its report and, for a
        node that took over the run's state, the run's position before the step."""
        raise NotImplementedError

    def close_run(self, position: RunPosition) -> OuterReport | None:
        """The run's end (every node reaches it at the same step): finish what is in flight. None when
        nothing was."""
        return None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors of this node's own beside the shared outer state, for its checkpoint."""
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        warn_dropped(tensors, self.name, ("own/", "inflight/"))

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
            "inflight/": ("the average in flight", "eager or streaming")}


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


@overload
def adaptive_plan(node: Boundary, plan: Plan, position: RunPosition) -> tuple[Plan, RunPosition]: ...
@overload
def adaptive_plan(node: Boundary, plan: Plan | None, position: RunPosition) -> tuple[Plan | None, RunPosition]: ...
def adaptive_plan(node: Boundary, plan: Plan | None, position: RunPosition) -> tuple[Plan | None, RunPosition]:
    """diloco.round_seconds: the run's step after a round is the furthest contributor's (zb.diloco.rounds),
    and a joiner receives that step, not the donor's."""
    if node.rounds is None or plan is None or not plan.contributors:
        return plan, position
    plan = replace(plan, run_step=rounds.run_step(plan.steps, plan.contributors))
    return plan, replace(position, step=plan.run_step)


def end_round(node: Boundary, report: OuterReport, view: Any, plan: Plan | None) -> None:
    """diloco.round_seconds: the round's figures in the report, and the next round starts now (the outer
    step ended together on every node)."""
    if node.rounds is None:
        return
    if plan is not None:
        report.run_step = plan.run_step
        report.round_steps = {uid: plan.round_steps[r] for r, uid in enumerate(view.nodes) if r in plan.contributors}
        report.round_tokens = sum(plan.round_tokens[r] for r in plan.contributors)
        report.round_weight = round(rounds.token_weight(plan.round_tokens, plan.contributors, view.global_rank), 6)
    furthest = max((plan.round_steps[r] for r in plan.contributors), default=0) if plan is not None else 0
    node.rounds.start(plan.run_step if plan is not None else None, furthest)


def share_weight(node: Boundary, plan: Plan, rank: int) -> float | None:
    """This rank's weight in the average when contributors weigh by their round's work (tokens, or the
    swarm's micro-batches); None for the plain mean over the contributors."""
    return rounds.token_weight(plan.round_tokens, plan.contributors, rank) if node.weighted else None


def run_position(plan: Plan, position: RunPosition) -> RunPosition:
    """Where a recovered joiner stands once it applied the run's update: at the run's step and outer step."""
    return RunPosition(step=plan.run_step, outer_step=plan.run_outer_step, tokens=0, run_tokens=position.run_tokens)
