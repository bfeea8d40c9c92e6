"""Extra global groups for striping (diloco.streams): several TCP connections per node pair.

A single TCP connection rarely fills a long, lossy link; the all-reduce splits each bucket over
`streams` groups of the same replica group. The elastic mesh builds the first one; the others are
built here, under the same mesh version, and rebuilt whenever the version changes.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from zb.collectives import PeerFailure
from zb.elastic import keys

log = logging.getLogger("zb.diloco")


class StreamGroups:
    def __init__(self, streams: int, local_rank: int, pg_timeout_s: float):
        self.extra, self.local_rank, self.timeout = max(0, streams - 1), local_rank, timedelta(seconds=pg_timeout_s)
        self.version: int | None = None
        self.groups: list[dist.ProcessGroup] = []

    def for_view(self, view, store) -> list[dist.ProcessGroup]:
        """The extra groups for this world (built once per mesh version; every node builds them together)."""
        if self.extra == 0 or view.global_world_size == 1:
            return []
        if self.version != view.mesh_version:
            self.groups, self.version = [], None
            prefix = keys.mesh_prefix(view.mesh_version, self.local_rank)
            try:
                self.groups = [dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/s{j}", store), view.global_rank,
                                                     view.global_world_size, self.timeout)
                               for j in range(1, self.extra + 1)]
            except RuntimeError as e:
                raise PeerFailure(f"building stream groups for mesh v{view.mesh_version} failed: "
                                  f"{str(e).splitlines()[0]}", rank=None) from None
            self.version = view.mesh_version
        return self.groups
