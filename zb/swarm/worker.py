"""What every DiLoCo-SWARM stage worker shares: its stage of the model, the inner AdamW and LR schedule
on the stage's parameters, its checkpoints, and the stage's DiLoCo run (zb.diloco.node.DilocoNode
unchanged: the elastic mesh, check-ins, joiners' state transfer and outer Nesterov step), put in a
namespace of the store of its own so the stages' runs never meet. The first stage's worker drives
micro-batches (zb.swarm.first); the others serve them (zb.swarm.later); zb.swarm.entry starts one.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import TYPE_CHECKING

import torch

from zb.config_schema import Config, DilocoConfig, SwarmConfig
from zb.diloco.rounds import RoundWork
from zb.errors import LeavingRun
from zb.fingerprint import fingerprint
from zb.local_world import local_world
from zb.models.loss import LossSpec
from zb.swarm import registry
from zb.swarm.checkpoints import StageCheckpoints
from zb.swarm.stages import Stage, build_stage, stage_signature
from zb.train.ledger import Ledger

if TYPE_CHECKING:
    from zb.diloco.node import DilocoNode

log = logging.getLogger("zb.swarm")

# Settings of the single-node loop that a stage worker does not implement: warned about, never ignored silently.
UNSUPPORTED = {"train.torch_compile": "stages run eagerly", "train.ac_ckpt": "a stage recomputes its forward anyway",
               "train.fused_linear_ce": "the last stage computes the loss whole", "optim.num_chunks": "idem",
               "train.reduce_every_micro_batch": "a worker is one process",
               "ckpt.live_recovery": "a joiner of a stage takes its state from a live worker of the stage at its next "
               "outer step (blocking join); turned off", "data.prefetch": "data is read between steps",
               "diloco.blocking_join": "a joiner of a stage always takes its state by blocking join"}


class StageWorker:
    """Setup shared by both roles, the inner step and the outer step (DiLoCo within the stage)."""

    def __init__(self, cfg: Config, stage_index: int, bounds: list[tuple[int, int]], args, sink, uid: str):
        from zb.train.lr_schedule import build_optimizer, build_scheduler

        assert cfg.swarm is not None and cfg.diloco is not None, "a stage worker runs a [swarm] and [diloco] config"
        self.cfg, self.index, self.sink, self.uid = cfg, stage_index, sink, uid
        self.sw: SwarmConfig = cfg.swarm
        self.dcfg: DilocoConfig = cfg.diloco
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.device == "cuda" else \
            torch.device("cpu")
        self.stage: Stage = build_stage(args, stage_index, bounds, cfg.train.seed, self.device)
        self.optimizer = build_optimizer(self.stage, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.loss = LossSpec(cfg.optim.z_loss_weight if cfg.optim.z_loss else 0.0)
        self.total = cfg.train.max_steps or cfg.optim.total_steps
        # Only the first stage reads data: the tokens are counted there, a later stage counts none.
        self.ledger = Ledger(sink, self.scheduler, stage=stage_index,
                             tokens_per_step=cfg.optim.batch_size * cfg.data.seq_length if stage_index == 0 else 0)
        self._link: registry.StoreLink | None = None
        self._diloco: DilocoNode | None = None
        self.stage_cfg = copy.deepcopy(cfg)
        self.stage_cfg.elastic.namespace = registry.stage_namespace(cfg.elastic.namespace, stage_index)
        self.stage_cfg.ckpt.live_recovery = False   # see UNSUPPORTED
        assert self.stage_cfg.diloco is not None
        self.stage_cfg.diloco.blocking_join = True
        self.token = os.urandom(6).hex()
        self.round_steps = self.round_micro_batches = 0   # since the last outer step: the weight in the average
        self.fingerprint: dict = {}
        # A ckpt.path that can never work fails here, before any work.
        self.checkpoints = StageCheckpoints(cfg, stage_index=stage_index, uid=uid, sink=sink,
                                            state_of=self.checkpoint_state)
        log.info("stage %d of %d: blocks %d-%d%s%s, %s params", stage_index, len(bounds), bounds[stage_index][0],
                 bounds[stage_index][1] - 1, " + embeddings" if stage_index == 0 else "",
                 " + norm and head" if stage_index == len(bounds) - 1 else "",
                 f"{sum(p.numel() for p in self.stage.parameters()):,}")

    # The store link and the stage's DiLoCo node exist once execute() has connected and joined.
    @property
    def link(self) -> registry.StoreLink:
        assert self._link is not None, "the store link is made at the start of execute()"
        return self._link

    @link.setter
    def link(self, link: registry.StoreLink) -> None:
        self._link = link

    @property
    def diloco(self) -> DilocoNode:
        assert self._diloco is not None, "the stage's DiLoCo node is made by join_stage()"
        return self._diloco

    def join_stage(self, vocab_size: int) -> int:
        """Join the stage's DiLoCo run (a joiner receives the stage's state at its next outer step)."""
        from zb.diloco.node import DilocoNode  # noqa: F811 - at run time; the annotation's import is TYPE_CHECKING

        self.fingerprint = dict(fingerprint(self.cfg, 1, vocab_size), swarm_stage=self.index,
                                stage_params=stage_signature(self.stage))
        # The stage's average weighs each worker by the micro-batches it processed since the last outer step: a
        # worker that routing gave little work (a slow one) moved its replica less far on less data.
        self._diloco = DilocoNode(self.stage_cfg, self.stage, self.optimizer, local_world(), self.sink,
                                  self.fingerprint,
                                  work_source=lambda: RoundWork(self.round_steps, self.round_micro_batches))
        slot = self.diloco.start()
        if self.diloco.joining:
            self.outer_step(None)
            log.info("joined stage %d at step %d with the state of a live worker of the stage", self.index,
                     self.ledger.position.step)
        return slot

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_state(self):
        """This worker's state as a checkpoint holds it (saved, and resumed into in place)."""
        from zb.ckpt.durable.state import TrainState
        from zb.config import to_dict

        data_state, exact = self.data_state()
        return TrainState(self.stage, self.optimizer, self.scheduler, self.ledger.position, data_state=data_state,
                          outer=self.diloco.checkpoint_tensors(), config=to_dict(self.cfg),
                          fingerprint=self.fingerprint, data_exact=exact)

    def data_state(self) -> tuple[dict, bool]:
        """What a checkpoint keeps of the data: (loader state, whether it resumes exactly); first stage only."""
        return {}, True

    def resume(self) -> bool:
        """Resume from this worker's checkpoint per ckpt.resume (zb.swarm.checkpoints); True when it did."""
        loaded = self.checkpoints.resume(self.link, joining=self.diloco.joining)
        if loaded is None:
            return False
        self.ledger.move_to(loaded.position, own_tokens=True)
        if loaded.outer:
            self.diloco.load_checkpoint_tensors(loaded.outer)
        self.load_data_state(loaded.data_state)
        log.info("stage %d resumed from %s at step %d (outer step %d)", self.index, loaded.path,
                 self.ledger.position.step, self.ledger.position.outer_step)
        return True

    def load_data_state(self, state: dict | None) -> None:
        """The first stage takes its loader's position back; later stages read no data."""

    # -- steps ----------------------------------------------------------------------------------
    def inner_step(self, count: int) -> float:
        """AdamW on the gradients of `count` micro-batches (their mean); returns the grad norm. With no
        micro-batch this step (none was routed here) the params stay: momentum alone would move them."""
        norm = 0.0
        self.round_steps += 1
        self.round_micro_batches += count
        if count:
            for p in self.stage.parameters():
                if p.grad is not None:
                    p.grad.div_(count)
            max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
            norm = float(torch.nn.utils.clip_grad_norm_(self.stage.parameters(), max_norm, foreach=True))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.ledger.inner_step()
        return norm

    def outer_due(self) -> bool:
        step = self.ledger.position.step
        return step % self.dcfg.inner_steps == 0 or step == self.total

    def outer_step(self, data_state: dict | None) -> None:
        report, received = self.diloco.outer_step(self.ledger.position, data_state)
        round_micro_batches, self.round_steps, self.round_micro_batches = self.round_micro_batches, 0, 0
        self.ledger.outer_step(report, received=received, round_micro_batches=round_micro_batches)
        log.info("stage %d outer step %d | workers %d (%d contributing) | mesh v%d | all-reduce %.2f s, %s bytes%s",
                 self.index, self.ledger.position.outer_step, report.global_world_size, report.num_peers,
                 report.mesh_version, report.allreduce_s, f"{report.wire_bytes:,}",
                 "" if report.applied else " | " + (report.note or "NOT applied").strip(" |"))

    def outer_step_unless_stopping(self, stop, data_state: dict | None) -> None:
        """The outer step, skipped by a worker that is stopping: its deathrattle went out with the signal, so its
        stage's run no longer counts on it (and would refuse its check-in)."""
        if stop.requested:
            return
        try:
            self.outer_step(data_state)
        except LeavingRun:
            if not stop.requested:
                raise

    def store_link(self) -> registry.StoreLink:
        """The swarm's store client: the first connection waits elastic.connect_timeout (the store must be
        there at start), reconnections after an outage try for a second at a time."""
        from zb.elastic.stores import shared_stores

        e = self.cfg.elastic
        stores = shared_stores(e)
        first = stores.connect(e.connect_timeout, e.store_timeout, e.namespace)
        link = registry.StoreLink(lambda: stores.connect(1.0, e.store_timeout, e.namespace))
        link.client = first
        return link

    def shutdown(self) -> None:
        self.checkpoints.close()
        if self._diloco is not None:
            self._diloco.shutdown(graceful=True)
