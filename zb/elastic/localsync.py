"""Keeping a node's local ranks of one mind: local rank 0 decides, the others follow.

The view travels as JSON bytes in a uint8 tensor over the node's local control group (gloo, also on
GPU: see zb.train.device), never pickled. Failure reports of all local ranks are merged into local
rank 0 with one MAX all-reduce. Waits here are bounded by the control group's timeout, sized to the
longest wait of local rank 0 (zb.train.device.control_timeout_s).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zb.errors import EnvironmentFailure, InvalidInput

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup


def _device(group: ProcessGroup | None) -> torch.device:
    import torch
    import torch.distributed as dist

    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_json(group: ProcessGroup | None, local_rank: int, payload: dict[str, Any] | None) -> dict[str, Any]:
    """Local rank 0's `payload`, on every local rank (payload ignored elsewhere)."""
    if group is None:
        assert payload is not None  # alone, this rank is local rank 0: it always shares a payload
        return payload
    import torch
    import torch.distributed as dist

    device = _device(group)
    data = json.dumps(payload).encode() if local_rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, group_src=0, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if local_rank == 0
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, group_src=0, group=group)
    if local_rank != 0:
        return json.loads(buf.cpu().numpy().tobytes().decode())
    assert payload is not None  # local rank 0 always shares a payload
    return payload


def run_on_head(group: ProcessGroup | None, local_rank: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Local rank 0 runs `fn` and every local rank gets its JSON result; an error there is raised on every
    local rank, with its exit code (2: InvalidInput, else EnvironmentFailure)."""
    payload = None
    if local_rank == 0:
        try:
            payload = fn()
        except Exception as e:  # noqa: BLE001 - told to the other local ranks, then re-raised
            broadcast_json(group, 0, {"error": str(e), "code": getattr(e, "exit_code", 1)})
            raise
    payload = broadcast_json(group, local_rank, payload)
    if "error" in payload:
        raise (InvalidInput if payload.get("code") == 2 else EnvironmentFailure)(payload["error"])
    return payload


def merge_failures(group: ProcessGroup | None, world_size: int, failed: bool,
                   suspects: set[int]) -> tuple[bool, set[int]]:
    """Union of every local rank's (failed, suspect group ranks) for the current global world."""
    if group is None:
        return failed, suspects
    import torch
    import torch.distributed as dist

    flags = torch.zeros(world_size + 1, dtype=torch.int32, device=_device(group))
    flags[0] = int(failed)
    for rank in suspects:
        if 0 <= rank < world_size:
            flags[rank + 1] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    merged = flags.cpu().tolist()
    return bool(merged[0]), {i for i in range(world_size) if merged[i + 1]}


def all_ok(group: ProcessGroup | None, ok: bool) -> bool:
    """True only if every local rank says ok (e.g. built its global group)."""
    if group is None:
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], dtype=torch.int32, device=_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def sum_float(group: ProcessGroup | None, value: float) -> float:
    """The sum of every local rank's `value`."""
    if group is None:
        return value
    import torch
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64, device=_device(group))
    dist.all_reduce(total, group=group)
    return float(total.item())


def all_gather_bytes(group: ProcessGroup | None, data: bytes) -> list[bytes]:
    """Every local rank's `data` (of equal length on every rank), in local rank order."""
    if group is None:
        return [data]
    import torch
    import torch.distributed as dist

    device = _device(group)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [p.cpu().numpy().tobytes() for p in parts]
