"""The entry of a DiLoCo-SWARM stage worker: `zb train` with a [swarm] table calls `run`, which plans
the stages, picks this worker's stage and runs its role (zb.swarm.first drives micro-batches,
zb.swarm.later serves them; both build on zb.swarm.worker) to the end.

Run: `scripts/simulate_swarm.sh 2 2` (a store and a 2-stage x 2-worker grid on this machine), or per
machine `zb train @cfg.toml --swarm.stages 2 [--swarm.stage J]` against one `zb store`.
"""

from __future__ import annotations

import logging
import time

import torch

from zb.config import fail, source_of
from zb.config_schema import Config, SwarmConfig
from zb.errors import LeavingRun
from zb.local_world import local_world
from zb.swarm import registry
from zb.swarm.checkpoints import checkpointed_stage
from zb.swarm.first import FirstStage
from zb.swarm.later import LaterStage
from zb.swarm.stages import split_blocks
from zb.swarm.worker import UNSUPPORTED
from zb.train.ledger import emit_run_start
from zb.train.signals import Ended

log = logging.getLogger("zb.swarm")


def plan_stages(cfg: Config, vocab_size: int):
    """(model args, block ranges per stage), or exit 2 naming the key when the split cannot be."""
    from zb.models import model_args

    sw = _swarm(cfg)
    args = model_args(cfg.model, vocab_size=vocab_size, max_seq_len=cfg.data.seq_length)
    try:
        return args, split_blocks(args, sw.stages, sw.split)
    except ValueError as e:
        fail(cfg, "swarm.split" if sw.split and sw.stages <= args.n_layers else "swarm.stages", str(e))


def _swarm(cfg: Config) -> SwarmConfig:
    assert cfg.swarm is not None, "zb.cli.train starts a stage worker for a [swarm] config only"
    return cfg.swarm


def pick_stage(cfg: Config) -> int:
    """swarm.stage, or the store's choice (the stage with the least measured throughput)."""
    sw = _swarm(cfg)
    if sw.stage is not None:
        return sw.stage
    stage = checkpointed_stage(cfg)
    if stage is not None and stage < sw.stages:
        log.info("stage %d: the stage of the checkpoint this worker resumes", stage)
        return stage
    from zb.elastic.stores import shared_stores

    e = cfg.elastic
    store = shared_stores(e).connect(e.connect_timeout, e.store_timeout, e.namespace)
    stage = registry.choose_stage(store, sw.stages)
    log.info("the store chose stage %d for this worker (least measured throughput)", stage)
    return stage


def warn_unsupported(cfg: Config) -> None:
    given = [k for k in UNSUPPORTED if source_of(cfg, k) != "default"]
    for key in given:
        why = UNSUPPORTED[key] or "not used by DiLoCo-SWARM"
        log.warning("%s has no effect under [swarm]: %s", key, why)


def run(cfg: Config) -> Ended:
    """The dispatch from `zb train`: build this worker's stage and run its role to the end."""
    from zb.data import build_tokenizer
    from zb.log import apply_log_config, set_uid
    from zb.train.setup import node_identity, open_metrics

    local = local_world()
    apply_log_config(cfg.log.level, cfg.log.all_ranks, local.rank)
    if local.world_size > 1:
        fail(cfg, "swarm.stages", "a stage worker is one process: launch it without --nproc-per-node/torchrun")
    warn_unsupported(cfg)
    torch.manual_seed(cfg.train.seed)
    cfg.elastic.unique_id = node_identity(cfg, local)
    set_uid(cfg.elastic.unique_id)
    tokenizer = build_tokenizer(cfg.data.tokenizer, retries=cfg.data.retries)
    args, bounds = plan_stages(cfg, tokenizer.vocab_size)
    sink = open_metrics(cfg, node=cfg.elastic.unique_id, is_head=True)
    emit_run_start(sink, cfg, local_world_size=1, device=cfg.train.device)
    started = time.perf_counter()
    try:
        stage = pick_stage(cfg)
        if stage == 0:
            role: FirstStage | LaterStage = FirstStage(cfg, bounds, args, sink, cfg.elastic.unique_id, tokenizer)
        else:
            role = LaterStage(cfg, stage, bounds, args, sink, cfg.elastic.unique_id)
        return role.execute(tokenizer.vocab_size)
    except LeavingRun:
        log.warning("stopped on request")
        raise
    finally:
        log.info("swarm worker done in %.1f s", time.perf_counter() - started)
        sink.close()

