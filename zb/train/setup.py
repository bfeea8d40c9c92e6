"""Build what a training run needs from the config: identity, model, optimizer, data loaders.

Checks that need more than the config (the local rank count, the model size table, the tokenizer)
live here and fail with the same one-line, key-naming errors as the config loader.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zb.config import fail
from zb.config_schema import Config
from zb.elastic import localsync
from zb.errors import EnvironmentFailure, free_space
from zb.local_world import LocalWorld
from zb.metrics import MetricsSink
from zb.train.device import Placement, pick_placement
from zb.train.fsdp import apply_activation_checkpointing, materialize, shard_model

if TYPE_CHECKING:
    from zb.models import Transformer

log = logging.getLogger("zb.train")


def check_batch(cfg: Config, local: LocalWorld) -> int:
    """Micro batches per rank per step; optim.batch_size is per node, over all local ranks."""
    per_step = cfg.train.micro_bs * local.world_size
    if cfg.optim.batch_size % per_step:
        fail(cfg, "optim.batch_size", f"must be a multiple of train.micro_bs x local ranks "
                                      f"({cfg.train.micro_bs} x {local.world_size} = {per_step})")
    return cfg.optim.batch_size // per_step


def check_placement(cfg: Config, placement: Placement) -> None:
    """Settings that pass the config checks but cannot work on this placement: fail in one line here
    instead of deep inside a kernel."""
    if cfg.model.attn_impl != "flash":
        return
    if placement.device.type != "cuda":
        fail(cfg, "model.attn_impl", "flash-attn runs on CUDA only and this run trains on the CPU; "
                                     "use auto or sdpa")
    if placement.param_dtype not in (torch.bfloat16, torch.float16):
        fail(cfg, "model.attn_impl", f"flash-attn needs bf16 or fp16 activations but params compute in "
                                     f"{str(placement.param_dtype).removeprefix('torch.')}; set "
                                     f"--train.param_dtype bf16, or use auto or sdpa")


def preflight(cfg: Config, local: LocalWorld, *, announce: bool = True) -> Placement:
    """The checks every local rank makes at its start, before anything is downloaded or allocated:
    the batch split, the device and what it can run, and the memory bound (before the tokenizer is
    known, for every param but the vocabulary rows). `zb train --nproc-per-node` makes them once
    before it starts the ranks, so a mistake is one line, not one per rank after torch's banner."""
    from zb.train.memory import check_memory, machine_totals, params_before_tokenizer

    check_batch(cfg, local)
    placement = pick_placement(cfg.train, local, announce=announce)
    check_placement(cfg, placement)
    check_memory(cfg, params_before_tokenizer(cfg), local.world_size, placement.device.type,
                 *machine_totals(placement.device))
    return placement


def _warn_without_downloads(cfg: Config) -> None:
    """data.retries and data.cache_budget_gb act on hub downloads: say so when they cannot."""
    from zb.config import source_of
    from zb.data.hub import offline
    from zb.data.sources import source_kind

    hub_data = source_kind(cfg.data) == "hub"
    hub_tokenizer = cfg.data.tokenizer != "bytes" and not Path(cfg.data.tokenizer).exists()
    idle = {"data.retries": "nothing is downloaded from the hub" if not (hub_data or hub_tokenizer) else "",
            "data.cache_budget_gb": "the data does not come from a Hugging Face dataset" if not hub_data
            else "data.streaming is off: the whole file list is kept" if not cfg.data.streaming
            else "HF_HUB_OFFLINE is set: nothing is downloaded, so nothing is evicted" if offline() else ""}
    for key, why in idle.items():
        if why and source_of(cfg, key) != "default":
            log.warning("%s has no effect: %s", key, why)


def open_metrics(cfg: Config, *, node: str, is_head: bool) -> MetricsSink:
    """<log.dir>/metrics.jsonl and the other log.backends, opened (by the node's head) before anything
    is built, so that a log.dir that cannot hold them, or a backend whose package is missing, stops the
    run at once in one line. As for ckpt.path (zb.ckpt.durable.copies): a path that can never work (a
    file, read-only, no permission) is exit 2, a disk full already exit 1. A disk that fills later only
    costs metrics (zb.metrics): training goes on."""
    from zb.monitor import backend_names, check_backends, open_backends

    check_backends(cfg)  # on every local rank, so that a missing package stops the whole node alike
    sink = None
    try:
        if is_head:
            _probe_log_dir(cfg.log.dir)
        sink = MetricsSink(cfg.log.dir, node, enabled=is_head, jsonl="jsonl" in backend_names(cfg))
        if is_head:
            sink.backends = open_backends(cfg, node=node)
        return sink
    except OSError as e:
        why = f"cannot hold the metrics: {e.strerror or e}"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fail(cfg, "log.dir", f"{why} ({free_space(Path(cfg.log.dir))}); free space there or point --log.dir at "
                                 "another disk", EnvironmentFailure)
        fail(cfg, "log.dir", f"{why}; give a writable directory (--log.dir DIR)")
    finally:
        if sink is not None and sys.exc_info()[0] is not None:
            sink.close()


