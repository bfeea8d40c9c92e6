"""Checkpoints in the training loop: resume at start, save at the interval, a final one at the end.

The manager (zb.ckpt.durable.manager) does the work: RAM staging (the only blocking part), then disk and
remote copies in the background. This module decides when, and what resuming means for a node of
a DiLoCo run: a node that joins a running run takes the run's state from a live node instead of
its own older checkpoint; when the whole run restarts, every node resumes the newest step that all
of them committed, agreed through the store.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from zb.config import to_dict
from zb.train.device import control_group

if TYPE_CHECKING:
    from zb.train.run import TrainingRun

log = logging.getLogger("zb.train")


class RunCheckpoints:
    def __init__(self, run: "TrainingRun"):
        self.run, cfg = run, run.cfg.ckpt
        self.manager = None
        if cfg.path or cfg.interval or cfg.resume or cfg.remote.path:
            from zb.ckpt.durable.manager import CheckpointManager
            from zb.config import source_of

            if cfg.remote.path and source_of(run.cfg, "elastic.unique_id") == "default" and run.local.is_leader:
                log.warning("ckpt.remote.path is set but this node's id was generated (%s): set GLOBAL_UNIQUE_ID "
                            "so that a restarted node finds its remote checkpoints under %s/<node id>",
                            run.cfg.elastic.unique_id, cfg.remote.path.rstrip("/"))
            self.manager = CheckpointManager(cfg, node_id=run.cfg.elastic.unique_id, local_rank=run.local.rank,
                                             local_world_size=run.local.world_size, sink=run.sink,
                                             local_group=control_group())

    def state(self):
        from zb.ckpt.durable.state import TrainState
        from zb.train.fsdp import unsharded_params

        run, c = self.run, self.run.counters
        gathered = unsharded_params(run.model)
        if gathered:  # a bug: something ran a forward and did not reshard (see zb.train.fsdp.reshard)
            raise RuntimeError(f"refusing to checkpoint a sharded model whose params are gathered: {gathered[:3]}")
        return TrainState(run.model, run.optimizer, run.scheduler,
                          {"step": c.step, "outer_step": c.outer_step, "tokens": c.tokens, "run_tokens": c.run_tokens},
                          run.train_loader.state_dict(),
                          run.diloco.outer.state_tensors() if run.diloco is not None else None,
                          to_dict(run.cfg), run.fingerprint, data_exact=run.train_loader.exact_resume)

    def resume(self) -> None:
        run = self.run
        if self.manager is None or not run.cfg.ckpt.resume:
            return
        if run.diloco is not None and run.diloco.joining:
            log.info("joining a running run: its current state comes from a live node, not from ckpt.resume")
            return
        agreed = None
        if run.diloco is not None and run.cfg.ckpt.resume == "latest":
            from zb.ckpt.durable.agree import agree_on_latest

            agreed = agree_on_latest(run.diloco.store, run.cfg.elastic.unique_id, self.manager.committed_steps(),
                                     quorum=run.cfg.elastic.world_size, timeout=run.cfg.elastic.start_timeout)
            if agreed is None:
                return
        loaded = self.manager.resume(self.state(), agreed_step=agreed)
        if loaded is not None:
            self._apply(loaded)

    def _apply(self, loaded: dict) -> None:
        run, c = self.run, self.run.counters
        counters = loaded["counters"]
        run.move_to(counters["step"], counters["outer_step"], counters.get("run_tokens", 0),
                    tokens=counters.get("tokens", 0))
        run.train_loader.load_state_dict(loaded["data_state"])
        if run.diloco is not None and loaded.get("outer"):
            run.diloco.outer.load_state_tensors(loaded["outer"])
        log.info("resumed from %s at step %d (outer step %d)", loaded["path"], c.step, c.outer_step)

    def maybe_save(self) -> None:
        if self.manager is not None and self.manager.due(self.run.counters.step):
            self.manager.save(self.run.counters.step, self.state())

    def final(self) -> None:
        """At the normal end or a signalled stop: one last checkpoint, within ckpt.grace_period."""
        if self.manager is None or not self.run.cfg.ckpt.path or self.run.counters.step == 0:
            return
        self.manager.save(self.run.counters.step, self.state(), final=True)
        if not self.manager.wait(self.run.cfg.ckpt.grace_period):
            log.warning("the final checkpoint did not finish within ckpt.grace_period (%.0f s)",
                        self.run.cfg.ckpt.grace_period)
        self.manager.check_durable()  # the newest checkpoints never reached ckpt.path: exit 1, not a quiet 0

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close(0)
