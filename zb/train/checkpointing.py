"""Checkpoints in the training loop: resume at start, save at the interval, a final one at the end.

The manager (zb.ckpt.durable.manager) does the work: RAM staging (the only blocking part), then disk and
remote copies in the background. This module decides when, and what resuming means for a node of
a DiLoCo run: a node that joins a running run takes the run's state from a live node instead of
its own older checkpoint; when the whole run restarts, every node resumes the newest step that all
of them committed, agreed through the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from zb.config import source_of
from zb.config_schema import Config

if TYPE_CHECKING:
    from zb.ckpt.durable.manager import Resumed, TrainState

log = logging.getLogger("zb.train")


class RunCheckpoints:
    """When a run checkpoints, and what it resumes from. It sees the run only through `state_of`
    (the TrainState to save, or to fill in place at a resume) and hands back what it loaded, so the
    run applies it; without any ckpt setting it does nothing."""

    def __init__(self, cfg: Config, *, uid: str, local_rank: int, local_world_size: int, is_head: bool,
                 sink, local_group, state_of: Callable[[], TrainState]):
        self.cfg, self.state_of = cfg, state_of
        self.manager = None
        ckpt = cfg.ckpt
        # eval.only reads its checkpoint itself (zb.train.eval_only): a manager tidies, probes and sweeps as it starts.
        if not cfg.eval.only and (ckpt.path or ckpt.interval or ckpt.resume or ckpt.remote.path):
            from zb.ckpt.durable.manager import CheckpointManager

            if ckpt.remote.path and source_of(cfg, "elastic.unique_id") == "default" and is_head:
                log.warning("ckpt.remote.path is set but this node's id was generated (%s): set GLOBAL_UNIQUE_ID "
                            "so that a restarted node finds its remote checkpoints under %s/<node id>",
                            uid, ckpt.remote.path.rstrip("/"))
            self.manager = CheckpointManager(ckpt, uid=uid, local_rank=local_rank,
                                             local_world_size=local_world_size, sink=sink, local_group=local_group)

    def resume(self, *, store=None, scope: str = "", joining: bool = False,
               quorum: int | None = None) -> Resumed | None:
        """Load per ckpt.resume into the run's state (in place) and return the rest for the run to apply.
        `store`: the run's global store under DiLoCo, where `latest` is agreed with the other nodes that start
        together (`scope` names this start; waiting for `quorum` of them, default elastic.world_size);
        `joining`: this node joins a running run, whose state comes from a live node instead."""
        if self.manager is None or not self.cfg.ckpt.resume:
            return None
        if joining:
            log.info("joining a running run: its current state comes from a live node, not from ckpt.resume")
            return None
        agreed = None
        if store is not None and self.cfg.ckpt.resume == "latest":
            from zb.ckpt.durable.agree import agree_on_latest

            uid = self.cfg.elastic.unique_id
            assert uid is not None  # the run named its node (node_identity) before anything resumes
            agreed = agree_on_latest(store, uid, self.manager.committed_steps(),
                                     quorum=quorum or self.cfg.elastic.world_size, timeout=self.cfg.elastic.start_timeout,
                                     scope=scope)
            if agreed is None:
                return None
        return self.manager.resume(self.state_of(), agreed_step=agreed)

    @property
    def periodic(self) -> bool:
        """Checkpoints are taken every ckpt.interval steps (so a restart resumes from the latest)."""
        return self.manager is not None and bool(self.cfg.ckpt.interval)

    def maybe_save(self, step: int) -> bool:
        """Take the checkpoint if one is due at `step`; True when it did."""
        if self.manager is not None and self.manager.due(step):
            self.manager.save(step, self.state_of())
            return True
        return False

    def maybe_save_crossing(self, start: int, end: int) -> bool:
        """diloco.round_seconds: take the checkpoint at `end` (an outer step) if the round from `start`
        reached or passed a multiple of ckpt.interval; True when it did."""
        interval = self.cfg.ckpt.interval
        if self.manager is not None and interval and end // interval > start // interval:
            self.manager.save(end, self.state_of())
            return True
        return False

    def final(self, step: int) -> None:
        """At the normal end or a signalled stop: one last checkpoint, within ckpt.grace_period."""
        if self.manager is None or not self.cfg.ckpt.path or step == 0:
            return
        self.manager.save(step, self.state_of(), final=True)
        if not self.manager.wait(self.cfg.ckpt.grace_period):
            log.warning("the final checkpoint did not finish within ckpt.grace_period (%.0f s)",
                        self.cfg.ckpt.grace_period)
        self.manager.check_durable()  # the newest checkpoints never reached ckpt.path: exit 1, not a quiet 0

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close(0)
