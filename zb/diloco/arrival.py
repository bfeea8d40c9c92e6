"""The overlapped algorithms' boundary (diloco.overlap = eager or streaming): what arrived of the
average launched at the previous boundary, agreed on by every node, and applied on every applier or on
none. A transfer that failed anywhere is skipped everywhere, never half applied; a recovered joiner,
whose snapshot predates that average, receives it from the donor.

On a node with more local ranks than the run's stripes (zb.diloco.stripes), the ranks without a stripe
start no transfer (`Transfers`): their empty share of every average has arrived at once, so the node's
agreement on what arrived is its stripe owners'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from zb.collectives import PeerFailure
from zb.config_schema import DilocoConfig
from zb.diloco.algorithm import NodeContext, OuterAlgorithm
from zb.diloco.background import Arrival, BackgroundAllReduce, HeldArrival
from zb.diloco.checkin import Plan
from zb.diloco.outer import OuterState
from zb.diloco.streams import StreamGroups
from zb.diloco.transfer import StateTransfer, send_each
from zb.elastic import localsync
from zb.elastic.view import WorldView
from zb.errors import EnvironmentFailure
from zb.events import OuterReport

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")


class InFlight(Protocol):
    """An overlapped algorithm's state of the average in flight (zb.diloco.eager_overlap, zb.diloco.streaming)."""

    def apply_average(self, average: torch.Tensor) -> None: ...

    def average_numel(self, part: int) -> int: ...

    def part_in_flight(self) -> int: ...

    def adopt_part(self, part: int) -> None: ...

    def own_tensors(self) -> dict[str, torch.Tensor]: ...

    def load_own_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...


# The average in flight in a checkpoint: its values and which part of the model it averages (a streaming
# fragment; -1: the whole model).
AVERAGE, PART = "inflight/average", "inflight/part"


class InFlightState(InFlight, Protocol):
    """The buffers and the job in flight of an overlapped algorithm."""

    job: BackgroundAllReduce | HeldArrival | None

    def wait(self) -> Arrival | None: ...

    def close(self, grace_s: float) -> None: ...


