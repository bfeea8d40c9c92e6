"""One DiLoCo node across an elastic world: joining the run, its outer steps, leaving.

The node joins (the run's fingerprint and stripes, the world, a data slot, live recovery) and builds
its collaborators: the outer state (zb.diloco.outer) laid out in the run's stripes, the algorithm
diloco.overlap names (zb.diloco.algorithms), its claims in the store (zb.diloco.claims), the
clip-and-evict state (zb.diloco.trust) and the outer-step template (zb.diloco.outer_step), which
runs every outer step in one order for every algorithm (docs/architecture.md walks it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from zb.config_schema import Config, DilocoConfig
from zb.diloco import rounds
from zb.diloco.algorithm import NodeContext, OuterAlgorithm
from zb.diloco.algorithms import ALGORITHMS
from zb.diloco.claims import FINISHED_WAIT_S, RunClaims
from zb.diloco.outer import OuterState
from zb.diloco.outer_step import Mesh, OuterSteps
from zb.diloco.roles import RoleKeeper
from zb.diloco.streams import StreamGroups
from zb.diloco.stripes import StripeLayout
from zb.diloco.trust import ClipTrust
from zb.elastic import ElasticDeviceMesh, localsync
from zb.elastic.stores import shared_stores
from zb.elastic.view import WorldView
from zb.errors import InvalidInput
from zb.events import OuterReport, Sink
from zb.fingerprint import encode
from zb.local_world import LocalWorld
from zb.overlap_modes import mode_of
from zb.position import RunPosition

if TYPE_CHECKING:
    from zb.diloco.live import LiveSnapshots
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")


class NodeMesh(Mesh, Protocol):
    """The elastic world as the node uses it: zb.elastic.ElasticDeviceMesh, or the fake world's (tests)."""

    def host_store_if_asked(self) -> None: ...

    def start(self) -> WorldView: ...

    def use_stripes(self, stripes: int) -> None: ...

    def shutdown(self, graceful: bool = True) -> None: ...

    def mark_finished(self, outer_step: int, step: int) -> bool: ...

    def check_finished(self) -> None: ...


