"""Pick the device and start the local process group (the node's own ranks).

CUDA + NCCL when a GPU is there, else CPU + gloo; the reason is logged once so a user who expected
a GPU sees why they did not get one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zb.config_schema import TrainConfig
from zb.errors import EnvironmentFailure, InvalidInput
from zb.world import LocalWorld

log = logging.getLogger("zb.train")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str                # local process group backend
    param_dtype: torch.dtype    # compute dtype of params (FSDP2 MixedPrecisionPolicy / autocast)
    reduce_dtype: torch.dtype


def pick_placement(cfg: TrainConfig, local: LocalWorld) -> Placement:
    has_cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not has_cuda:
        raise InvalidInput("train.device = 'cuda' but no CUDA device is visible; use --train.device cpu or auto")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and has_cuda)
    if use_cuda:
        torch.cuda.set_device(local.rank % torch.cuda.device_count())
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
        reason = f"CUDA device {device.index} ({torch.cuda.get_device_name(device)}), NCCL inside the node"
    else:
        device, backend = torch.device("cpu"), "gloo"
        reason = "CPU with gloo " + ("(train.device = cpu)" if cfg.device == "cpu" else "(no CUDA device visible)")
    param = cfg.param_dtype if cfg.param_dtype != "auto" else ("bf16" if use_cuda else "fp32")
    if local.is_leader:
        log.info("device: %s; params computed in %s", reason, param)
    return Placement(device, backend, DTYPES[param], DTYPES[cfg.reduce_dtype])


def init_local_group(local: LocalWorld, placement: Placement, timeout_s: float = 300.0) -> None:
    """The node's process group over its local ranks (torchrun's env); nothing for a lone process."""
    if not local.distributed or dist.is_initialized():
        return
    try:
        dist.init_process_group(placement.backend, timeout=timedelta(seconds=timeout_s),
                                device_id=placement.device if placement.device.type == "cuda" else None)
    except (RuntimeError, dist.DistError) as e:
        raise EnvironmentFailure(f"could not start the local process group ({placement.backend}): {e}") from None


def close_local_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