class OverlappedAlgorithm(OuterAlgorithm):
    """An algorithm whose all-reduce runs behind the inner steps (eager, streaming, delayed): each outer step
    is a boundary that agrees on the average in flight, and the run's end waits for the last one and leaves
    the model at the shared params (the consensus model, no node's own term or merge residue)."""

    state: InFlightState

    def arrive(self) -> Arrival | None:
        return self.state.wait()

    def note_arrival(self, report: OuterReport, arrival: Arrival | None) -> None:
        if arrival is None:
            report.note = " | no average in flight yet"
            return
        report.allreduce_s, report.wire_bytes, report.wire_mbps = (round(arrival.seconds, 4), arrival.wire_bytes,
                                                                   round(arrival.mbps, 2))
        report.hidden_s, report.stall_s = round(arrival.hidden_s, 4), round(arrival.stall_s, 4)

    def in_flight(self) -> bool:
        return self.state.job is not None

    def close(self, grace_s: float) -> None:
        self.state.close(grace_s)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This node's own state and the average in flight. A checkpoint waits for that average (the stall
        of what is left of one transfer) and keeps it, so a restarted run applies it at the boundary where
        the uninterrupted run does; one that failed is kept as nothing, and every node skips it alike."""
        out = self.state.own_tensors()
        if self.state.job is None:
            return out
        arrival = self.state.job.wait()
        self.state.job = HeldArrival(arrival)
        if arrival.ok and arrival.buffer is not None:
            out[AVERAGE] = arrival.buffer
            out[PART] = torch.tensor([self.state.part_in_flight()])
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.state.load_own_tensors(tensors)
        average, part = tensors.get(AVERAGE), _part(tensors)
        fits = average is not None and average.dtype == torch.float32 and \
            average.numel() == self.state.average_numel(part)
        if average is not None and not fits:
            log.warning("the checkpoint's average in flight (%d values, part %d) does not fit this run's diloco "
                        "settings: it is dropped, and every node skips it alike", average.numel(), part)
        # The node's local ranks keep it all or none (each boundary agrees on what they hold); a rank with no
        # stripe, whose part of a resharded checkpoint is empty, takes the part local rank 0 kept.
        if not localsync.all_ok(self.ctx.local_group, fits):
            return
        assert average is not None  # it fits
        self.state.adopt_part(_part_of_head(self.ctx, self.outer, part))
        self.state.job = HeldArrival(Arrival(average.clone(), None))
        log.info("resumed with the average that was in flight at the checkpoint: it is applied at the next boundary")


def _part(tensors: dict[str, torch.Tensor]) -> int:
    """The part a checkpoint's average in flight averages (-1: the whole model, or unknown: a resharded rank
    with no stripe holds it empty)."""
    part = tensors.get(PART)
    return int(part.reshape(-1)[0]) if part is not None and part.numel() else -1


def _part_of_head(ctx: NodeContext, outer: OuterState, part: int) -> int:
    """Local rank 0's part on every local rank: on a node that moves rows, a rank with no stripe holds no
    average, and learns which part (streaming: which fragment to merge) from the head."""
    if outer.layout.identity:
        return part
    return localsync.broadcast_json(ctx.local_group, ctx.local_rank, {"part": part})["part"]


class Transfers:
    """Starts an overlapped algorithm's background all-reduces, on groups of its own (zb.diloco.streams, tag
    "ov": built for each world inside the thread, over a store client of its own). A rank with no stripe
    (zb.diloco.stripes) starts none: its share of the average is empty, so that average has arrived already."""

    def __init__(self, cfg: DilocoConfig, local_rank: int, owner: bool, pg_timeout_s: float,
                 connect: Callable[[], StoreClient]):
        self.cfg, self.owner, self._connect = cfg, owner, connect
        self.groups = StreamGroups(cfg.streams, local_rank, pg_timeout_s, tag="ov", first=0)
        self._store: StoreClient | None = None  # used by the background thread only; made on the first transfer

    def start(self, buffer: torch.Tensor, view: WorldView, global_pg: dist.ProcessGroup, scale: int,
              tokens: int | None = None, feedback: Callable[[], AbstractContextManager[torch.Tensor]] | None = None
              ) -> BackgroundAllReduce | HeldArrival:
        """All-reduce `buffer` in place behind the inner steps (SUM / scale, or weighted by `tokens`: see
        BackgroundAllReduce) over the world `view`; `feedback` opens the buffer's error-feedback residual
        (an ErrorFeedback.attempt)."""
        if not self.owner:
            return HeldArrival(Arrival(buffer, None))
        return BackgroundAllReduce(buffer, lambda: self._groups(view, global_pg), self.cfg, scale, tokens, feedback,
                                   view)

    def _groups(self, view: WorldView, global_pg: dist.ProcessGroup) -> list[dist.ProcessGroup]:
        if view.global_world_size == 1:
            return [global_pg]  # nothing travels
        try:
            self._store = self._store or self._connect()
            return self.groups.for_view(view, self._store)
        except Exception:
            self._store = None  # the store may have restarted: a fresh client next time
            raise


def apply_arrived(ctx: NodeContext, outer: OuterState, state: InFlight, view: WorldView, plan: Plan,
                  arrival: Arrival | None) -> bool:
    """The shared step with the average launched at an earlier boundary, on every applier or on none."""
    me = view.global_rank
    if not plan.average_ok or me not in plan.appliers:
        if plan.contributors and not plan.average_ok and me in plan.appliers and arrival is not None:
            log.warning("the average launched at the last outer step did not reach every node: every node skips it")
        return False
    late = [r for r in plan.appliers if r not in plan.contributors]
    donor = plan.contributors[0]
    average = arrival.buffer if me in plan.contributors and arrival is not None else None
    if late:
        average = _share_average(ctx, outer, state, view, donor, late, average)
        if average is None:
            return False
    assert average is not None  # an applier that did not contribute is one of `late`: it received the average
    if not localsync.all_ok(ctx.local_group, bool(torch.isfinite(average).all())):
        # The same bits on every node: every node decides alike (the offender reset at launch).
        log.warning("non-finite average pseudo-gradient: skipped on every node")
        return False
    state.apply_average(average)
    return True


def _share_average(ctx: NodeContext, outer: OuterState, state: InFlight, view: WorldView, donor: int,
                   late: list[int], average: torch.Tensor | None) -> torch.Tensor | None:
    """Donor -> recovered joiners: the average they did not take part in. It travels between the ranks that
    hold a stripe (zb.diloco.stripes); the others' share of it is empty."""
    if view.global_rank == donor:
        assert average is not None  # the donor contributed: it holds the average
        if outer.layout.owner:
            transfer = StateTransfer(ctx.mesh.global_pg, outer, ctx.optimizer, ctx.dcfg.min_bandwidth_mbps)
            part = state.part_in_flight()
            send_each(ctx.mesh, late, lambda r: transfer.send_tensor(r, average, part), "the average")
        return average
    if view.global_rank not in late:
        return average
    return _receive_average(ctx, outer, state, donor)


def _receive_average(ctx: NodeContext, outer: OuterState, state: InFlight, donor: int) -> torch.Tensor:
    """A recovered joiner's side of _share_average, on every local rank: a failure on any of them stops them
    all; a rank with no stripe learns which part the average is (streaming: the fragment to merge) from
    local rank 0."""
    buffer: torch.Tensor | None = None
    part, error = -1, None
    if outer.layout.owner:
        transfer = StateTransfer(ctx.mesh.global_pg, outer, ctx.optimizer, ctx.dcfg.min_bandwidth_mbps)
        try:
            buffer, part = transfer.receive_tensor(donor, state.average_numel)
        except PeerFailure as e:
            error = e
    if not localsync.all_ok(ctx.local_group, error is None):
        raise EnvironmentFailure(f"joining failed: the average from rank {donor} did not arrive "
                                 f"({error or 'on another local rank'}); restart this node to join again")
    part = _part_of_head(ctx, outer, part)
    state.adopt_part(part)  # streaming: a joiner launched nothing, the donor says which fragment
    log.info("took the average in flight from rank %d (the recovered snapshot predates it)", donor)
    return buffer if buffer is not None else torch.zeros(state.average_numel(part))
