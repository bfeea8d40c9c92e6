"""A stage worker's checkpoints: what they hold, which stage a restarted worker takes, and which
step it resumes.

A worker checkpoints its stage as a node checkpoints its model (zb.train.checkpointing and the
durable manager, unchanged): the stage's params, the inner AdamW and LR schedule, the RNG, the
stage's DiLoCo outer state, the run position and, on the first stage, the data slot's position.
`ckpt.path` is the worker's own directory, as it is a node's.

What a resume means depends on the run:
- The worker joins a stage that has live workers: the stage's state comes from one of them
  (blocking join), not from disk.
- The whole run restarts (no first-stage worker is training): every worker publishes its committed
  steps and all resume the newest step that every worker of every stage has, agreed through the
  store. The stages must resume one step: a pipeline of stages from different steps is a model that
  never existed. The quorum is elastic.world_size workers per stage.
- A later stage lost all its workers while the run went on: the restarted worker resumes its own
  newest checkpoint, then takes the run's step from the first request (zb.swarm.later). The stage
  loses what it learned after that checkpoint instead of everything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from zb.errors import InvalidInput
from zb.swarm import registry
from zb.train.checkpointing import RunCheckpoints

if TYPE_CHECKING:
    from zb.ckpt.durable.manager import Resumed, TrainState
    from zb.config_schema import Config

log = logging.getLogger("zb.swarm")


def checkpointed_stage(cfg: Config) -> int | None:
    """The stage of the checkpoint this worker would resume (ckpt.resume), None without one: an unpinned
    worker takes its checkpoint's stage instead of the store's choice."""
    from zb.ckpt.durable.layout import latest_step, part_name, resolve_part
    from zb.ckpt.format.catalog import read_manifest
    from zb.ckpt.format.manifest import snapshot_name

    spec, root = cfg.ckpt.resume, cfg.ckpt.path
    if not spec or "://" in spec:
        return None
    if spec == "latest":
        latest = latest_step(Path(root)) if root and Path(root).is_dir() else None
        if latest is None or root is None:
            return None
        part = Path(root) / snapshot_name(latest) / part_name(0)
    else:
        part = resolve_part(Path(spec), 0)
    try:
        stage = read_manifest(part).meta.get("fingerprint", {}).get("swarm_stage")
    except (OSError, ValueError):
        return None    # unreadable: the resume itself says what is wrong
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


class StageCheckpoints:
    """The checkpoints of one stage worker; does nothing without a ckpt setting. `state_of` gives the
    worker's state to save and to resume into, as RunCheckpoints takes it."""

    def __init__(self, cfg: Config, *, stage_index: int, uid: str, sink, state_of: Callable[[], TrainState]):
        self.cfg, self.index = cfg, stage_index
        self.run = RunCheckpoints(cfg, uid=uid, local_rank=0, local_world_size=1, is_head=True, sink=sink,
                                  local_group=None, state_of=state_of)

    def resume(self, link: registry.StoreLink, *, joining: bool) -> Resumed | None:
        """Load this worker's checkpoint per the module's rules, in place; the rest for the worker to apply.
        `joining`: the stage has live workers, whose state this one takes instead."""
        cfg, sw = self.cfg, self.cfg.swarm
        assert sw is not None
        if self.run.manager is None or not cfg.ckpt.resume:
            return None
        if joining:
            return self.run.resume(joining=True)
        stage = checkpointed_stage(cfg)
        if stage is not None and stage != self.index:
            where = cfg.ckpt.path if cfg.ckpt.resume == "latest" else cfg.ckpt.resume
            raise InvalidInput(f"the checkpoint under {where} holds stage {stage}, but this worker runs stage "
                               f"{self.index} (swarm.stage): leave swarm.stage unset to take the checkpoint's stage, "
                               "or give this worker its own ckpt.path")
        # A step can take up to a hop timeout per micro-batch: watch for one beyond the heartbeat timeout.
        window = cfg.elastic.heartbeat_timeout + sw.hop_timeout
        if self.index > 0 and registry.first_stage_training(link, window):
            log.info("the run is training without stage %d: resuming this worker's own newest checkpoint",
                     self.index)
            return self.run.resume()
        if cfg.ckpt.resume != "latest":
            return self.run.resume()
        return self.run.resume(store=link.client, scope=f"swarm/{_epoch(link.client)}",
                               quorum=cfg.elastic.world_size * sw.stages)

    def maybe_save(self, step: int) -> bool:
        return self.run.maybe_save(step)

    def final(self, step: int) -> None:
        self.run.final(step)

    def close(self) -> None:
        self.run.close()


def _epoch(store) -> int:
    """Which restart of the run this is, the same number on every worker of it: first-stage workers
    register only after the agreement is decided, so every restarting worker counts the same
    registrations, and a store that outlived an earlier run never hands that run's decision on."""
    return len(registry.registrations(store, 0))
