"""Who am I: local identity from the torchrun environment.

Global identity (which node, which global rank) lives in the elastic config section (GLOBAL_*
variables) and in the world the elastic mesh resolves; this module only answers local questions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalWorld:
    rank: int          # local rank inside the node (torchrun's LOCAL_RANK)
    world_size: int    # local ranks in the node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_head(self) -> bool:
        """Local rank 0 speaks for the node: metrics file, membership decisions, sidecar."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True under torchrun (even with one rank), so a local process group exists."""
        return "MASTER_ADDR" in os.environ and "RANK" in os.environ


def local_world() -> LocalWorld:
    """The local identity; one process without torchrun is local rank 0 of 1."""
    world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return LocalWorld(rank=int(os.environ.get("LOCAL_RANK", "0")), world_size=world_size)
