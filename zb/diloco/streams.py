"""Extra global groups for striping (diloco.streams): several TCP connections per node pair.

A single TCP connection rarely fills a long, lossy link; the all-reduce splits each bucket over
`streams` groups of the same replica group. The elastic mesh builds the first one; the others are
built here, under the same mesh version, and rebuilt whenever the version changes.

The overlapped outer step (diloco.overlap) builds a whole set of its own the same way (tag "ov"):
its background all-reduce must never share a group with the check-in or a joiner's hand-over.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from zb.collectives import PeerFailure
from zb.elastic import keys
from zb.elastic.listener_guard import options
from zb.elastic.probe import gloo_address
from zb.rendezvous_store import patient
from zb.signed_store import prefixed

if TYPE_CHECKING:
    from zb.elastic.view import WorldView
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")


class StreamGroups:
    """Gloo groups of the replica group named `<tag><j>` for j = first .. streams - 1 under the mesh
    version's prefix. The default: the streams beyond the mesh's own group (its j = 0)."""

    def __init__(self, streams: int, local_rank: int, pg_timeout_s: float, *, tag: str = "s", first: int = 1):
        self.tag, self.first = tag, first
        self.extra = max(0, streams - first)
        self.local_rank, self.timeout = local_rank, timedelta(seconds=pg_timeout_s)
        # the members of a world build these together: each waits for the others as long as a collective would
        self.wait_s = pg_timeout_s
        self.version: int | None = None
        # ProcessGroupGloo objects: torch types them as a Backend, they serve as groups here
        self.groups: list[Any] = []

    def for_view(self, view: WorldView, store: StoreClient | None) -> list[Any]:
        """The groups for this world (built once per mesh version; every node builds them together)."""
        if self.extra == 0 or (view.global_world_size == 1 and self.first > 0):
            return []
        if self.version != view.mesh_version:
            self.groups, self.version = [], None
            prefix = keys.mesh_prefix(view.mesh_version, self.local_rank)
            try:
                self.groups = [dist.ProcessGroupGloo(patient(prefixed(store, f"{prefix}/{self.tag}{j}"), self.wait_s),
                                                     view.global_rank, view.global_world_size,
                                                     options(gloo_address(), self.timeout))
                               for j in range(self.first, self.first + self.extra)]
            except RuntimeError as e:
                raise PeerFailure(f"building {self.tag} groups for mesh v{view.mesh_version} failed: "
                                  f"{str(e).splitlines()[0]}", rank=None) from None
            self.version = view.mesh_version
        return self.groups
