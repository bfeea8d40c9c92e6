"""The in-process tier: DiLoCo nodes as threads of one process, in milliseconds.

Each node is a real `DilocoNode` with its real outer state, check-in, sync, outer optimizer and
state transfer over real gloo groups (one `HashStore` for the world); only the membership is
scripted: `FakeWorld.set_world` is what the leader's resolution would have written, and every
node's `FakeMesh` reads it at its next resolve. So the node's decision paths (non-finite skip,
lagging or readmitted node, joiners, a failed attempt retried without the failed peer) run as they
do across processes, minus heartbeats and the store's process (zb/testing/cluster.py, the
slower tier, keeps those). As the leader's judge does, a resolution leaves out the ids listed in the
store's keys.EVICTED (diloco.evict_clipped), and refuses such a node as the membership does. As torchft's integration tests run replicas as threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zb.collectives import PeerFailure
from zb.config import load_config
from zb.config_schema import Config
from zb.diloco.node import DilocoNode
from zb.diloco.rounds import RoundWork
from zb.elastic import keys
from zb.elastic.membership import refuse_if_evicted
from zb.elastic.store_state import evicted_ids
from zb.elastic.tcpstore import read_many
from zb.elastic.view import WorldView
from zb.local_world import LocalWorld
from zb.position import RunPosition

PG_TIMEOUT = timedelta(seconds=20)


class TinyModel(nn.Module):
    """Blocks named as the transformer's (`layers.i.`), so streaming strides fragments over them."""

    def __init__(self, width: int = 8, blocks: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.parameters()])


class FakeWorld:
    """The membership every node resolves to, and the store its groups meet in."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.version = 0
        self.nodes: list[str] = []
        self.joined: list[str] = []
        self.lock = threading.Lock()
        self.broken: dict[int, str] = {}   # mesh version -> the node that died in it: its collectives fail
        self.store_epoch = 0               # bumps when the store restarts (empty) and the nodes reconnect
        self.ring_mbps: float | None = None  # the link figures the leader's ring plan would write (zb.elastic.ring)
        self.link_ms: float | None = None

    def restart_store(self) -> None:
        """The store restarted empty: the nodes' next resolution reaches it through a new client."""
        with self.lock:
            self.store = dist.HashStore()
            self.store_epoch += 1

    def kill_in(self, version: int, uid: str) -> None:
        """`uid` dies during mesh version `version`: every collective there fails, and the first failure
        reported makes the next version the world without it (the leader drops the blamed node)."""
        self.broken[version] = uid

    def set_world(self, nodes: list[str], joined: tuple[str, ...] = ()) -> None:
        """A new mesh version: what the leader would write at the next resolution."""
        with self.lock:
            self.version += 1
            self.nodes, self.joined = list(nodes), list(joined)

    def drop_dead(self, version: int) -> None:
        with self.lock:
            dead = self.broken.get(version)
            if dead is None or version != self.version:
                return
        self.set_world([n for n in self.nodes if n != dead])

    def drop_evicted(self) -> set[str]:
        """What the leader's resolution does with the store's list of evicted ids (keys.EVICTED): the next world
        leaves them out. Returns the list."""
        with self.lock:
            evicted = evicted_ids(read_many(self.store, [keys.EVICTED])[0])
            nodes = [n for n in self.nodes if n not in evicted]
            if nodes != self.nodes:
                self.version += 1
                self.nodes, self.joined = nodes, []
        return evicted

    def view_of(self, uid: str) -> WorldView:
        with self.lock:
            return WorldView(mesh_version=self.version, global_rank=self.nodes.index(uid),
                             global_world_size=len(self.nodes), nodes=list(self.nodes), leader=self.nodes[0],
                             joined=list(self.joined), is_joiner=uid in self.joined, uid=uid,
                             store_epoch=self.store_epoch, ring_mbps=self.ring_mbps, link_ms=self.link_ms)


class _BrokenGroup:
    """A group whose collectives fail as if a peer had died mid-way (PeerFailure names no rank)."""

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        raise PeerFailure("a peer died mid-way (fake world)", rank=None)


class FakeMesh:
    """What a DilocoNode uses of ElasticDeviceMesh, over a FakeWorld."""

    def __init__(self, world: FakeWorld, uid: str):
        self.world, self.uid = world, uid
        self.view: WorldView | None = None
        self.group: Any = None
        self.failures: list[int | None] = []

    def start(self) -> WorldView:
        return self.resolve()

    def resolve(self) -> WorldView:
        refuse_if_evicted(self.uid, self.world.drop_evicted())
        view = self.world.view_of(self.uid)
        if view.mesh_version not in self.world.broken and (self.view is None or
                                                            view.mesh_version != self.view.mesh_version):
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"fake/v{view.mesh_version}", self.world.store),
                                                   view.global_rank, view.global_world_size, PG_TIMEOUT)
        self.view = view
        return view

    @property
    def global_pg(self) -> Any:
        """The mesh version's group; a broken one once a node died in that version."""
        if self.view is not None and self.view.mesh_version in self.world.broken:
            return _BrokenGroup()
        return self.group

    def report_failure(self, suspect: int | None = None) -> None:
        self.failures.append(suspect)
        if self.view is not None:
            self.world.drop_dead(self.view.mesh_version)

    def use_stripes(self, stripes: int) -> None:
        return None

    def host_store_if_asked(self) -> None:
        return None

    def mark_finished(self, outer_step: int, step: int) -> bool:
        return False

    def check_finished(self) -> None:
        return None

    def shutdown(self, graceful: bool = True) -> None:
        return None


