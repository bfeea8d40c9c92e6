"""One outer step, in one order for every algorithm (zb.diloco.algorithm says what each one adds):

    1. arrive       the average in flight arrives (overlapped algorithms; the wait is the stall)
    2. check in     resolve the world and check in, retried without a failed peer; blocking's
                    all-reduce runs inside each attempt (`exchange`)
    3. apply        the update, on every applier or on none
    4. hand over    the donor sends the run's state to each receiver (blocking join, a lagging node)
    5. catch up     a recovered joiner that applied the update stands at the run's position
    6. books        the params digest for the next check-in, live snapshot, data position, store
                    claims, evictions (not at the run's end: the model ends on the shared params)
    7. launch       what travels behind the next round (eager's average)
    8. end round    diloco.round_seconds: the round's figures, the next round's clock

Every attempt failing at 2 skips 3-7 on every node alike. The class is the node's outer-step half:
the node (zb.diloco.node) joins the run and hands this its collaborators.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from zb import stop_signals
from zb.collectives import PeerFailure
from zb.config_schema import Config
from zb.diloco import checkin, drift, rounds
from zb.diloco.algorithm import CheckInResult, OuterAlgorithm, Step, adaptive_plan, end_round, run_position
from zb.diloco.algorithm import Mesh as TransferMesh
from zb.diloco.background import Arrival
from zb.diloco.checkin import Arrived, Plan
from zb.diloco.claims import RunClaims
from zb.diloco.clip import squared_norm
from zb.diloco.outer import OuterState
from zb.diloco.roles import RoleKeeper
from zb.diloco.stripes import StripeLayout
from zb.diloco.sync import SyncStats
from zb.diloco.transfer import StateTransfer, send_each
from zb.diloco.trust import ClipTrust
from zb.elastic import localsync
from zb.elastic.stores import may_train_on
from zb.elastic.view import WorldView
from zb.errors import EnvironmentFailure, InvalidInput, LeavingRun
from zb.events import OuterReport
from zb.local_world import LocalWorld
from zb.position import RunPosition

log = logging.getLogger("zb.diloco")


class Mesh(TransferMesh, Protocol):
    """The elastic world as the outer step uses it: what an algorithm's transfers use, and resolving."""

    def resolve(self) -> WorldView: ...


class Live(Protocol):
    """Live-recovery snapshots (zb.diloco.live.LiveSnapshots)."""

    def publish(self, outer: OuterState, position: RunPosition) -> None: ...


