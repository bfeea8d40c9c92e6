"""One DiLoCo node across an elastic world: start, outer steps, joiners, guards, leave.

The node orchestrates what every outer-step algorithm shares; the algorithm (zb.diloco.algorithm,
chosen by diloco.overlap from zb.diloco.algorithms) owns how a pseudo-gradient becomes an update.
Blocking outer step, as data flows (docs/architecture.md):
  1. resolve the world (elastic mesh): admit joiners, drop the dead, rebuild groups if needed;
  2. check in (zb.diloco.checkin): who contributes, who only applies, who needs the full state
     (a joiner, a node evicted while alive and admitted again, a node whose params lag or differ);
  3. all-reduce SUM the pseudo-gradients (non-contributors send zeros), divide by the contributors;
  4. the node's local ranks agree that every rank's sync succeeded and was finite; on a failure
     resolve again without the failed peer and recompute (the buffer is undefined afterwards);
  5. outer optimizer step on CPU, copy back into the model shards;
  6. the donor (lowest contributing rank) sends the full state to each receiver (blocking join);
  7. with live recovery, a RAM snapshot of the outer state is served for future joiners.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from zb.collectives import PeerFailure
from zb.config_schema import Config, DilocoConfig
from zb.diloco import checkin, clip, drift, rounds, slots
from zb.diloco.algorithm import CheckIn, OuterAlgorithm
from zb.diloco.algorithms import ALGORITHMS
from zb.diloco.outer import OuterState
from zb.diloco.roles import RoleKeeper
from zb.diloco.streams import StreamGroups
from zb.diloco.stripes import StripeLayout
from zb.diloco.sync import SyncStats
from zb.diloco.transfer import StateTransfer
from zb.elastic import ElasticDeviceMesh, localsync
from zb.elastic.membership import exclude
from zb.elastic.store_state import ended_world
from zb.elastic.stores import shared_stores
from zb.elastic.tcpstore import store_errors
from zb.errors import EnvironmentFailure, InvalidInput
from zb.events import OuterReport, emit
from zb.fingerprint import check_against, encode
from zb.position import RunPosition

if TYPE_CHECKING:
    from zb.diloco.live import LiveSnapshots

log = logging.getLogger("zb.diloco")

CLIPPED_REPORT_AFTER = 3     # diloco.clip: outer steps in a row a node is clipped (over clip.OUTSIZED x the median)
                             # before it is reported (and with diloco.evict_clipped, evicted)
BEST_EFFORT_CONNECT_S = 2.0   # the most an after-step write waits for the store (see _write_store)

FINGERPRINT_KEY = "zb/run/fingerprint"


class DilocoNode:
    """This node's part in a DiLoCo run: joining it, every outer step (resolve, check in, sync, apply,
    hand state to joiners), live-recovery snapshots, and leaving. Owns the outer state and the
    elastic mesh; the training loop owns the model, the inner optimizer and the counters.

    `local_group` carries the control messages between the node's local ranks: a gloo group even
    on GPUs (CPU tensors, and long waits raise instead of tripping NCCL's watchdog); None alone.
    The collaborators can be passed in (the in-process fake world of the tests does): `mesh` (default
    an ElasticDeviceMesh over the run's store), `connect` (a store client; default the current store of zb.elastic.stores).
    `work_source`, for a user that counts its own work (DiLoCo-SWARM: micro-batches a stage worker
    processed since the last outer step), makes the average weigh contributors by it, as
    diloco.round_seconds weighs them by tokens."""

    def __init__(self, cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, local, sink,
                 fingerprint: dict, local_group=None, *, mesh=None, connect: Callable[[], Any] | None = None,
                 work_source: Callable[[], rounds.RoundWork] | None = None):
        assert cfg.diloco is not None, "a DiLoCo node needs the [diloco] section"
        self.dcfg: DilocoConfig = cfg.diloco
        self.cfg, self.optimizer, self.local, self.sink = cfg, optimizer, local, sink
        self.model = model
        # The run's fingerprint; its "stripes" becomes the run's at start (the same dict is in checkpoints).
        self.fingerprint = fingerprint
        self.local_group = local_group
        # The outer state's layout is the run's (diloco.stripes, zb.diloco.stripes): known at start.
        self.outer: OuterState | None = None
        self.layout: StripeLayout | None = None
        self.mesh = mesh or ElasticDeviceMesh(cfg.elastic, self.local_group, local_rank=local.rank,
                                              stripes=fingerprint["stripes"], sink=sink if local.is_head else None,
                                              ring_backward=cfg.diloco.compression == "none")  # gloo's ring: r -> r - 1
        self._connect_store = connect
        self.streams = StreamGroups(cfg.diloco.streams, local.rank, cfg.elastic.pg_timeout)
        self.algorithm: OuterAlgorithm | None = None   # made when the outer state is laid out (start)
        self.rounds: rounds.RoundClock | None = None
        self.work_source = work_source
        if cfg.diloco.round_seconds is not None:
            # Streaming: the round's fragment boundaries share its budget (zb.diloco.fragment_rounds).
            parts = cfg.diloco.fragments if cfg.diloco.overlap == "streaming" else 1
            self.rounds = rounds.RoundClock(cfg.diloco.round_seconds, cfg.train.max_steps or cfg.optim.total_steps,
                                            cfg.optim.batch_size * cfg.data.seq_length, local_group, parts=parts)
        self.store: Any = None  # a torch Store client (tcpstore.connect); None until start(), and after a failure
        self.slot = self.num_slots = 0
        self.roles = RoleKeeper()
        self.recovered_position: RunPosition | None = None
        self.live: LiveSnapshots | None = None
        self._fresh_view = False
        self._digest: drift.BackgroundDigest | None = None  # of the outer params since the last outer step
        self._claimed_in: int | None = None   # the store client epoch whose store holds this node's claims
        self._client_epoch: int | None = None  # the head's store client epoch when self.store was last trusted
        self._clipped_rounds: dict[str, int] = {}  # diloco.clip: node id -> outer steps in a row it was clipped
        self._clipped_counted = -1                  # the outer step those counts include
        self._evicted: set[str] = set()    # diloco.evict_clipped: node ids evicted (the same set on every node)
        self._evicted_now: list[str] = []  # ... at this outer step (for its report)
        self._unlisted: set[str] = set()   # ... not written to the store's list of evicted ids yet (retried)
        if cfg.diloco.compression != "none":
            from zb.collectives import kernels

            kernels.use_cpp()  # build or load the kernels now, not inside the first timed outer step
            kernels.set_colocated(local.world_size)  # this node's ranks all-reduce at once: a share of the cores each
        if cfg.ckpt.live_recovery:
            from zb.ckpt.sidecar.token import read_token

            read_token(secret=shared_stores(cfg.elastic).secret)  # fail before joining the run: the sidecar needs a token

    @property
    def _outer(self) -> OuterState:
        """The outer state; start() lays it out (in the run's stripes) before anything uses it."""
        assert self.outer is not None, "DilocoNode.start() lays the outer state out"
        return self.outer

    @property
    def _layout(self) -> StripeLayout:
        assert self.layout is not None, "DilocoNode.start() lays the outer state out"
        return self.layout

    @property
    def _algorithm(self) -> OuterAlgorithm:
        assert self.algorithm is not None, "DilocoNode.start() makes the outer-step algorithm"
        return self.algorithm

    # -- start -------------------------------------------------------------------------------
    def start(self) -> int:
        """Join the run; returns this node's data slot. Refuses (exit 2) a node whose settings differ."""
        self._use_stripes(self._agree(self._check_fingerprint if self.local.is_head else None)["stripes"])
        self.store = self.connect()
        recovered = self._recover_live() if self.cfg.ckpt.live_recovery and not self.dcfg.blocking_join else False
        view = self.mesh.start()
        others_were_there = any(uid not in view.joined for uid in view.nodes)
        if view.is_joiner and others_were_there:
            self.roles.joined(recovered=recovered)
        self._fresh_view = True
        self.slot, self.num_slots = self._claim_slot(view)
        if self.cfg.ckpt.live_recovery and self._layout.owner:
            self._serve_live(view.uid)
        log.info("node %s: global rank %d of %d (mesh v%d), data slot %d%s", view.uid, view.global_rank,
                 view.global_world_size, view.mesh_version, self.slot, self.roles.joining_note())
        return self.slot

    def connect(self, wait_s: float | None = None) -> Any:
        """A new client of the run's store, waiting for it up to `wait_s` (default elastic.connect_timeout)."""
        if self._connect_store is not None:
            return self._connect_store()
        e = self.cfg.elastic
        return shared_stores(e).connect(e.connect_timeout if wait_s is None else min(wait_s, e.connect_timeout),
                                        e.store_timeout, e.namespace)

    def _agree(self, head_fn) -> dict:
        """Local rank 0 runs `head_fn` and shares its JSON result; an error there stops every rank."""
        payload = None
        if self.local.is_head:
            try:
                payload = head_fn() if head_fn else {}
            except Exception as e:  # noqa: BLE001 - told to the other local ranks, then re-raised
                localsync.broadcast_json(self.local_group, 0, {"error": str(e), "code": getattr(e, "exit_code", 1)})
                raise
        payload = localsync.broadcast_json(self.local_group, self.local.rank, payload)
        if "error" in payload:
            raise (InvalidInput if payload.get("code") == 2 else EnvironmentFailure)(payload["error"])
        return payload

    def _check_fingerprint(self) -> dict:
        """The first node publishes the run's fingerprint; every later node must match it. A node that
        leaves diloco.stripes unset takes the run's."""
        self.mesh.host_store_if_asked()  # a node hosting the store (Prime style) checks against itself
        published = self.connect().compare_set(FINGERPRINT_KEY, "", encode(self.fingerprint)).decode()
        mine = dict(self.fingerprint)
        if self.dcfg.stripes is None:
            try:
                mine["stripes"] = json.loads(published).get("stripes", mine["stripes"])
            except (ValueError, AttributeError):
                pass  # check_against names the unreadable fingerprint
        check_against(mine, published, self._run_ended)
        return {"stripes": mine["stripes"]}

    def _run_ended(self) -> str | None:
        """How the store's run ended, when every node of its last world said goodbye (else None)."""
        world = ended_world(self.connect())
        if world is None:
            return None
        return f"every node of its last world, mesh version {world.version}, left: {', '.join(world.nodes) or 'none'}"

    def _use_stripes(self, stripes: int) -> None:
        """Lay the outer state out in the run's stripes (zb.diloco.stripes); a node with fewer local ranks
        than the run has stripes cannot hold them: exit 2 on every local rank."""
        n = self.local.world_size
        if n < stripes:
            raise InvalidInput(f"this node has {n} local rank{'s' * (n != 1)} but the run's outer state is in {stripes} "
                               "stripes (diloco.stripes), one per local rank: start this node with at least "
                               f"{stripes} local ranks, or start the run with diloco.stripes = {n} to pool nodes this "
                               "small")
        self.fingerprint["stripes"] = stripes
        self.layout = StripeLayout(stripes, self.local.rank, n, self.local_group)
        self.mesh.use_stripes(stripes)
        self.outer = OuterState(self.model, self.dcfg, self.layout)
        if not self._layout.identity and self.local.is_head:
            log.info("this node has %d local ranks and the run %d stripes: rows move inside the node at every outer "
                     "step (local ranks %d..%d hold no outer state)", n, stripes, stripes, n - 1)
        self.algorithm = ALGORITHMS[self.dcfg.overlap](self, self.outer)
        if self.algorithm.extra_bytes and self.local.is_head:
            log.info("diloco.overlap = %s: %.1f MB more CPU memory per local rank (buffers in flight%s)",
                     self.dcfg.overlap, self.algorithm.extra_bytes / 1e6,
                     ", the eager term" if self.dcfg.overlap == "eager" else "")
        feedback = self.algorithm.feedback
        if feedback is not None and self.local.is_head:
            log.info("error feedback (diloco.compression = %s): %.1f MB of host memory per local rank, 8 bytes per "
                     "parameter of its stripe (the residual and its copy for a failed attempt)", self.dcfg.compression,
                     feedback.nbytes / 1e6)

    def _claim_slot(self, view) -> tuple[int, int]:
        def claim() -> dict:
            num = self.cfg.data.data_world_size or max(self.cfg.elastic.world_size, view.global_world_size)
            pref = self.cfg.data.data_rank if self.cfg.data.data_rank is not None else self.cfg.elastic.rank
            return {"slot": slots.claim_slot(self.store, view.uid, view.nodes, num, pref), "num": num}

        payload = self._agree(claim)
        return payload["slot"], payload["num"]

    @property
    def joining(self) -> bool:
        """This node joined a running run: it takes part in the current outer step right away."""
        return self.roles.joining

    def data_position(self) -> dict | None:
        """Where the previous holder of this node's slot stopped (None: start of the shard)."""
        return slots.load_position(self.store, self.slot, self.local.rank, self.local.world_size)

    # -- live recovery ---------------------------------------------------------------------------
    def _recover_live(self) -> bool:
        from zb.diloco.live import recover

        started = time.perf_counter()
        owner = self._layout.owner    # a rank with no stripe has nothing to fetch
        uid = self.cfg.elastic.unique_id
        assert uid is not None, "the entry point names the node (node_identity) before it builds the DilocoNode"
        found = recover(self.store, self.cfg, uid, self.local.rank, self._outer,
                        encode(self.fingerprint)) if owner else None
        ok = localsync.all_ok(self.local_group, found is not None or not owner)
        if ok:
            self._outer.push_to_model()
            mine = found[0].to_json() if found is not None else None
            position = RunPosition.from_json(localsync.broadcast_json(self.local_group, self.local.rank,
                                                                      {"position": mine})["position"])
            self.recovered_position = position
            if self.local.is_head:
                assert found is not None  # local rank 0 always holds a stripe: all_ok above says it found one
                emit(self.sink, found[1].record())
                log.info("recovered the run's outer state of outer step %s from %s in %.2f s",
                         position.outer_step, ", ".join(found[1].peers), time.perf_counter() - started)
        return ok

    def _serve_live(self, uid: str) -> None:
        from zb.diloco.live import LiveSnapshots

        self.live = LiveSnapshots(self.cfg, uid, self.local.rank, encode(self.fingerprint))
        self.live.publish_address(self.store)

    def _publish_live(self, before: RunPosition, view) -> None:
        """Serve the outer state as it stands after this outer step (no node's own token count)."""
        from zb.diloco.live import publish_progress

        after = replace(before, outer_step=before.outer_step + 1, tokens=0)
        assert self.live is not None  # _after_step publishes only with a live sidecar
        # start() laid the outer state out before any outer step
        self.live.publish(cast(OuterState, self.outer), after)
        if view.global_rank == 0 and self.local.is_head:
            self._write_store("publish the run's progress",
                              lambda store: publish_progress(store, after.outer_step, after.step))

    # -- outer step ----------------------------------------------------------------------------
    def outer_step(self, position: RunPosition, data_state: dict | None) -> tuple[OuterReport, RunPosition | None]:
        """Run one outer step from `position` (this node's, before it). Returns its report and, for a
        node that took over the run's state, the run's position before the step."""
        t0 = time.perf_counter()
        report, received = self._algorithm.outer_step(position, data_state)
        report.boundary_s = round(time.perf_counter() - t0, 4)
        return report, received

    def sync_points(self, step: int) -> tuple[int | None, int | None]:
        """(fragment to launch, fragment to apply) after inner step `step`; applying is the outer step."""
        return self._algorithm.sync_points(step)

    def launch_fragment(self, fragment: int) -> None:
        """Streaming: start the fragment's all-reduce behind the next inner steps."""
        self._algorithm.launch_fragment(fragment)

    def close_run(self, position: RunPosition) -> OuterReport | None:
        """The run's end under overlap (every node reaches it at the same step, optim.total_steps):
        wait for the average in flight, apply it on every node alike, and leave the model at the
        shared params, the consensus model with no node's eager term or merge residue. None when
        nothing was in flight."""
        return self._algorithm.close_run(position)

    def begin_rounds(self, position: RunPosition) -> None:
        """The training loop starts at `position`: the first round's budget (diloco.round_seconds) runs from here."""
        if self.rounds is not None:
            self.rounds.start()
            self._algorithm.begin_rounds(position)

    @property
    def weighted(self) -> bool:
        """The average weighs contributors by their round's work (tokens or counted micro-batches)."""
        return self.rounds is not None or self.work_source is not None

    def after_step(self, report: OuterReport, view, position: RunPosition, data_state: dict | None) -> None:
        """What follows every outer step, whatever the algorithm; `position` is where this node stood before it."""
        # The outer params stay as they are now until the next outer step: hash them while the inner
        # steps run, for that step's check-in (and, after the hand-over, a receiver's params_hash).
        self._digest = drift.BackgroundDigest(self._outer.flat) if self.dcfg.drift_guard else None
        if self.cfg.train.log_model_hash:
            report.params_hash = self.params_hash()
        if view.store_epoch != self._client_epoch:   # the head made a new client (a restarted store, or the run
            self.store, self._client_epoch = None, view.store_epoch   # moved on to the next one): so does this rank
        if self.live is not None:
            self._publish_live(position, view)
        self._save_position(data_state)
        if self.local.is_head and view.store_epoch != self._claimed_in:
            self._reassert_claims(view)
        if self.dcfg.evict_clipped:
            self._after_evictions(report, view.uid)

    def close_on_shared(self, report: OuterReport) -> OuterReport:
        """The run ends on the shared params: the consensus model, the same on every node."""
        self._outer.push_to_model()
        self._digest = None  # the shared params may just have changed: hash them anew
        if self.cfg.train.log_model_hash:
            report.params_hash = self.params_hash()
        return report

    def check_in(self, position: RunPosition, arrived: int, sync=None) -> CheckIn:
        """Resolve the world and check in (blocking: and sync the pseudo-gradient with `sync`), retried
        without the failed peers."""
        digest = checkin.digest_value(self._node_digest()) if self.dcfg.drift_guard else checkin.UNKNOWN_DIGEST
        # This node's steps and tokens of the round (the weights of the average, when weighted).
        work = self.rounds.work() if self.rounds is not None else \
            self.work_source() if self.work_source is not None else rounds.RoundWork(0, 0)
        # diloco.clip: this node's pseudo-gradient norm, compared with the others' in the check-in (blocking only:
        # zb.config_checks refuses it with overlap). Its stripes are summed over its local ranks.
        norm = math.sqrt(localsync.sum_float(self.local_group, self._outer.pseudo_gradient_sq())) \
            if sync is not None and self.dcfg.clip is not None and self.roles.contributing else 0.0
        view = plan = stats = None
        attempts, resolve_s, checkin_s = 0, 0.0, 0.0
        for attempts in range(1, self.dcfg.retry_all_reduce + 2):
            t0 = time.perf_counter()
            view = self.mesh.view if self._fresh_view else self._resolve()
            assert view is not None  # a fresh view is the one start() just took
            resolve_s += time.perf_counter() - t0
            self._fresh_view = False
            filled_s = 0.0
            if sync is not None and not self._layout.identity:
                t0 = time.perf_counter()
                self._outer.fill_pseudo_gradients()   # rows move inside the node: every local rank, every attempt
                filled_s = time.perf_counter() - t0
            try:
                plan = stats = None
                if self._layout.owner:
                    t0 = time.perf_counter()
                    plan = checkin.check_in(self.mesh.global_pg, view.global_rank, view.global_world_size,
                                            self.roles.role, outer_step=position.outer_step, step=position.step,
                                            deadline_s=_deadline(self.cfg), digest=digest, arrived=arrived,
                                            round_steps=work.steps, round_tokens=work.tokens, norm=norm,
                                            clip=self.dcfg.clip,
                                            evicted=[r for r, u in enumerate(view.nodes) if u in self._evicted])
                    checkin_s += time.perf_counter() - t0
                    self._note_lagging(view, plan, position.outer_step)
                    self._note_clipped(view, plan, position.outer_step)
                    stats = sync(view, plan) if sync is not None else None
                elif sync is not None:
                    stats = SyncStats()          # a rank with no stripe sends nothing
                if stats is not None:
                    stats.d2h_s += filled_s
                ok = True
            except PeerFailure as e:
                log.warning("outer step attempt %d failed: %s", attempts, e)
                self.mesh.report_failure(e.rank)
                ok = False
            if not self._layout.identity:
                plan = self._plan_of_head(plan)
            if localsync.all_ok(self.local_group, ok):
                return CheckIn(view, plan, stats, attempts, True, resolve_s, checkin_s)
            stats = None
        return CheckIn(view, plan, None, attempts, False, resolve_s, checkin_s)

    def _plan_of_head(self, plan: checkin.Plan | None) -> checkin.Plan | None:
        """Local rank 0's plan on every local rank (on a node with more local ranks than stripes, not every
        rank checks in)."""
        data = localsync.broadcast_json(self.local_group, self.local.rank,
                                        {"plan": dataclasses.asdict(plan) if plan is not None else None})
        return checkin.Plan(**data["plan"]) if data["plan"] is not None else None

    def hand_over_state(self, view, plan: checkin.Plan, position: RunPosition) -> RunPosition | None:
        """Donor -> receivers, after the outer step; returns the position a receiver got."""
        if not plan.receivers:
            return None
        assert plan.donor is not None  # make_plan names a donor whenever there are receivers
        transfer = StateTransfer(self.mesh.global_pg, self._outer, self.optimizer, self.dcfg.min_bandwidth_mbps)
        if view.global_rank == plan.donor:
            transfer.stage(read=True)
            if self._layout.owner:
                self.send_each(plan.receivers, lambda r: transfer.send(r, position), "state")
            return None
        if view.global_rank not in plan.receivers:
            return None
        started = time.perf_counter()
        transfer.stage(read=False)
        received, error = None, None
        if self._layout.owner:
            try:
                received = transfer.receive(plan.donor)
            except (PeerFailure, InvalidInput) as e:
                error = e
        if not localsync.all_ok(self.local_group, error is None):
            if isinstance(error, InvalidInput):
                raise error
            raise EnvironmentFailure(f"joining failed: the state transfer from rank {plan.donor} broke "
                                     f"({error or 'on another local rank'}); restart this node to join again")
        transfer.finish()
        if not self._layout.identity:
            data = localsync.broadcast_json(self.local_group, self.local.rank,
                                            {"position": received.to_json() if received is not None else None})
            received = RunPosition.from_json(data["position"])
        self.roles.caught_up()
        self._algorithm.took_state()
        log.info("received the run's state from rank %d in %.2f s", plan.donor, time.perf_counter() - started)
        return received

    def send_each(self, ranks: list[int], send, what: str) -> None:
        """The donor's side of a hand-over: a joiner that fails to receive is reported, the rest go on."""
        for r in ranks:
            try:
                send(r)
            except PeerFailure as e:
                log.warning("could not send %s to joiner rank %d: %s", what, r, e)
                self.mesh.report_failure(r)

    def _resolve(self):
        """Resolve the world; a node the run evicted while it was alive (frozen, partitioned) and that
        was admitted again holds stale params: it must receive the run's state before it contributes."""
        view = self.mesh.resolve()
        if view.is_joiner:
            self.roles.readmitted()
        return view

    def _note_lagging(self, view, plan: checkin.Plan, outer_step: int) -> None:
        """Say why a node that thinks it trained with the run is told to receive the state instead."""
        if self.roles.contributing and view.global_rank in plan.receivers:
            log.warning("this node's outer params are not the run's (it is at outer step %d, the run at %d, or its "
                        "params differ from the majority's): it receives the run's state instead of contributing",
                        outer_step, plan.run_outer_step)

    def _note_clipped(self, view, plan: checkin.Plan, outer_step: int) -> None:
        """diloco.clip's decision, the same on every node (a pure function of the check-in table); a retried
        attempt of the same outer step does not count again toward the nodes clipped in a row. With
        diloco.evict_clipped, a node clipped CLIPPED_REPORT_AFTER outer steps in a row is evicted: every
        local rank that checks in decides it alike, from its replica group's table (the norms are the node's)."""
        if outer_step != self._clipped_counted:
            self._clipped_counted = outer_step
            self._clipped_rounds = clip.clipped_in_a_row(self._clipped_rounds, (view.nodes[r] for r in plan.outsized()))
            if self.dcfg.evict_clipped:
                self._evict(clip.to_evict(self._clipped_rounds, CLIPPED_REPORT_AFTER, self._evicted))
        if not self.local.is_head:
            return
        contributing = sorted(plan.norms[r] for r in plan.contributors)
        for uid, in_a_row in self._clipped_rounds.items():
            if in_a_row >= CLIPPED_REPORT_AFTER and uid not in self._evicted:
                log.error("diloco.clip: node %s was clipped in %d outer steps in a row: a diverged or hostile node? "
                          "(its updates count for at most diloco.clip x the median)", uid, in_a_row)
        outsized = set(plan.outsized())
        for r in plan.clipped():   # a mild clip (with K under clip.OUTSIZED, of honest nodes too) is no warning
            log.log(logging.WARNING if r in outsized else logging.INFO,
                    "diloco.clip: node %s's pseudo-gradient norm %.4g is over %g x the round's median %.4g: scaled "
                    "down by %.3g", view.nodes[r], plan.norms[r], self.dcfg.clip,
                    contributing[(len(contributing) - 1) // 2], plan.scales[r])

    def _evict(self, uids: list[str]) -> None:
        """diloco.evict_clipped: from the next outer step on these nodes' contributions count for nothing (the
        check-in leaves their ranks out), the leader leaves them out of the next world and never admits their
        ids again (keys.EVICTED, written after this outer step), and an evicted node leaves after it."""
        for uid in uids:
            self._evicted.add(uid)
            self._unlisted.add(uid)
            self._evicted_now.append(uid)
            if self.local.is_head:
                log.error("diloco.evict_clipped: node %s is evicted from the run: its pseudo-gradient was clipped in "
                          "%d outer steps in a row (over diloco.clip = %g x the round's median); from the next outer "
                          "step it counts for nothing, and its id is not admitted again", uid,
                          self._clipped_rounds[uid], self.dcfg.clip)

    def _after_evictions(self, report: OuterReport, me: str) -> None:
        """After an outer step with diloco.evict_clipped: name the nodes it evicted in its report, list them in the
        store for the leader's next resolution (retried at the next outer step when the store does not answer),
        and end this node, on every local rank, when it is one of them."""
        if self._evicted_now:
            report.evicted = list(self._evicted_now)
            self._evicted_now = []
        if self.local.is_head and self._unlisted:
            listed = sorted(self._unlisted)
            if self._write_store("list the evicted node(s) " + ", ".join(listed), lambda store: exclude(store, listed)):
                self._unlisted.clear()
        self._agree(lambda: self._refuse_if_evicted(me))

    def _refuse_if_evicted(self, me: str) -> dict:
        if me in self._evicted:
            raise InvalidInput(f"this node ({me}) was evicted by diloco.evict_clipped after {CLIPPED_REPORT_AFTER} "
                               "clipped outer steps in a row: its pseudo-gradient norm was over diloco.clip = "
                               f"{self.dcfg.clip:g} x the round's median each time (a diverged node? check its data and "
                               "settings); the run does not admit its id again")
        return {}

    def _reassert_claims(self, view) -> None:
        """A restarted store is empty: put the run's fingerprint and this node's data slot back, so a
        later joiner is still checked and never takes a live node's shard. At the first outer step, then only
        when the store client was re-created since (a restarted store is always reached through a new one):
        two round trips at every outer step would otherwise queue on a slow link."""
        def claim(store) -> None:
            store.compare_set(FINGERPRINT_KEY, "", encode(self.fingerprint))
            store.compare_set(slots.slot_key(self.slot), "", view.uid)
            if self._evicted:   # diloco.evict_clipped: an id evicted stays out of the run
                exclude(store, sorted(self._evicted))

        if self._write_store("put the run's fingerprint and this node's data slot back", claim):
            self._claimed_in = view.store_epoch

    def _save_position(self, data_state: dict | None) -> None:
        if data_state is not None:
            self._write_store("record the data position", lambda store: slots.save_position(
                store, self.slot, self.local.rank, data_state, self.local.world_size))

    def _write_store(self, what: str, write: Callable[[Any], None]) -> bool:
        """A best-effort write after an outer step. An earlier one may have dropped the client (the store
        restarted): reconnect; a failure drops it again, and the next outer step writes again. True when
        it was written."""
        try:
            # A short wait: a store that is down (restarting, or lost for good and about to be failed over) held
            # the training loop for elastic.connect_timeout per write (20 s measured for a joiner).
            self.store = self.store or self.connect(wait_s=BEST_EFFORT_CONNECT_S)
            write(self.store)
            return True
        except store_errors() + (EnvironmentFailure,) as e:
            log.warning("could not %s in the store (retried next outer step): %s", what, str(e).splitlines()[0])
            self.store = None
            return False

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The outer state in this node's checkpoint: the shared part, plus what the algorithm keeps of its
        own (the eager term)."""
        algorithm = self._algorithm
        # The average in flight first: a checkpoint waits for it, and its transfer updates the residual.
        own = algorithm.state_tensors()
        return {**self._outer.state_tensors(), **own, **algorithm.feedback_tensors()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._outer.load_state_tensors(tensors)
        self._algorithm.load_state_tensors(tensors)
        self._algorithm.load_feedback(tensors)

    # -- misc ---------------------------------------------------------------------------------
    def _node_digest(self) -> bytes:
        """sha256 over every stripe's outer-param digest: the same bytes on every local rank. Uses
        the digest started after the last outer step (nothing has changed the outer params since)."""
        mine = self._digest.result() if self._digest is not None else drift.digest(self._outer.flat)
        parts = localsync.all_gather_bytes(self.local_group, mine)[:self._layout.stripes]  # the stripes' owners
        return hashlib.sha256(b"".join(parts)).digest()

    def params_hash(self) -> str:
        """Hash of the outer params over the node's local ranks (equal on every node when in sync)."""
        return self._node_digest().hex()[:16]

    def shutdown(self, graceful: bool = True) -> None:
        if self.algorithm is not None:
            self.algorithm.close(grace_s=5.0 if graceful else 0.0)
        if self.live is not None:
            try:
                self.live.close(self.store)
            except Exception as e:  # noqa: BLE001 - leaving anyway
                log.debug("closing the live snapshot sidecar: %s", e)
        self.mesh.shutdown(graceful=graceful)


def _deadline(cfg: Config) -> float:
    return max(5.0, cfg.elastic.sync_deadline)

