"""diloco.overlap = streaming: Streaming DiLoCo (Douillard et al., arXiv 2501.18512), the params
split into P fragments synced in turn, each all-reduce overlapping tau inner steps.

Fragments are strided over the transformer blocks (block i -> fragment i mod P, the paper's better
layout); the other params (embeddings, final norm, output) go one by one to the lightest fragment.
Fragment p is synced once every H steps, at step (p + 1) * H/P of each round, so the payload of a
sync is one fragment (about 1/P of the model). For fragment p:

  1. at its sync step minus tau (`launch`): its pseudo-gradient, shared params minus the model's,
     goes into an all-reduce in a background thread; training goes on for tau steps;
  2. at its sync step (`StreamingAlgorithm.outer_step`, zb.diloco.arrival): the average arrives (the stall, if it is late), the
     check-in agrees that every contributor holds it (else every node skips it), the shared outer
     params and momentum of the fragment step with it, and the node's fragment merges:
         model_p <- alpha * model_p + (1 - alpha) * shared_p
     (torchft's `lerp`; alpha = 0 replaces the local fragment, the paper uses 0.5).

The shared outer params and momentum are the same bits on every node (stepped only with averages),
so the check-in digest, params_hash, snapshots and joiners work on them as for blocking DiLoCo.
The models differ by the merge residue alpha * (model - shared), which enters the fragment's next
pseudo-gradient. Between one fragment's sync and the next launch nothing is in flight (tau < H/P):
joiners are admitted there. tau = 0 syncs each fragment blocking. A checkpoint taken while a fragment
is in flight waits for its average and keeps it (zb.diloco.arrival): the restarted run applies it where
the uninterrupted one does. On a node with more local ranks than the run's stripes (zb.diloco.stripes),
the launch and the merge move the fragment's rows only, each a collective over the node's local ranks.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zb.config_schema import DilocoConfig
from zb.diloco.algorithm import (
    Applied,
    NodeContext,
    Step,
    log_skipped,
    warn_dropped,
    warn_non_finite_own,
)
from zb.diloco.arrival import OverlappedAlgorithm, Transfers, apply_arrived
from zb.diloco.background import Arrival, BackgroundAllReduce, HeldArrival
from zb.diloco.eager import OuterSGD
from zb.diloco.error_feedback import ErrorFeedback
from zb.diloco.fragment_rounds import FragmentRounds
from zb.diloco.outer import OuterState
from zb.elastic import localsync
from zb.elastic.view import WorldView
from zb.events import OuterReport
from zb.overlap_modes import Streaming
from zb.position import RunPosition

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fragment_of_params(names: list[str], numels: list[int], fragments: int) -> list[int]:
    """The fragment of every param: blocks strided (block i -> i mod P), the rest greedily onto the
    lightest fragment, largest first. A pure function of names and sizes: the same on every node."""
    out, load = [-1] * len(names), [0] * fragments
    for i, name in enumerate(names):
        m = _BLOCK.search(name)
        if m:
            out[i] = int(m.group(1)) % fragments
            load[out[i]] += numels[i]
    for i in sorted((i for i in range(len(names)) if out[i] < 0), key=lambda i: (-numels[i], i)):
        out[i] = min(range(fragments), key=lambda f: (load[f], f))
        load[out[i]] += numels[i]
    return out


class StreamingAlgorithm(OverlappedAlgorithm):
    """A fragment's outer step: the average launched tau steps ago, applied on every node or on none,
    then the merge; joiners are admitted and handed the state here (nothing is in flight). A checkpoint
    holds the shared outer state and the fragment's average in flight, if any (zb.diloco.arrival)."""

    mode = Streaming
    feedback_layout = "fragments"   # the residual is laid out fragment after fragment, as the buffers it sends

    def __init__(self, ctx: NodeContext, outer: OuterState):
        super().__init__(ctx, outer)
        self.state: StreamingOverlap = StreamingOverlap(outer, ctx.dcfg, ctx.local_rank, ctx.pg_timeout_s,
                                                        ctx.connect, self.feedback)
        self.extra_bytes = self.state.extra_bytes
        # diloco.round_seconds: the clock says when fragments launch and apply (zb.diloco.fragment_rounds).
        self.timed = FragmentRounds(ctx.rounds, ctx.dcfg.fragments, ctx.dcfg.fragment_delay) \
            if ctx.rounds is not None else None
        self._weight: float | None = None   # this node's share of the average applied at this boundary

    def begin_rounds(self, position: RunPosition) -> None:
        if self.timed is not None:
            self.timed.begin(position.outer_step, launched=self.state.job is not None)

    def sync_points(self, step: int) -> tuple[int | None, int | None]:
        return self.timed.sync_points(step) if self.timed is not None else self.state.sync_points(step)

    def launch_fragment(self, fragment: int, contributing: bool) -> None:
        """Start the fragment's all-reduce over the current world. No check-in: roles change only at
        an outer step (joiners are admitted there), so every node of the world sends; a node whose
        world is stale (it was frozen) fails its transfer and is sorted out at the outer step. Under
        diloco.round_seconds the average is weighted by the tokens behind each node's part."""
        tokens = None
        if self.timed is not None:
            tokens = self.timed.take_tokens(fragment) if contributing else 0
        view = self.ctx.mesh.view
        assert view is not None  # the node started: it has a world
        self.state.launch(fragment, view, self.ctx.mesh.global_pg, contributing, tokens)
        log.debug("fragment %d: all-reduce launched (%d values)", fragment, self.state.numel(fragment))

    def skip(self, attempts: int, closing: bool) -> None:
        log_skipped(attempts)
        if closing:
            self.outer.push_to_model()

    def apply(self, step: Step) -> Applied:
        """The fragment's shared step with its average (on every node or none), then the merge."""
        ov, plan, me, arrival = self.state, step.plan, step.me, step.arrival
        finite = localsync.all_ok(self.ctx.local_group, not (arrival is not None and ov.non_finite))
        step.report.applied = apply_arrived(self.ctx, self.outer, ov, step.view, plan, arrival)
        step.report.fragment = ov.fragment
        if not finite:
            warn_non_finite_own()
            self.ctx.optimizer.state.clear()
            self.outer.push_to_model()
        elif step.report.applied and me in plan.contributors and not step.closing:
            ov.merge(self.ctx.dcfg.fragment_alpha)
        self._weight = arrival.weight if arrival is not None else None
        joined = step.was_recovered and me in plan.appliers
        return Applied(joined_run=me in plan.appliers, caught_up=joined)

    def handed_over(self, step: Step, got_state: bool) -> None:
        if step.was_recovered and step.me in step.plan.appliers:
            self.outer.push_to_model()  # a recovered joiner holds no progress of its own yet

    def launch(self, step: Step, received: RunPosition | None) -> None:
        if self.timed is not None and received is not None:
            self.timed.restart_counts()   # its pseudo-gradients start from the run's state

    def round_started(self, report: OuterReport, position: RunPosition) -> None:
        """diloco.round_seconds: the next part of the round starts now, for the fragment of the next outer
        step (`position`: where this node stood before this one)."""
        if self.timed is not None:
            self.timed.begin(position.outer_step + 1, launched=False)
        if self._weight is not None:
            report.round_weight = round(self._weight, 6)   # the share this node's part had in the average
        self._weight = None