class OuterSteps:
    """Runs the outer steps of one node in the module's order."""

    def __init__(self, cfg: Config, local: LocalWorld, local_group: torch.distributed.ProcessGroup | None, *,
                 mesh: Mesh, layout: StripeLayout, outer: OuterState, algorithm: OuterAlgorithm, roles: RoleKeeper,
                 trust: ClipTrust, claims: RunClaims, optimizer: torch.optim.Optimizer,
                 work: Callable[[], rounds.RoundWork], clock: rounds.RoundClock | None,
                 live: Callable[[], Live | None] = lambda: None):
        assert cfg.diloco is not None  # a DiLoCo node's
        self.cfg, self.dcfg, self.local, self.local_group = cfg, cfg.diloco, local, local_group
        self.mesh, self.layout, self.outer, self.algorithm = mesh, layout, outer, algorithm
        self.roles, self.trust, self.claims, self.optimizer = roles, trust, claims, optimizer
        self.work, self.clock, self.live = work, clock, live   # live: the node's snapshots, once it serves them
        self.fresh_view = False    # the world start() took is this outer step's: no resolution before it
        self._digest: drift.BackgroundDigest | None = None  # of the outer params since the last outer step

    def run(self, position: RunPosition, data_state: dict[str, Any] | None, *,
            closing: bool = False) -> tuple[OuterReport, RunPosition | None]:
        """One outer step from `position` (this node's, before it). Returns its report and, for a node that
        took over the run's state, the run's position before the step."""
        alg = self.algorithm
        arrival = alg.arrive()                                                     # 1
        done = self.resolve_and_check_in(position, self._arrived(arrival))         # 2
        report = done.report()
        alg.note_arrival(report, arrival)
        if not done.ok or done.plan is None:
            alg.skip(done.attempts, closing)
            if not may_train_on(done.view.store_ok, synced=False):
                self._wait_for_store(position)
            if not closing:
                end_round(self.clock, report, done.view, None)                     # 8
                alg.round_started(report, position)
            return report, None
        plan, position = adaptive_plan(self.clock, done.plan, position)
        step = Step(done.view, plan, position, arrival, done.stats, done.attempts, report, closing,
                    self.roles.recovered)
        applied = alg.apply(step)                                                  # 3
        if applied.caught_up:
            self.roles.caught_up()
        received = self._hand_over(step)                                           # 4
        alg.handed_over(step, received is not None or step.me in plan.receivers)
        if step.was_recovered and applied.joined_run:                              # 5
            received = run_position(plan, position)
            self.roles.caught_up()
        if closing:
            return self._end_on_shared(report), received
        self._keep_books(report, done.view, received or position, data_state)      # 6
        alg.launch(step, received)                                                 # 7
        end_round(self.clock, report, done.view, plan)                             # 8
        alg.round_started(report, received or position)
        return report, received

    def close_run(self, position: RunPosition) -> OuterReport | None:
        """The run's end (every node reaches it at the same step): the last average in flight is applied on
        every node alike, and the model ends at the shared params. None when nothing was in flight."""
        if not self.algorithm.in_flight():
            if self.algorithm.mode.in_flight:
                self.outer.push_to_model()   # the consensus model: no node's own term or merge residue
            return None
        return self.run(position, None, closing=True)[0]

    # -- 1-2: what arrived, and the check-in ------------------------------------------------------------
    def _arrived(self, arrival: Arrival | None) -> Arrived:
        """What this node holds of the average in flight, agreed over its local ranks."""
        if arrival is None:
            return Arrived.NONE
        if not arrival.ok:
            self.mesh.report_failure(arrival.error.rank if arrival.error is not None else None)
        if not localsync.all_ok(self.local_group, arrival.ok):
            return Arrived.FAILED  # one local rank's transfer failed: the node holds no whole average
        return Arrived.OK

    def resolve_and_check_in(self, position: RunPosition, arrived: Arrived) -> CheckInResult:
        """Resolve the world and check in (with the algorithm's exchange), retried without the failed peers."""
        digest = checkin.digest_value(self._node_digest()) if self.dcfg.drift_guard else checkin.UNKNOWN_DIGEST
        work = self.work()   # this node's steps and tokens of the round (the weights of the average, when weighted)
        norm, residual = self._norm(), self._residual_norm()
        view: WorldView | None = None
        plan: Plan | None = None
        stats: SyncStats | None = None
        attempts, resolve_s, checkin_s = 0, 0.0, 0.0
        for attempts in range(1, self.dcfg.retry_all_reduce + 2):
            t0 = time.perf_counter()
            view = self.mesh.view if self.fresh_view else self._resolve()
            assert view is not None  # a fresh view is the one start() just took
            resolve_s += time.perf_counter() - t0
            self.fresh_view = False
            filled_s = self._fill()
            try:
                plan = stats = None
                if self.layout.owner:
                    t0 = time.perf_counter()
                    plan = checkin.check_in(self.mesh.global_pg, view.global_rank, view.global_world_size,
                                            self.roles.role, outer_step=position.outer_step, step=position.step,
                                            deadline_s=max(5.0, self.cfg.elastic.sync_deadline), digest=digest,
                                            arrived=arrived, round_steps=work.steps, round_tokens=work.tokens,
                                            norm=norm, clip=self.dcfg.clip, evicted=self.trust.evicted_ranks(view),
                                            residual=residual)
                    checkin_s += time.perf_counter() - t0
                    self._note_lagging(view, plan, position.outer_step)
                    stats = self.algorithm.exchange(view, plan)
                elif self.algorithm.exchanges:
                    stats = SyncStats()          # a rank with no stripe sends nothing
                if stats is not None:
                    stats.d2h_s += filled_s
                ok = True
            except PeerFailure as e:
                log.warning("outer step attempt %d failed: %s", attempts, e)
                self.mesh.report_failure(e.rank)
                ok = False
            failed = self._failed_on_any_stripe(stats)
            if not self.layout.identity:
                plan = self._plan_of_head(plan)
            if localsync.all_ok(self.local_group, ok):
                if plan is not None:
                    plan = dataclasses.replace(plan, failed_check=failed)
                    if self.layout.owner:
                        self.trust.note(view, plan, position.outer_step)
                return CheckInResult(view, plan, stats, attempts, True, resolve_s, checkin_s)
            stats = None
        assert view is not None  # at least one attempt
        return CheckInResult(view, plan, None, attempts, False, resolve_s, checkin_s)

    def _wait_for_store(self, position: RunPosition) -> None:
        """This node lost the store and part of its world at the same outer step (zb.elastic.stores.may_train_on):
        ask the store again every few seconds, up to elastic.store_timeout, before training another round. When it
        answers, the world it resolves says what this node is now (still a member, or readmitted: then it receives
        the run's state at the next outer step, as a node the run evicted does)."""
        e = self.cfg.elastic
        log.warning("outer step %d: the store does not answer and part of the world is gone: waiting for the store "
                    "(up to elastic.store_timeout, %g s) instead of training apart from nodes that may still reach it",
                    position.outer_step + 1, e.store_timeout)
        give_up = time.monotonic() + e.store_timeout
        while True:
            leaving = stop_signals.requested()   # every local rank decides the same: each check is one vote
            if not localsync.all_ok(self.local_group, leaving is None):
                raise LeavingRun(f"{leaving or 'a stop signal'} received while waiting for the store")
            if not localsync.all_ok(self.local_group, time.monotonic() < give_up):
                raise EnvironmentFailure(f"the store did not answer for elastic.store_timeout ({e.store_timeout:g} s) "
                                         "after this node lost part of its world: it stops rather than train apart "
                                         "(its checkpoints stay; start it again to rejoin the run)")
            time.sleep(max(1.0, e.heartbeat_interval))
            view = self._resolve()
            if view.store_ok:
                log.warning("the store answers again: this node is in mesh v%d of %d nodes", view.mesh_version,
                            view.global_world_size)
                return

    def _norm(self) -> float:
        """diloco.clip: this node's pseudo-gradient norm, compared with the others' in the check-in (blocking
        only: the mode refuses it with overlap). Its stripes are summed over its local ranks."""
        if not self.algorithm.exchanges or self.dcfg.clip is None or not self.roles.contributing:
            return 0.0
        return math.sqrt(localsync.sum_float(self.local_group, self.outer.pseudo_gradient_sq()))

    def _residual_norm(self) -> float:
        """diloco.clip with error feedback: the norm of what this node's rings add besides its pseudo-gradient (the
        checked average's bound counts it; zb.diloco.verify), summed over its local ranks."""
        feedback = self.algorithm.feedback
        if not self.algorithm.exchanges or self.dcfg.clip is None or feedback is None:
            return 0.0
        return math.sqrt(localsync.sum_float(self.local_group, squared_norm(feedback.residual)))

    def _failed_on_any_stripe(self, stats: SyncStats | None) -> list[int]:
        """The ranks the checked average left out on any of this node's stripes (each stripe's group checks its
        own sum): one list on every local rank, so every stripe's trust counts them alike."""
        mine = stats.failed if stats is not None else []
        if self.local.world_size == 1 or self.dcfg.clip is None:   # only diloco.clip checks (the same on every rank)
            return list(mine)
        lists = localsync.all_gather_bytes(self.local_group, json.dumps(mine).encode())
        return sorted({r for data in lists for r in json.loads(data)})

    def _fill(self) -> float:
        """Rows move inside the node (zb.diloco.stripes): the blocking pseudo-gradient is filled on every local
        rank, every attempt. Returns the seconds it took."""
        if not self.algorithm.exchanges or self.layout.identity:
            return 0.0
        t0 = time.perf_counter()
        self.outer.fill_pseudo_gradients()
        return time.perf_counter() - t0

    def _resolve(self) -> WorldView:
        """Resolve the world; a node the run evicted while it was alive (frozen, partitioned) and that
        was admitted again holds stale params: it must receive the run's state before it contributes."""
        view = self.mesh.resolve()
        if view.is_joiner:
            self.roles.readmitted()
        return view

    def _plan_of_head(self, plan: Plan | None) -> Plan | None:
        """Local rank 0's plan on every local rank (on a node with more local ranks than stripes, not every
        rank checks in)."""
        data = localsync.broadcast_json(self.local_group, self.local.rank,
                                        {"plan": dataclasses.asdict(plan) if plan is not None else None})
        return Plan(**data["plan"]) if data["plan"] is not None else None

    def _note_lagging(self, view: WorldView, plan: Plan, outer_step: int) -> None:
        """Say why a node that thinks it trained with the run is told to receive the state instead."""
        if self.roles.contributing and view.global_rank in plan.receivers:
            log.warning("this node's outer params are not the run's (it is at outer step %d, the run at %d, or its "
                        "params differ from the majority's): it receives the run's state instead of contributing",
                        outer_step, plan.run_outer_step)

    # -- 4: hand-over -------------------------------------------------------------------------------
    def _hand_over(self, step: Step) -> RunPosition | None:
        """Donor -> receivers, after the outer step; returns the position a receiver got."""
        view, plan, position = step.view, step.plan, step.position
        if not plan.receivers:
            return None
        assert plan.donor is not None  # make_plan names a donor whenever there are receivers
        transfer = StateTransfer(self.mesh.global_pg, self.outer, self.optimizer, self.dcfg.min_bandwidth_mbps)
        if view.global_rank == plan.donor:
            transfer.stage(read=True)
            if self.layout.owner:
                send_each(self.mesh, plan.receivers, lambda r: transfer.send(r, position), "state")
            return None
        if view.global_rank not in plan.receivers:
            return None
        return self._receive(transfer, plan.donor)

    def _receive(self, transfer: StateTransfer, donor: int) -> RunPosition:
        started = time.perf_counter()
        transfer.stage(read=False)
        received, error = None, None
        if self.layout.owner:
            try:
                received = transfer.receive(donor)
            except (PeerFailure, InvalidInput) as e:
                error = e
        if not localsync.all_ok(self.local_group, error is None):
            if isinstance(error, InvalidInput):
                raise error
            raise EnvironmentFailure(f"joining failed: the state transfer from rank {donor} broke "
                                     f"({error or 'on another local rank'}); restart this node to join again")
        transfer.finish()
        if not self.layout.identity:
            data = localsync.broadcast_json(self.local_group, self.local.rank,
                                            {"position": received.to_json() if received is not None else None})
            received = RunPosition.from_json(data["position"])
        assert received is not None  # every local rank has the head's
        self.roles.caught_up()
        self.algorithm.took_state()
        log.info("received the run's state from rank %d in %.2f s", donor, time.perf_counter() - started)
        return received

    # -- 6: books ---------------------------------------------------------------------------------
    def _keep_books(self, report: OuterReport, view: WorldView, position: RunPosition,
                    data_state: dict[str, Any] | None) -> None:
        """What follows every outer step, whatever the algorithm; `position` is where this node stood before it."""
        # The outer params stay as they are now until the next outer step: hash them while the inner
        # steps run, for that step's check-in (and, after the hand-over, a receiver's params_hash).
        self._digest = drift.BackgroundDigest(self.outer.flat) if self.dcfg.drift_guard else None
        if self.cfg.train.log_model_hash:
            report.params_hash = self.params_hash()
        self.claims.follow_client(view.store_epoch)
        live = self.live()
        if live is not None:
            self._publish_live(live, position, view)
        self.claims.save_position(data_state)
        if self.local.is_head:
            self.claims.reassert(view.uid, view.store_epoch, self.trust.evicted)
        if self.dcfg.evict_clipped:
            self._after_evictions(report, view.uid)

    def _publish_live(self, live: Live, before: RunPosition, view: WorldView) -> None:
        """Serve the outer state as it stands after this outer step (no node's own token count)."""
        from zb.diloco.live import publish_progress

        after = dataclasses.replace(before, outer_step=before.outer_step + 1, tokens=0)
        live.publish(self.outer, after)
        if view.global_rank == 0 and self.local.is_head:
            self.claims.write("publish the run's progress",
                              lambda store: publish_progress(store, after.outer_step, after.step))

    def _after_evictions(self, report: OuterReport, me: str) -> None:
        """diloco.evict_clipped: name the nodes this outer step evicted in its report, list them in the store for
        the leader's next resolution (retried at the next outer step when the store does not answer), and end
        this node, on every local rank, when it is one of them."""
        report.evicted = self.trust.take_evicted_now() or report.evicted
        if self.local.is_head and self.trust.unlisted and self.claims.list_evicted(sorted(self.trust.unlisted)):
            self.trust.listed()

        def refuse() -> dict[str, Any]:
            self.trust.refuse_if_evicted(me)
            return {}

        localsync.run_on_head(self.local_group, self.local.rank, refuse)

    def _end_on_shared(self, report: OuterReport) -> OuterReport:
        """The run ends on the shared params: the consensus model, the same on every node."""
        self.outer.push_to_model()
        self._digest = None  # the shared params may just have changed: hash them anew
        if self.cfg.train.log_model_hash:
            report.params_hash = self.params_hash()
        return report

    # -- the params digest ------------------------------------------------------------------------
    def _node_digest(self) -> bytes:
        """sha256 over every stripe's outer-param digest: the same bytes on every local rank. Uses
        the digest started after the last outer step (nothing has changed the outer params since)."""
        mine = self._digest.result() if self._digest is not None else drift.digest(self.outer.flat)
        parts = localsync.all_gather_bytes(self.local_group, mine)[:self.layout.stripes]  # the stripes' owners
        return hashlib.sha256(b"".join(parts)).digest()

    def params_hash(self) -> str:
        """Hash of the outer params over the node's local ranks (equal on every node when in sync)."""
        return self._node_digest().hex()[:16]