def _probe_log_dir(log_dir: str) -> None:
    """Make log.dir and write (and sync) a few bytes in it: opening a file succeeds on a disk that is full,
    only a write tells."""
    from zb.ckpt.durable.copies import write_probe

    Path(log_dir).mkdir(parents=True, exist_ok=True)
    probe = Path(log_dir) / f".zb-probe-{os.getpid()}"
    try:
        write_probe(probe)
    finally:
        probe.unlink(missing_ok=True)


def node_identity(cfg: Config, local: LocalWorld) -> str:
    """GLOBAL_UNIQUE_ID, or one generated by local rank 0 and shared with the node's other ranks."""
    from zb.elastic.identity import new_uid

    uid = cfg.elastic.unique_id or new_uid()
    # Local rank 0's id on every local rank (JSON bytes over the local group, never a pickle).
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    uid = localsync.broadcast_json(group, local.rank, {"id": uid})["id"]
    os.environ.setdefault("GLOBAL_UNIQUE_ID", uid)
    return uid


def build_model(cfg: Config, vocab_size: int, placement: Placement) -> Transformer:
    """Identical initial weights on every node, without ever holding the whole model on any rank.

    The model is built on the meta device (no memory), wrapped and sharded, then each rank allocates
    only its own shards on its device and fills them: each parameter's full fp32 value is drawn on
    the CPU from its own seeded generator, one parameter at a time, and sliced (zb.models.init), so
    the weights are bit-identical to building the whole model and initialising it on the CPU.
    """
    from zb.models import Transformer, count_params, model_args

    args = model_args(cfg.model, vocab_size=vocab_size, max_seq_len=cfg.data.seq_length)
    with torch.device("meta"):
        model = Transformer(args)
    log.info("model %s/%s: %s params, dim %d, %d layers, %d heads (%d kv), vocab %d", cfg.model.type,
             cfg.model.name, f"{count_params(model):,}", args.dim, args.n_layers, args.n_heads, args.kv_heads,
             args.vocab_size)
    import torch.distributed as dist

    from zb.train.memory import check_memory, machine_totals

    local_ranks = dist.get_world_size() if dist.is_initialized() else 1   # FSDP2 shards over the node's ranks
    check_memory(cfg, count_params(model), local_ranks, placement.device.type, *machine_totals(placement.device))
    if cfg.train.ac_ckpt:
        wrapped = apply_activation_checkpointing(model, every=cfg.train.ac_ckpt)
        log.info("activation checkpointing: %d of %d blocks", wrapped, args.n_layers)
    if cfg.train.torch_compile:
        # Checkpointing, then compile, then shard (torchtitan's order). Module.compile works in
        # place (parameter names and checkpoints unchanged); FSDP2's hooks, which run in the
        # compiled call, are marked for dynamo to skip, so each block's body stays one graph.
        for block in model.layers:
            block.compile()
    model = shard_model(model, cfg.train, placement)
    materialize(model, cfg.train, placement)
    model.init_weights(cfg.train.seed)
    return model


def build_loaders(cfg: Config, tokenizer, local: LocalWorld, data_rank: int, data_world_size: int):
    """(train loader, a factory of fresh eval loaders); each rank reads its own shard."""
    from zb.data import build_dataloader

    def make(split: str):
        return build_dataloader(cfg.data, tokenizer, micro_bs=cfg.train.micro_bs, seq_length=cfg.data.seq_length,
                                data_rank=data_rank, data_world_size=data_world_size, local_rank=local.rank,
                                local_world_size=local.world_size, split=split, seed=cfg.train.seed)

    from zb.config import source_of

    if local.rank == 0:
        _warn_without_downloads(cfg)
    train = make("train")
    if cfg.eval.interval >= 0 or cfg.eval.only:
        make("eval").check_nonempty()   # a shard with no held-out document: said before training, not after it
    cuda = torch.cuda.is_available()  # False on a train.device=cpu run: see device.hide_gpus
    # On the CPU the step and the thread share the cores and the GIL: measured slower there
    # (BENCHMARKS.md), so it is on by default only where the host mostly waits for the device.
    if cfg.data.prefetch and (cuda or source_of(cfg, "data.prefetch") != "default"):
        from zb.data.prefetch import Prefetcher

        # Pinned only for a CUDA run: pinning needs CUDA, and only an async H2D copy gains from it.
        train = Prefetcher(train, depth=cfg.data.prefetch, pin_device=torch.cuda.current_device() if cuda else None)
    return train, lambda: make("eval")