class StreamingOverlap:
    """This rank's streaming state: the fragments' ranges in the flat outer buffers, the fragment in
    flight and its background all-reduce."""

    def __init__(self, outer: OuterState, cfg: DilocoConfig, local_rank: int, pg_timeout_s: float,
                 connect: Callable[[], StoreClient], feedback: ErrorFeedback | None = None):
        self.outer, self.cfg, self.feedback = outer, cfg, feedback
        self.opt = OuterSGD.of(outer.optimizer)
        self.momentum = self._momentum_buffer()
        # From the whole params' sizes: this rank's stripes differ between local ranks (a passenger's are
        # empty), and every rank of every node must cut the same fragments.
        owner = fragment_of_params(outer.names, [math.prod(s) for s in outer.full_shapes], cfg.fragments)
        self.params_of = [[i for i, f in enumerate(owner) if f == p] for p in range(cfg.fragments)]
        ranges = outer.param_ranges()
        self.ranges = [[ranges[i] for i in ps] for ps in self.params_of]
        sizes = [sum(b - a for a, b in r) for r in self.ranges]
        self.offsets = [sum(sizes[:p]) for p in range(cfg.fragments)]   # each fragment's place in the residual
        self.per = cfg.inner_steps // cfg.fragments
        self.transfers = Transfers(cfg, local_rank, outer.layout.owner, pg_timeout_s, connect)
        self.job: BackgroundAllReduce | HeldArrival | None = None
        self.fragment: int | None = None   # the fragment in flight (or last launched)
        self.non_finite = False            # this node's launched pseudo-gradient was non-finite

    def _momentum_buffer(self) -> torch.Tensor | None:
        """The shared momentum, created up front (zeros = torch's first step), so each fragment can
        step its own slice of it and checkpoints, snapshots and joiners carry all of it."""
        if self.opt.momentum == 0:
            return None
        state = self.outer.optimizer.state[self.outer.flat]
        if state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.zeros_like(self.outer.flat.data)
        return state["momentum_buffer"]

    @property
    def extra_bytes(self) -> int:
        """CPU bytes beside blocking DiLoCo's: the largest fragment's send buffer."""
        return 4 * max(sum(b - a for a, b in r) for r in self.ranges)

    def numel(self, fragment: int) -> int:
        return sum(b - a for a, b in self.ranges[fragment])

    # -- when -----------------------------------------------------------------------------------
    def sync_points(self, step: int) -> tuple[int | None, int | None]:
        """(fragment to launch, fragment to apply) after inner step `step` (1-based), or None."""
        delay, H = self.cfg.fragment_delay, self.cfg.inner_steps
        launch = apply = None
        for p in range(self.cfg.fragments):
            at = (p + 1) * self.per
            if step % H == at % H:
                apply = p
            if step % H == (at - delay) % H:
                launch = p
        return launch, apply

    # -- launch ------------------------------------------------------------------------------------
    @torch.no_grad()
    def launch(self, fragment: int, view: WorldView, global_pg: dist.ProcessGroup, contributing: bool,
               tokens: int | None = None) -> bool:
        """Start the fragment's all-reduce (shared - model, or zeros) in the background over the
        world `view` (every node in it sends; with `tokens`, weighted by them: BackgroundAllReduce);
        returns whether this node's part was finite. On a node that moves rows (zb.diloco.stripes)
        every local rank launches the same fragment at the same step."""
        buffer = torch.zeros(self.numel(fragment))
        if contributing:
            self._pseudo_gradient(fragment, buffer)
        finite = bool(torch.isfinite(buffer).all())
        self.non_finite = not finite
        self.fragment = fragment
        start = self.offsets[fragment]
        feedback = partial(self.feedback.attempt, start, start + buffer.numel()) if self.feedback is not None else None
        self.job = self.transfers.start(buffer, view, global_pg, max(1, view.global_world_size), tokens, feedback)
        return finite

    def _pseudo_gradient(self, fragment: int, out: torch.Tensor) -> None:
        """out := the fragment's shared params - the model's, param by param (a collective over the local
        ranks when rows move inside the node: OuterState.model_stripe)."""
        offset = 0
        for i, (a, b) in zip(self.params_of[fragment], self.ranges[fragment]):
            torch.sub(self.outer.flat.data[a:b], self.outer.model_stripe(i).reshape(-1), out=out[offset:offset + b - a])
            offset += b - a

    def wait(self) -> Arrival | None:
        if self.job is None:
            return None
        job, self.job = self.job, None
        arrival = job.wait()
        if not arrival.ok:
            log.warning("the background all-reduce of fragment %s failed: %s", self.fragment, arrival.error)
        return arrival

    # -- apply -------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply_average(self, average: torch.Tensor) -> None:
        """Step the fragment's shared outer params and momentum with its average (in place, per param)."""
        assert self.fragment is not None  # launch (or adopt_part) named the fragment whose average this is
        offset = 0
        for a, b in self.ranges[self.fragment]:
            self.opt.step(self.outer.flat.data[a:b], None if self.momentum is None else self.momentum[a:b],
                          average[offset:offset + b - a])
            offset += b - a

    @torch.no_grad()
    def merge(self, alpha: float) -> None:
        """model_p <- alpha * model_p + (1 - alpha) * shared_p for the fragment just applied (on a node that
        moves rows, reads and writes over its local ranks: every rank merges alike)."""
        assert self.fragment is not None  # the fragment just applied
        # One push for the fragment: one device synchronize, not one per param; it holds the fragment's merged
        # stripes at once, as large as its send buffer.
        params = self.params_of[self.fragment]
        self.outer.push_params(params, [torch.lerp(self.outer.views[i], self.outer.model_stripe(i), alpha)
                                        for i in params])

    def average_numel(self, part: int) -> int:
        """Values in fragment `part`'s average (0 for a part that is no fragment: refused)."""
        return self.numel(part) if 0 <= part < self.cfg.fragments else 0

    def part_in_flight(self) -> int:
        assert self.fragment is not None  # asked of the donor of an average: it launched that fragment
        return self.fragment

    def adopt_part(self, part: int) -> None:
        """A live-recovery joiner launched nothing: the donor said which fragment's average it sent (or a
        checkpoint did)."""
        self.fragment = part

    def own_tensors(self) -> dict[str, torch.Tensor]:
        return {}   # the merge residue lives in the model's params, which the checkpoint holds

    def load_own_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        warn_dropped(tensors, "streaming", ("own/",))

    def close(self, grace_s: float) -> None:
        if self.job is not None:
            self.job.abandon(grace_s)
            self.job = None
