"""Drift guard: nodes compare a hash of their outer params after each outer step; a rank that
differs from the majority (ties: the lowest rank's) resyncs from a live node at the next step."""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("zb.diloco")


def digest(flat: torch.Tensor) -> bytes:
    return hashlib.sha256(flat.detach().numpy().tobytes()).digest()


def in_majority(pg: dist.ProcessGroup, rank: int, size: int, flat: torch.Tensor, deadline_s: float) -> bool | None:
    """True/False for this rank's shard; None when the comparison itself failed (peer gone)."""
    mine = torch.tensor(list(digest(flat)), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    try:
        pg.allgather([gathered], [mine]).wait(timedelta(seconds=deadline_s))
    except Exception as e:  # noqa: BLE001 - checked again at the next outer step
        log.warning("drift check skipped: %s", str(e).splitlines()[0])
        return None
    votes = [bytes(g.tolist()) for g in gathered]
    majority = max(votes, key=lambda v: (votes.count(v), -votes.index(v)))
    return votes[rank] == majority
