"""One optimizer step over a node's batch, and held-out evaluation.

The node's batch (optim.batch_size sequences) is split over local ranks and, on each rank, into
micro batches whose gradients accumulate. FSDP2 averages gradients over the local ranks, so the
update equals that of one process taking the whole batch (a test holds the two against each other).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from zb.models.loss import LossSpec
from zb.train.device import Placement, stats_dtype
from zb.train.fsdp import autocast, is_sharded, reshard

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# (inputs, labels) or zb.data.Batch (inputs, labels, cu_seqlens): where documents start, or None.
Batch = tuple[torch.Tensor, ...]


@dataclass
class StepResult:
    loss: float        # mean cross-entropy over the node's batch (z-loss excluded)
    z_loss: float
    grad_norm: float
    lr: float
    stop: bool = False  # some local rank was asked to stop: the whole node stops after this step


def local_mean(values: list[float] | torch.Tensor, device: torch.device) -> list[float]:
    """Mean of each value over the node's local ranks (gloo has no AVG: sum, then divide); a device
    tensor stays on the device until this one read."""
    t = torch.as_tensor(values, dtype=stats_dtype(device), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t = t / dist.get_world_size()
    return t.tolist()


class Trainer:
    """One optimizer step of a node's local ranks: micro batches with gradient accumulation under
    FSDP2 (reduce-scatter at the last micro batch, or after each with reduce_every_micro_batch),
    max-z-loss, clipping, the LR schedule; and the held-out evaluation. Knows nothing of DiLoCo."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, placement: Placement,
                 grad_clip: float, z_loss_weight: float, reduce_every_micro_batch: bool = False,
                 num_chunks: int | None = None, fused_linear_ce: bool = False):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.placement, self.grad_clip = placement, grad_clip
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.loss = LossSpec(z_loss_weight, num_chunks, fused_linear_ce)

    def _forward(self, inputs: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.to(self.placement.device, non_blocking=True)
        labels = labels.to(self.placement.device, non_blocking=True)
        if cu_seqlens is not None:
            # Here, not in the model: FSDP2 would copy a CPU tensor to the GPU blocking.
            cu_seqlens = cu_seqlens.to(self.placement.device, non_blocking=True)
        with autocast(self.model, self.placement):
            return self.model(inputs, cu_seqlens, labels=labels, loss=self.loss)

    def train_step(self, micro_batches: list[Batch], stop_requested: Callable[[], bool] = lambda: False) -> StepResult:
        """One optimizer step. `stop_requested` is asked at the step's end, when the local ranks vote: a
        signal that lands during the step stops the node after it (asked at the start, it cost a step more)."""
        self.model.train()
        n = len(micro_batches)
        # Sums stay on the device (fp64): reading them once per step, not per micro batch, keeps
        # a GPU from stalling on a host sync after every forward/backward.
        acc = stats_dtype(self.placement.device)   # fp64, or fp32 on MPS (no fp64 there)
        sums = torch.zeros(2, dtype=acc, device=self.placement.device)
        for i, batch in enumerate(micro_batches):
            if is_sharded(self.model):
                # Reduce-scatter only after the last micro batch (least traffic), unless asked to after
                # each: FSDP2 otherwise holds a full unsharded fp32 gradient until then.
                sharded = cast("FSDPModule", self.model)   # is_sharded: fully_shard made it one
                sharded.set_requires_gradient_sync(self.reduce_every_micro_batch or i == n - 1)
            loss, z_loss = self._forward(*batch)
            (loss / n).backward()
            z = z_loss.detach().to(acc)
            sums[0] += loss.detach().to(acc) - self.loss.z_loss_weight * z  # log CE alone
            sums[1] += z
        grad_norm = self._clip()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        # One local all-reduce and one host read per step carry the logged losses, the stop flag and
        # the grad norm (equal on every rank, so its mean is itself) together.
        stop = torch.tensor([float(stop_requested())], dtype=acc).to(self.placement.device, non_blocking=True)
        values = torch.cat([sums / n, stop, grad_norm.detach().to(acc).reshape(1)])
        mean_loss, mean_z, stop_mean, norm = local_mean(values, self.placement.device)
        return StepResult(loss=mean_loss, z_loss=mean_z, grad_norm=norm, lr=lr, stop=stop_mean > 0)

    def _clip(self) -> torch.Tensor:
        """Clip and return the global grad norm, left on the device (no host sync)."""
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], num_batches: int) -> float:
        """Mean held-out loss over `num_batches` micro batches per rank (same count on every rank)."""
        self.model.eval()
        total, it = 0.0, iter(batches)
        count = 0
        for _ in range(num_batches):
            batch = next(it, None)
            if batch is None:
                break
            loss, z_loss = self._forward(*batch)
            total += loss.item() - self.loss.z_loss_weight * z_loss.item()
            count += 1
        if is_sharded(self.model):
            reshard(self.model)  # no backward follows to do it: see fsdp.reshard
        self.model.train()
        mean, counted = local_mean([total, float(count)], self.placement.device)
        return mean / counted if counted else float("nan")


def take(loader: Iterator[Batch], n: int) -> list[Batch]:
    return [next(loader) for _ in range(n)]