class FakeClock:
    """A clock that moves only when a test moves it (`now`): for the round clock's decisions."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ListSink:
    """Metrics events in memory."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def log(self, event: str, **fields: Any) -> dict:
        self.events.append((event, fields))
        return fields


def node_config(**flags: str) -> Config:
    """A DiLoCo config for the fake world: fixed H, drift guard on, short deadlines."""
    values = {"diloco.inner_steps": "4", "diloco.outer_lr": "0.7", "diloco.retry_all_reduce": "2",
              "elastic.sync_deadline": "20", "elastic.pg_timeout": "20", "train.log_model_hash": "true"}
    values.update(flags)
    return load_config([], values, environ={})


@dataclass
class FakeNode:
    """One node of the fake world: its model, inner optimizer, DilocoNode and position."""

    uid: str
    model: TinyModel
    optimizer: torch.optim.Optimizer
    diloco: DilocoNode
    mesh: FakeMesh
    position: RunPosition = field(default_factory=RunPosition)
    reports: list = field(default_factory=list)

    def train(self, delta: torch.Tensor) -> None:
        """The inner steps of a round, as their net effect: params -= delta (one flat tensor)."""
        with torch.no_grad():
            offset = 0
            for p in self.model.parameters():
                n = p.numel()
                p.sub_(delta[offset:offset + n].view_as(p))
                offset += n
        self.position = RunPosition(step=self.position.step + self.diloco.dcfg.inner_steps,
                                    outer_step=self.position.outer_step, tokens=self.position.tokens,
                                    run_tokens=self.position.run_tokens)

    def step(self, delta: torch.Tensor) -> int:
        """One inner step, as its effect (params -= delta); returns the node's step counter after it."""
        with torch.no_grad():
            offset = 0
            for p in self.model.parameters():
                p.sub_(delta[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.position = replace(self.position, step=self.position.step + 1)
        return self.position.step

    def outer_step(self) -> Any:
        """The outer step, and the position after it as the training loop's ledger keeps it (a receiver
        takes the run's; under diloco.round_seconds every node moves to the run's step)."""
        report, received = self.diloco.outer_step(self.position, None)
        self.reports.append(report)
        base = received or self.position
        step = report.run_step if received is None and report.run_step is not None else base.step
        self.position = RunPosition(step=step, outer_step=base.outer_step + 1, tokens=base.tokens,
                                    run_tokens=base.run_tokens)
        return report


def make_node(world: FakeWorld, uid: str, cfg: Config, seed: int = 0, work: RoundWork | None = None,
              width: int = 8) -> FakeNode:
    """A node with the model every node starts from (the same seed: DiLoCo's identical start). `work`:
    what it reports training in every round (its steps and tokens), so the average weighs it. `width`: the
    model's (scripts/bench_insider.py builds larger ones)."""
    model = TinyModel(width=width, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg.elastic.unique_id = uid
    mesh = FakeMesh(world, uid)
    node = DilocoNode(cfg, model, optimizer, LocalWorld(rank=0, world_size=1), ListSink(), {"stripes": 1, "run": "fake"},
                      mesh=mesh, connect=lambda: world.store, work_source=(lambda: work) if work is not None else None)
    return FakeNode(uid, model, optimizer, node, mesh)


def together(nodes: list[FakeNode], fn: Callable[[FakeNode], Any], timeout: float = 60.0) -> list[Any]:
    """Run fn(node) on every node at once, one thread each (a collective needs them all); the results
    in order. An exception in any thread is raised here, after every thread ended or timed out."""
    results: list[Any] = [None] * len(nodes)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(nodes[i])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a fake-world node did not finish within {timeout} s")
    if errors:
        raise errors[0]
    return results


def start_world(uids: list[str], work: dict[str, RoundWork] | None = None, width: int = 8,
                **flags: str) -> tuple[FakeWorld, list[FakeNode]]:
    """A world of fresh nodes that start together (nobody is a joiner); `work` and `width`: see make_node."""
    world = FakeWorld()
    world.set_world(uids)
    nodes = [make_node(world, uid, node_config(**flags), work=(work or {}).get(uid), width=width) for uid in uids]
    together(nodes, lambda n: n.diloco.start())
    return world, nodes