class DilocoNode:
    """This node's part in a DiLoCo run: joining it, every outer step (zb.diloco.outer_step), live-recovery
    snapshots, and leaving. Owns the outer state and the elastic mesh; the training loop owns the model, the
    inner optimizer and the counters.

    `local_group` carries the control messages between the node's local ranks: a gloo group even
    on GPUs (CPU tensors, and long waits raise instead of tripping NCCL's watchdog); None alone.
    The collaborators can be passed in (the in-process fake world of the tests does): `mesh` (default
    an ElasticDeviceMesh over the run's store), `connect` (a store client; default the current store of zb.elastic.stores).
    `work_source`, for a user that counts its own work (DiLoCo-SWARM: micro-batches a stage worker
    processed since the last outer step), makes the average weigh contributors by it, as
    diloco.round_seconds weighs them by tokens."""

    def __init__(self, cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, local: LocalWorld,
                 sink: Sink, fingerprint: dict[str, Any], local_group: dist.ProcessGroup | None = None, *,
                 mesh: NodeMesh | None = None, connect: Callable[[], StoreClient] | None = None,
                 work_source: Callable[[], rounds.RoundWork] | None = None):
        assert cfg.diloco is not None, "a DiLoCo node needs the [diloco] section"
        self.dcfg: DilocoConfig = cfg.diloco
        self.cfg, self.model, self.optimizer, self.local, self.sink = cfg, model, optimizer, local, sink
        # The run's fingerprint; its "stripes" becomes the run's at start (the same dict is in checkpoints).
        self.fingerprint = fingerprint
        self.local_group = local_group
        self.mesh: NodeMesh = mesh or ElasticDeviceMesh(cfg.elastic, self.local_group, local_rank=local.rank,
                                              stripes=fingerprint["stripes"], sink=sink if local.is_head else None,
                                              ring_backward=cfg.diloco.compression == "none")  # gloo's ring: r -> r - 1
        self._connect_store = connect
        self.streams = StreamGroups(cfg.diloco.streams, local.rank, cfg.elastic.pg_timeout)
        self.rounds: rounds.RoundClock | None = None
        self.work_source = work_source
        if cfg.diloco.round_seconds is not None:
            # Streaming: the round's fragment boundaries share its budget (zb.diloco.fragment_rounds).
            self.rounds = rounds.RoundClock(cfg.diloco.round_seconds, cfg.train.max_steps or cfg.optim.total_steps,
                                            cfg.optim.batch_size * cfg.data.seq_length, local_group,
                                            parts=mode_of(cfg.diloco.overlap).round_parts(cfg.diloco))
        self.claims = RunClaims(self.connect, fingerprint, local_rank=local.rank, local_world_size=local.world_size,
                                namespace=cfg.elastic.namespace)
        self.num_slots = 0
        self.roles = RoleKeeper()
        self.trust = ClipTrust(cfg.diloco.clip, cfg.diloco.evict_clipped, speaks=local.is_head)
        self.recovered_position: RunPosition | None = None
        self.live: LiveSnapshots | None = None
        # Laid out in the run's stripes at start (start: the run says how many).
        self.outer: OuterState | None = None
        self.algorithm: OuterAlgorithm | None = None
        self.steps: OuterSteps | None = None
        if cfg.diloco.compression != "none":
            from zb.collectives import kernels

            kernels.use_cpp()  # build or load the kernels now, not inside the first timed outer step
            kernels.set_colocated(local.world_size)  # this node's ranks all-reduce at once: a share of the cores each
        if cfg.ckpt.live_recovery:
            from zb.ckpt.sidecar.token import read_token

            read_token(secret=shared_stores(cfg.elastic).secret)  # fail before joining the run: the sidecar needs a token

    @property
    def store(self) -> StoreClient | None:
        """This node's client of the run's store (None until start(), and after a failed write)."""
        return self.claims.store

    @store.setter
    def store(self, client: StoreClient | None) -> None:
        self.claims.store = client

    @property
    def _steps(self) -> OuterSteps:
        assert self.steps is not None, "DilocoNode.start() lays the outer state out"
        return self.steps

    # -- start -------------------------------------------------------------------------------
    def start(self) -> int:
        """Join the run; returns this node's data slot. Refuses (exit 2) a node whose settings differ."""
        def fingerprint() -> dict[str, Any]:
            self.mesh.host_store_if_asked()  # a node hosting the store (Prime style) checks against itself
            return {"stripes": self.claims.check_fingerprint(follow_stripes=self.dcfg.stripes is None)}

        steps = self._lay_out(localsync.run_on_head(self.local_group, self.local.rank, fingerprint)["stripes"])
        self.store = self.connect()
        recovered = False
        if self.cfg.ckpt.live_recovery and not self.dcfg.blocking_join:
            from zb.diloco.live import recover_node

            self.recovered_position = recover_node(self.store, self.cfg, self.local, self.local_group, steps.outer,
                                                   encode(self.fingerprint), self.sink)
            recovered = self.recovered_position is not None
        view = self.mesh.start()
        if view.is_joiner and any(uid not in view.joined for uid in view.nodes):   # others were there
            self.roles.joined(recovered=recovered)
        steps.fresh_view = True
        slot = self._claim_slot(view)
        if self.cfg.ckpt.live_recovery and steps.layout.owner:
            from zb.diloco.live import LiveSnapshots

            self.live = LiveSnapshots(self.cfg, view.uid, self.local.rank, encode(self.fingerprint))
            self.live.publish_address(self.store)
        log.info("node %s: global rank %d of %d (mesh v%d), data slot %d%s", view.uid, view.global_rank,
                 view.global_world_size, view.mesh_version, slot, self.roles.joining_note())
        return slot

    def connect(self, wait_s: float | None = None) -> StoreClient:
        """A new client of the run's store, waiting for it up to `wait_s` (default elastic.connect_timeout): the
        `connect` given, else zb.store_clients.run_client through the process's StoreList (the current store)."""
        if self._connect_store is not None:
            return self._connect_store()
        e = self.cfg.elastic
        return shared_stores(e).connect(e.connect_timeout if wait_s is None else min(wait_s, e.connect_timeout),
                                        e.store_timeout, e.namespace)

    def _lay_out(self, stripes: int) -> OuterSteps:
        """Lay the outer state out in the run's stripes (zb.diloco.stripes) and build the algorithm and the
        outer-step template over it; a node with fewer local ranks than the run has stripes cannot hold
        them: exit 2 on every local rank."""
        n = self.local.world_size
        if n < stripes:
            raise InvalidInput(f"this node has {n} local rank{'s' * (n != 1)} but the run's outer state is in {stripes} "
                               "stripes (diloco.stripes), one per local rank: start this node with at least "
                               f"{stripes} local ranks, or start the run with diloco.stripes = {n} to pool nodes this "
                               "small")
        self.fingerprint["stripes"] = stripes
        layout = StripeLayout(stripes, self.local.rank, n, self.local_group)
        self.mesh.use_stripes(stripes)
        self.outer = OuterState(self.model, self.dcfg, layout)
        if not layout.identity and self.local.is_head:
            log.info("this node has %d local ranks and the run %d stripes: rows move inside the node at every outer "
                     "step (local ranks %d..%d hold no outer state)", n, stripes, stripes, n - 1)
        ctx = NodeContext(self.dcfg, self.cfg.elastic.pg_timeout, self.local.rank, self.local_group, self.optimizer,
                          self.mesh, self.streams, self.connect, lambda: self.claims.store, self.rounds,
                          weighted=self.rounds is not None or self.work_source is not None)
        self.algorithm = algorithm = ALGORITHMS[self.dcfg.overlap](ctx, self.outer)
        if algorithm.extra_bytes and self.local.is_head:
            log.info("diloco.overlap = %s: %.1f MB more CPU memory per local rank (%s)", algorithm.mode.name,
                     algorithm.extra_bytes / 1e6, algorithm.mode.memory_note)
        if algorithm.feedback is not None and self.local.is_head:
            log.info("error feedback (diloco.compression = %s): %.1f MB of host memory per local rank, 8 bytes per "
                     "parameter of its stripe (the residual and its copy for a failed attempt)", self.dcfg.compression,
                     algorithm.feedback.nbytes / 1e6)
        self.steps = OuterSteps(self.cfg, self.local, self.local_group, mesh=self.mesh, layout=layout,
                                outer=self.outer, algorithm=algorithm, roles=self.roles, trust=self.trust,
                                claims=self.claims, optimizer=self.optimizer, work=self._work, clock=self.rounds,
                                live=lambda: self.live)
        return self.steps

    def _claim_slot(self, view: WorldView) -> int:
        def claim() -> dict[str, Any]:
            num = self.cfg.data.data_world_size or max(self.cfg.elastic.world_size, view.global_world_size)
            pref = self.cfg.data.data_rank if self.cfg.data.data_rank is not None else self.cfg.elastic.rank
            return {"slot": self.claims.claim_slot(view.uid, view.nodes, num, pref), "num": num}

        payload = localsync.run_on_head(self.local_group, self.local.rank, claim)
        self.claims.slot, self.num_slots = payload["slot"], payload["num"]
        return self.claims.slot

    def _work(self) -> rounds.RoundWork:
        """This node's steps and tokens of the round (the weights of the average, when weighted)."""
        if self.rounds is not None:
            return self.rounds.work()
        return self.work_source() if self.work_source is not None else rounds.RoundWork(0, 0)

    @property
    def joining(self) -> bool:
        """This node joined a running run: it takes part in the current outer step right away."""
        return self.roles.joining

    def data_position(self) -> dict[str, Any] | None:
        """Where the previous holder of this node's slot stopped (None: start of the shard)."""
        return self.claims.data_position()

    # -- outer steps ----------------------------------------------------------------------------
    def outer_step(self, position: RunPosition,
                   data_state: dict[str, Any] | None) -> tuple[OuterReport, RunPosition | None]:
        """Run one outer step from `position` (this node's, before it). Returns its report and, for a
        node that took over the run's state, the run's position before the step."""
        t0 = time.perf_counter()
        report, received = self._steps.run(position, data_state)
        report.boundary_s = round(time.perf_counter() - t0, 4)
        return report, received

    def sync_points(self, step: int) -> tuple[int | None, int | None]:
        """(fragment to launch, fragment to apply) after inner step `step`; applying is the outer step."""
        return self._steps.algorithm.sync_points(step)

    def launch_fragment(self, fragment: int) -> None:
        """Streaming: start the fragment's all-reduce behind the next inner steps."""
        self._steps.algorithm.launch_fragment(fragment, self.roles.contributing)

    def close_run(self, position: RunPosition) -> OuterReport | None:
        """The run's end under overlap (every node reaches it at the same step, optim.total_steps):
        wait for the average in flight, apply it on every node alike, and leave the model at the
        shared params, the consensus model with no node's eager term or merge residue. None when
        nothing was in flight."""
        return self._steps.close_run(position)

    def begin_rounds(self, position: RunPosition) -> None:
        """The training loop starts at `position`: the first round's budget (diloco.round_seconds) runs from here."""
        if self.rounds is not None:
            self.rounds.start()
            self._steps.algorithm.begin_rounds(position)

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The outer state in this node's checkpoint: the shared part, plus what the algorithm keeps of its
        own (the eager term, the average in flight, the error-feedback residual)."""
        steps = self._steps
        # The average in flight first: a checkpoint waits for it, and its transfer updates the residual.
        own = steps.algorithm.state_tensors()
        return {**steps.outer.state_tensors(), **own, **steps.algorithm.feedback_tensors()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        steps = self._steps
        steps.outer.load_state_tensors(tensors)
        steps.algorithm.load_state_tensors(tensors)
        steps.algorithm.load_feedback(tensors)

    def params_hash(self) -> str:
        """Hash of the outer params over the node's local ranks (equal on every node when in sync)."""
        return self._steps.params_hash()

    def finished(self, position: RunPosition) -> None:
        """The run reached its end (the head of a node whose training did): on the store's list of runs for `zb
        status`, and as the run's end in its own records, so a node of an older world that comes back stops
        (zb.elastic.store_state.finished_without) instead of training on alone."""
        marker = threading.Thread(target=self.mesh.mark_finished, args=(position.outer_step, position.step),
                                  name="zb-run-end", daemon=True)   # a silent store holds it, not the exit
        marker.start()
        self.claims.finish()
        marker.join(FINISHED_WAIT_S)

    def shutdown(self, graceful: bool = True) -> None:
        if self.algorithm is not None:
            self.algorithm.close(grace_s=5.0 if graceful else 0.0)
        if self.live is not None:
            try:
                self.live.close(self.store)
            except Exception as e:  # noqa: BLE001 - leaving anyway
                log.debug("closing the live snapshot sidecar: %s", e)
        self.mesh.shutdown(graceful=graceful)
