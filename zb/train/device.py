"""Pick the device and start the local process groups (the node's own ranks).

CUDA + NCCL when a GPU is there, else an Apple GPU (MPS, one local rank), else CPU + gloo; the
reason is logged once so a user who expected a GPU sees why they did not get one.

Two local groups: the main one (NCCL on GPU) carries FSDP2's collectives; a gloo control group
carries the small control messages between local ranks (the view, stop votes, checkpoint steps,
the params hash). Control waits can last as long as the slowest thing local rank 0 waits for (the
store, an outer all-reduce at the slowest expected link), and a timed-out NCCL wait makes the
watchdog abort the process instead of raising; gloo raises, takes CPU tensors, and gets a timeout
sized to those waits (`control_timeout_s`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zb.config_schema import TrainConfig
from zb.errors import EnvironmentFailure, InvalidInput
from zb.local_world import LocalWorld

log = logging.getLogger("zb.train")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOCAL_TIMEOUT_S = 300.0
CONTROL_BACKEND = "gloo"  # whatever the main local backend is: see the module docstring
_control = None


@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str                # local process group backend
    param_dtype: torch.dtype    # compute dtype of params (FSDP2 MixedPrecisionPolicy / autocast)
    reduce_dtype: torch.dtype


def hide_gpus() -> None:
    """Make CUDA invisible to this process and its children before anything initialises it, so no
    later `torch.cuda.is_available()` guard (RNG state, pinned buffers, synchronize) opens a CUDA
    context on GPU 0 for every rank of a CPU run."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def mps_available() -> bool:
    """An Apple GPU through Metal (MPS): torch built with it and a Mac that has it."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def mps_bf16_ok() -> bool:
    """bf16 on MPS needs macOS 14 (Sonoma) or newer; older Metal versions reject it in kernels."""
    check = getattr(torch.backends.mps, "is_macos_or_newer", None)
    return bool(check is not None and check(14, 0))


def pick_placement(cfg: TrainConfig, local: LocalWorld, *, announce: bool = True) -> Placement:
    """CUDA + NCCL, else MPS (Apple GPUs, one local rank), else CPU + gloo; the reason logged once
    (not with `announce` False: a launcher checking before it starts the ranks, which log it)."""
    if cfg.device == "cpu":
        hide_gpus()
    has_cuda = cfg.device not in ("cpu", "mps") and torch.cuda.is_available()
    if cfg.device == "cuda" and not has_cuda:
        raise InvalidInput("train.device = 'cuda' but no CUDA device is visible; use --train.device cpu or auto")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and has_cuda)
    if use_cuda:
        return _log(local, *_cuda(local), cfg, announce)
    use_mps, why_not = _want_mps(cfg, local)
    if use_mps:
        return _log(local, torch.device("mps"), "gloo", "Apple GPU (MPS), one local rank", cfg, announce)
    reason = "CPU with gloo " + ("(train.device = cpu)" if cfg.device == "cpu" else f"({why_not})")
    return _log(local, torch.device("cpu"), "gloo", reason, cfg, announce)


def _cuda(local: LocalWorld) -> tuple[torch.device, str, str]:
    gpus = torch.cuda.device_count()
    if local.world_size > gpus:
        # Two ranks on one GPU would stop in NCCL with "Duplicate GPU detected".
        raise InvalidInput(f"{local.world_size} local ranks but {gpus} CUDA device(s) visible: start at most "
                           f"{gpus} ranks per node (--nproc-per-node {gpus}) or use --train.device cpu")
    torch.cuda.set_device(local.rank)
    device = torch.device("cuda", torch.cuda.current_device())
    return device, "nccl", f"CUDA device {device.index} ({torch.cuda.get_device_name(device)}), NCCL inside the node"


def _want_mps(cfg: TrainConfig, local: LocalWorld) -> tuple[bool, str]:
    """(use MPS, why not). A Mac has one GPU and no NCCL: FSDP2 over several processes sharing it
    would only add gloo copies through the CPU, so MPS means one local rank (a laptop is one node)."""
    if cfg.device not in ("mps", "auto"):
        return False, ""
    if not mps_available():
        if cfg.device == "mps":
            raise InvalidInput("train.device = 'mps' but MPS is not available (it needs an Apple-silicon Mac and a "
                               "torch built with MPS); use --train.device cpu or auto")
        return False, "no CUDA or MPS device visible"
    if local.world_size > 1:
        if cfg.device == "mps":
            raise InvalidInput(f"train.device = 'mps' runs one local rank per Mac (one GPU, no NCCL) but "
                               f"{local.world_size} were started: use --nproc-per-node 1, or --train.device cpu")
        return False, f"MPS takes one local rank and this node has {local.world_size}"
    if cfg.param_dtype == "bf16" and not mps_bf16_ok():
        raise InvalidInput("train.param_dtype = 'bf16' on MPS needs macOS 14 or newer; use fp32 (auto) here")
    return True, ""


def _log(local: LocalWorld, device: torch.device, backend: str, reason: str, cfg: TrainConfig,
         announce: bool = True) -> Placement:
    # auto: bf16 where it is fast and safe (CUDA); fp32 on MPS (bf16 support varies by macOS) and CPU.
    param = cfg.param_dtype if cfg.param_dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if local.is_head and announce:
        log.info("device: %s; params computed in %s", reason, param)
    reduce = param if cfg.reduce_dtype == "param" else cfg.reduce_dtype
    return Placement(device, backend, DTYPES[param], DTYPES[reduce])


def stats_dtype(device: torch.device) -> torch.dtype:
    """Accumulators of logged losses: fp64, except on MPS, which has no fp64 at all."""
    return torch.float32 if device.type == "mps" else torch.float64


def synchronize(device: torch.device) -> None:
    """Wait for queued work on an accelerator (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def init_local_group(local: LocalWorld, placement: Placement, timeout_s: float = LOCAL_TIMEOUT_S) -> None:
    """The node's process group over its local ranks (torchrun's env); nothing for a lone process."""
    if not local.distributed or dist.is_initialized():
        return
    try:
        dist.init_process_group(placement.backend, timeout=timedelta(seconds=timeout_s),
                                device_id=placement.device if placement.device.type == "cuda" else None)
    except (RuntimeError, dist.DistError) as e:
        raise EnvironmentFailure(f"could not start the local process group ({placement.backend}): {e}") from None


def control_timeout_s(cfg, n_params: int) -> float:
    """The longest a local rank may legitimately wait for local rank 0, with a margin of 2.

    Under DiLoCo rank 0 may wait for the store, the initial quorum and a global group, then run an
    outer all-reduce: a ring sends each byte about twice, at diloco.min_bandwidth_mbps or better.
    """
    if cfg.diloco is None:
        return LOCAL_TIMEOUT_S
    e, d = cfg.elastic, cfg.diloco
    wire_bits = 2 * n_params * (1 if d.compression != "none" else 4) * 8   # int4 and int2 send less: a margin
    allreduce_s = wire_bits / (d.min_bandwidth_mbps * 1e6)
    return max(LOCAL_TIMEOUT_S, 2 * (allreduce_s + e.store_timeout + e.start_timeout + e.pg_timeout))


def init_control_group(timeout_s: float) -> None:
    """The gloo control group over the node's local ranks; none for a lone process. Collective: every
    local rank calls it."""
    global _control
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        _control = None
        return
    _control = dist.new_group(backend=CONTROL_BACKEND, timeout=timedelta(seconds=timeout_s))


def control_group():
    """The local control group (gloo), or None for a lone process."""
    if _control is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("the local control group is used before init_control_group")
    return _control


def close_local_group() -> None:
    global _control
    _control = None
    if dist.is_initialized():
        dist.destroy_process_group()
