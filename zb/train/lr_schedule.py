"""LR schedules: linear warmup, then cosine, linear or warmup-stable-decay (linear or 1 - sqrt) down to min_lr_ratio."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from zb.config_schema import OptimConfig


def lr_factor(cfg: OptimConfig) -> Callable[[int], float]:
    """Multiplier of optim.lr at a given step (0-based), as a pure function of the step."""
    warmup, total, floor = cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio
    decay_start = total - max(1, int(cfg.decay_ratio * total))
    if cfg.sched_type == "wsd-sqrt" and cfg.stable_steps is not None:
        decay_start = cfg.stable_steps  # Prime's meaning: the step the decay starts, warmup included

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step >= total:
            return floor
        if cfg.sched_type in ("wsd", "wsd-sqrt"):
            if step < decay_start:
                return 1.0
            progress = (step - decay_start) / max(1, total - decay_start)
            drop = math.sqrt(progress) if cfg.sched_type == "wsd-sqrt" else progress
            return 1.0 - (1.0 - floor) * drop
        progress = (step - warmup) / max(1, total - warmup)
        if cfg.sched_type == "linear":
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """The inner AdamW; foreach keeps it fast on CPU and works on FSDP2's DTensor params."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_betas1, cfg.adam_betas2),
                             eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=True)


def set_schedule_position(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put the schedule at `step` (a joiner continues the run's schedule, not its own)."""
    scheduler.last_epoch = step
    for group, base_lr, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * fn(step)
