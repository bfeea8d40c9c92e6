"""Pseudo-gradient all-reduce in buckets, overlapping the copy of one with the transfer of another.

The main thread fills the flat pseudo-gradient buffer parameter by parameter (outer - current,
a device-to-CPU copy on GPU); as soon as a bucket's range is complete it is handed to one worker
thread that all-reduces it (SUM over the replica group, then divided by the number of nodes that
contributed, so a joiner's zeros never shrink the update). So the network is busy while the rest is
still being copied. Any failure in the worker is re-raised in the caller, as PeerFailure. With error
feedback (zb.diloco.error_feedback) each bucket's all-reduce adds and updates its slice of the residual.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zb.collectives import AllReduceStats, all_reduce
from zb.config_schema import DilocoConfig
from zb.diloco.outer import OuterState
from zb.elastic.view import WorldView
from zb.sparse_scheme import SparseScheme


@dataclass
class SyncStats:
    seconds: float = 0.0      # wall time from the first copy to the last bucket reduced
    wire_bytes: int = 0       # bytes this rank sent
    buckets: int = 0
    # Where `seconds` went (the two overlap: buckets are reduced while later ones are copied):
    d2h_s: float = 0.0        # the caller filling pseudo-gradients: device-to-host copy and subtraction
    reduce_s: float = 0.0     # the worker inside all_reduce calls (quantize, wire, dequantize)
    failed: list[int] = field(default_factory=list)   # diloco.clip: ranks the checked average left out (zb.diloco.verify)

    @property
    def mbps(self) -> float:
        return 8 * self.wire_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def wire_options(cfg: DilocoConfig, view: WorldView | None = None) -> dict[str, Any]:
    """all_reduce's compression keywords for diloco.compression (and the sparse scheme's keys), with the links'
    figures of the world `view` the transfer runs in (diloco.reduce_shape auto picks the shape by them)."""
    if cfg.compression != "sparse":
        links = {"link_ms": view.link_ms, "link_mbps": view.ring_mbps} if view is not None else {}
        return {"compression": cfg.compression, "shape": cfg.reduce_shape, **links}
    return {"compression": "sparse", "sparse": SparseScheme(cfg.sparse_chunk, cfg.sparse_k),
            "sparse_beta": cfg.sparse_beta}


def by_senders(cfg: DilocoConfig) -> bool:
    """Whether each entry of the average is over the nodes that sent it (diloco.sparse_average = senders)."""
    return cfg.compression == "sparse" and cfg.sparse_average == "senders"


def share_factor(cfg: DilocoConfig, weight: float, nodes: int) -> float:
    """What a node multiplies its pseudo-gradient by for a token-weighted average (diloco.round_seconds), its
    `weight` of the `nodes` contributors' (the weights sum to 1). Summed, the shares are the weighted average.
    Under diloco.sparse_average = senders the share is weight x nodes: the contribution whose mean over every
    contributor is that weighted average, so its mean over an entry's senders is the same rule as unweighted
    (equal weights give factor 1)."""
    return weight * nodes if by_senders(cfg) else weight


def reduce_bucket(bucket: torch.Tensor, group: dist.ProcessGroup, streams: Sequence[dist.ProcessGroup],
                  cfg: DilocoConfig, wire: dict[str, Any], residual: torch.Tensor | None, nodes: int,
                  weighted: bool) -> AllReduceStats:
    """All-reduce (SUM) one bucket of the `nodes` contributors' pseudo-gradients and make it their average in
    place: the sum over `nodes`, or as it is when weighted (the shares sum to the average). Under
    diloco.sparse_average = senders each entry is averaged over the nodes that sent it instead, weighted or not
    (share_factor). Returns all_reduce's stats."""
    senders = torch.empty_like(bucket) if by_senders(cfg) else None
    stats = all_reduce(bucket, group, op=ReduceOp.SUM, streams=streams, min_bandwidth_mbps=cfg.min_bandwidth_mbps,
                       residual=residual, senders=senders, **wire)
    if senders is not None:
        bucket.div_(senders.clamp_(min=1.0))
    elif not weighted and nodes != 1:
        bucket.div_(nodes)
    return stats


