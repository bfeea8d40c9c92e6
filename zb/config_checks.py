"""Value checks on a resolved config: impossible values exit 2 with one line naming key and source.

Checks that need more than the config (the local rank count, the model size table) run where that
knowledge lives (zb.train.setup) and use the same `fail` helper.
"""

from __future__ import annotations

from zb.config import fail, get
from zb.config_schema import Config

POSITIVE = ["optim.lr", "optim.batch_size", "optim.total_steps", "train.micro_bs", "data.seq_length",
            "train.log_interval", "eval.batches", "elastic.heartbeat_interval", "elastic.heartbeat_timeout",
            "elastic.pg_timeout", "elastic.store_timeout", "elastic.polling_interval", "elastic.connect_timeout",
            "elastic.start_timeout", "elastic.sync_deadline", "elastic.world_size",
            "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.vocab_size", "model.rope_theta",
            "train.max_steps", "data.data_world_size", "ckpt.interval", "ckpt.topk", "ckpt.remote.interval",
            "diloco.inner_steps", "diloco.outer_lr", "diloco.streams", "diloco.bucket_mb", "diloco.min_bandwidth_mbps"]
NON_NEGATIVE = ["optim.weight_decay", "optim.warmup_steps", "optim.grad_clip", "optim.z_loss_weight", "optim.eps",
                "data.shuffle_buffer", "data.retries", "data.prefetch", "train.seed", "elastic.rank", "data.data_rank",
                "diloco.retry_all_reduce", "diloco.outer_momentum", "ckpt.grace_period"]
FRACTIONS = ["optim.adam_betas1", "optim.adam_betas2", "optim.min_lr_ratio", "optim.decay_ratio",
             "data.eval_fraction"]


def validate(cfg: Config) -> None:
    _ranges(cfg)
    _relations(cfg)


def _ranges(cfg: Config) -> None:
    for key in POSITIVE:
        value = get(cfg, key)
        if value is not None and value <= 0:
            fail(cfg, key, "must be positive")
    for key in NON_NEGATIVE:
        value = get(cfg, key)
        if value is not None and value < 0:
            fail(cfg, key, "must not be negative")
    for key in FRACTIONS:
        value = get(cfg, key)
        if not 0 <= value < 1:
            fail(cfg, key, "must be in [0, 1)")
    if not 0 < cfg.elastic.port < 65536:
        fail(cfg, "elastic.port", "must be a TCP port (1-65535)")
    if cfg.eval.interval < -1:
        fail(cfg, "eval.interval", "must be a step count, 0 (only at the end) or -1 (never)")


def _relations(cfg: Config) -> None:
    if cfg.optim.warmup_steps > cfg.optim.total_steps:
        fail(cfg, "optim.warmup_steps", f"is longer than optim.total_steps ({cfg.optim.total_steps})")
    if cfg.optim.batch_size % cfg.train.micro_bs:
        fail(cfg, "optim.batch_size", f"must be a multiple of train.micro_bs ({cfg.train.micro_bs})")
    if cfg.elastic.heartbeat_timeout <= cfg.elastic.heartbeat_interval:
        fail(cfg, "elastic.heartbeat_timeout",
             f"must exceed elastic.heartbeat_interval ({cfg.elastic.heartbeat_interval})")
    rank, size = cfg.data.data_rank, cfg.data.data_world_size
    if rank is not None and size is not None and rank >= size:
        fail(cfg, "data.data_rank", f"must be below data.data_world_size ({size})")
    if cfg.data.fake and cfg.data.dataset_name_or_paths != "builtin":
        fail(cfg, "data.fake", "conflicts with data.dataset_name_or_paths; choose one source")
    if cfg.ckpt.interval is not None and cfg.ckpt.path is None and not cfg.ckpt.live_recovery:
        fail(cfg, "ckpt.interval", "is set but ckpt.path is not; say where checkpoints go")
    if cfg.ckpt.remote.path is not None and cfg.ckpt.path is None:
        fail(cfg, "ckpt.remote.path", "needs ckpt.path (remote copies are made from the local checkpoint)")
    if cfg.diloco is not None and cfg.ckpt.interval is not None and cfg.ckpt.interval % cfg.diloco.inner_steps:
        fail(cfg, "ckpt.interval", f"must be a multiple of diloco.inner_steps ({cfg.diloco.inner_steps})")
