"""WorldView: what a resolution tells the caller (DiLoCo) about the world."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from zb.elastic.world import World


@dataclass(frozen=True)
class WorldView:
    mesh_version: int              # generation of the global groups
    global_rank: int               # this node's rank in its replica group (= node index)
    global_world_size: int         # nodes in the world
    nodes: list[str]               # unique ids, index = global rank
    leader: str                    # unique id of the node that writes the next resolution
    joined: list[str] = field(default_factory=list)   # admitted in the last resolution and in need of state
    left: list[str] = field(default_factory=list)     # left with a goodbye in the last resolution
    died: list[str] = field(default_factory=list)     # removed in the last resolution: silent, late or blamed
    is_joiner: bool = False        # this node is new (or came back) and must receive state
    changed: bool = False          # the global groups were rebuilt by this resolution
    store_ok: bool = True          # False: the store was unreachable, this is the previous world
    uid: str = ""                  # this node's unique id
    token: str = ""                # this process's incarnation token
    store_epoch: int = 0           # bumps when local rank 0 re-created its store client
    store_index: int = 0           # the current store's position in elastic.addr (zb.elastic.stores)
    ring_mbps: float | None = None  # slowest hop of the ring when ranks follow measured links, else None
    link_ms: float | None = None    # the longest one-way delay among the members' links, when all were timed

    @staticmethod
    def of(world: World, uid: str, token: str, *, changed: bool, store_ok: bool, store_epoch: int,
           store_index: int = 0) -> WorldView:
        return WorldView(mesh_version=world.version, global_rank=world.nodes.index(uid),
                         global_world_size=len(world.nodes), nodes=list(world.nodes), leader=world.leader or "",
                         joined=list(world.joined), left=list(world.left), died=list(world.died),
                         is_joiner=uid in world.joined, changed=changed, store_ok=store_ok, uid=uid, token=token,
                         store_epoch=store_epoch, store_index=store_index, ring_mbps=world.ring_mbps,
                         link_ms=world.link_ms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> WorldView:
        return WorldView(**data)