def bucket_ranges(numel: int, bucket_values: int) -> list[tuple[int, int]]:
    bucket_values = max(1, bucket_values)
    return [(a, min(a + bucket_values, numel)) for a in range(0, numel, bucket_values)]


class _Reducer(threading.Thread):
    """Worker thread: all-reduces buckets in order until told to stop or a transfer fails."""

    def __init__(self, outer: OuterState, group: dist.ProcessGroup, streams: Sequence[dist.ProcessGroup],
                 cfg: DilocoConfig, residual: torch.Tensor | None, view: WorldView | None):
        super().__init__(name="zb-pseudograd-allreduce", daemon=True)
        self.outer, self.group, self.streams, self.cfg = outer, group, streams, cfg
        self.wire = wire_options(cfg, view)
        self.residual = residual
        self.nodes, self.weighted = 1, False
        self.todo: queue.Queue[tuple[int, int] | None] = queue.Queue()   # bucket ranges; None: the last
        self.error: BaseException | None = None
        self.wire_bytes = 0
        self.busy_s = 0.0

    def run(self) -> None:
        while (item := self.todo.get()) is not None:
            if self.error is not None:
                continue  # drain: the buffer is undefined after a failure anyway
            a, b = item
            try:
                t0 = time.perf_counter()
                grad = self.outer.flat.grad
                assert grad is not None  # OuterState's pseudo-gradient buffer, never cleared
                bucket = grad[a:b]
                stats = reduce_bucket(bucket, self.group, self.streams, self.cfg, self.wire,
                                      self.residual[a:b] if self.residual is not None else None, self.nodes,
                                      self.weighted)
                self.wire_bytes += stats.wire_bytes
                self.busy_s += time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self.error = e


def sync_pseudo_gradient(outer: OuterState, group: dist.ProcessGroup, cfg: DilocoConfig,
                         streams: Sequence[dist.ProcessGroup] = (), *, scale: int | None = None,
                         zeros: bool = False, weight: float | None = None,
                         residual: torch.Tensor | None = None, clip: float = 1.0,
                         view: WorldView | None = None) -> SyncStats:
    """Fill outer.flat.grad with the replica group's pseudo-gradients summed and divided by `scale`
    (default: the group size, i.e. the average; DiLoCo passes the number of contributing nodes so
    that a joiner's zeros never shrink the update). With `zeros`, this rank sends zeros (a joiner).
    With `weight` (diloco.round_seconds), this rank sends weight * its pseudo-gradient and the sum is
    not divided: the weights of the group sum to 1 (zb.diloco.rounds). `residual`: this rank's error
    feedback, in the flat buffer's order. `clip`: the factor diloco.clip scales this rank's pseudo-gradient by
    (zb.diloco.clip). `view`: the world the sync runs in (its link figures pick the reduce's shape under
    diloco.reduce_shape auto). Raises PeerFailure when a transfer fails."""
    t0 = time.perf_counter()
    ranges = bucket_ranges(outer.numel, int(cfg.bucket_mb * 1e6 / 4))
    reducer = _Reducer(outer, group, streams, cfg, residual, view)
    reducer.nodes = group.size() if scale is None else scale
    reducer.weighted = weight is not None
    if zeros:
        assert outer.flat.grad is not None  # OuterState's pseudo-gradient buffer, never cleared
        outer.flat.grad.zero_()
    reducer.start()
    next_bucket = 0
    d2h_s = 0.0
    try:
        for index, (_, end) in enumerate(outer.param_ranges()):
            if not zeros:
                t1 = time.perf_counter()
                g = outer.pseudo_gradient_of(index)
                if weight is not None or clip != 1.0:
                    g.mul_((1.0 if weight is None else share_factor(cfg, weight, reducer.nodes)) * clip)
                d2h_s += time.perf_counter() - t1
            while next_bucket < len(ranges) and ranges[next_bucket][1] <= end:
                reducer.todo.put(ranges[next_bucket])
                next_bucket += 1
    finally:
        reducer.todo.put(None)
        reducer.join()
    if reducer.error is not None:
        raise reducer.error
    return SyncStats(time.perf_counter() - t0, reducer.wire_bytes, len(ranges), d2h_s, reducer.busy_s)
