"""all_reduce(tensor, group, ...): fp32 through the backend, or the quantized ring of ring.py (shape "ring") or
halving-doubling of halving.py (shape "halving")."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zb.collectives import kernels, sparse_twins
from zb.collectives.gather import run_gathers
from zb.collectives.halving import run_halving
from zb.collectives.kernels import SCHEMES, SparseScheme, num_blocks
from zb.collectives.peer_failure import PeerFailure
from zb.collectives.pieces import split_blocks
from zb.collectives.ring import TransferDeadlines, run_ring
from zb.collectives.shape_model import faster_shape
from zb.errors import InvalidInput

COMPRESSIONS = ("none", *SCHEMES, "sparse")
SHAPES = ("auto", "ring", "halving")  # the quantized all-reduce's message pattern: 2 (W - 1) steps, or 2 log2 W


def pick_shape(shape: str, compression: str, world: int, *, numel: int = 0, piece_values: int = 1 << 20,
               link_ms: float | None = None, link_mbps: float | None = None) -> str:
    """The quantized all-reduce's shape for `shape` (auto, ring or halving). auto, for a quantized compression:
    - over a power of two of at least 4 ranks, halving-doubling: 2 log2 W steps to the ring's 2 (W - 1), with
      the same bytes a rank;
    - over another count of at least 5, with the links measured (`link_ms`, the longest one-way delay among
      the members' links, and `link_mbps`, the ring's slowest hop: zb.elastic.ring), whichever shape the model
      of zb.collectives.shape_model says is faster for `numel` values: halving's fold moves the whole tensor
      twice more over one link, which pays only where the steps it saves cost more (long delays, many ranks);
    - else the ring: at 2 and 3 ranks the step counts are equal, and without measurements the fold's cost is
      the one that is known.
    Every rank must pick the same shape: the inputs are the group's size, the tensor's and the world record's
    link figures, which every member reads the same."""
    if shape != "auto":
        return shape
    if compression not in SCHEMES or world < 4:
        return "ring"
    if world & (world - 1) == 0:
        return "halving"
    if link_ms is None or not link_mbps or numel <= 0:
        return "ring"
    return faster_shape(numel, world, piece_values, compression, link_ms / 1e3, link_mbps)


ALIGN = max(s.block for s in SCHEMES.values())  # stream slices start on a block of every scheme


@dataclass
class AllReduceStats:
    """What one call cost: bytes this rank sent (payload, all streams) and wall seconds."""

    compression: str
    numel: int
    world_size: int
    wire_bytes: int
    seconds: float


def _check(tensor: torch.Tensor, op: ReduceOp.RedOpType, compression: str,
           groups: Sequence[dist.ProcessGroup], residual: torch.Tensor | None, sparse: SparseScheme | None,
           sparse_beta: float, shape: str = "ring", senders: torch.Tensor | None = None) -> None:
    if residual is not None and (compression == "none" or residual.dtype != torch.float32 or
                                 residual.numel() != tensor.numel() or not residual.is_contiguous()):
        raise InvalidInput("an error-feedback residual needs a quantized compression and one contiguous float32 "
                           "value per value of the tensor")
    if compression not in COMPRESSIONS:
        raise InvalidInput(f"compression {compression!r}: use one of {', '.join(COMPRESSIONS)}")
    if shape not in SHAPES:
        raise InvalidInput(f"shape {shape!r}: use one of {', '.join(SHAPES)}")
    if shape == "halving" and compression not in SCHEMES:
        raise InvalidInput(f"shape 'halving' with compression {compression!r}: the halving shape applies to "
                           f"{'/'.join(SCHEMES)} only")
    if senders is not None and (compression != "sparse" or senders.dtype != torch.float32 or
                                senders.numel() != tensor.numel() or not senders.is_contiguous()):
        raise InvalidInput("a senders count needs sparse compression and one contiguous float32 value per value of "
                           "the tensor")
    if sparse is not None and (wrong := sparse.problem()) is not None:
        raise InvalidInput(f"sparse compression with {wrong[1]}")
    if not 0.0 <= sparse_beta <= 1.0:
        raise InvalidInput(f"sparse_beta {sparse_beta}: the residual's decay must be in [0, 1]")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise InvalidInput(f"op {op}: only ReduceOp.SUM and ReduceOp.AVG are supported")
    if tensor.dtype not in (torch.float32, torch.bfloat16):
        raise InvalidInput(f"all_reduce takes float32 or bfloat16 tensors, got {tensor.dtype}")
    if any(g.size() != groups[0].size() or g.rank() != groups[0].rank() for g in groups):
        raise InvalidInput("all stream groups must have the same members and ranks as the main group")


def _slices(n: int, parts: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """Block-aligned [start, stop) ranges splitting n values over the streams."""
    bounds = split_blocks(num_blocks(n, align), parts)
    return [(min(a * align, n), min(b * align, n)) for a, b in zip(bounds, bounds[1:])]


def _sparse(flat: torch.Tensor, groups: Sequence[dist.ProcessGroup], avg: bool, deadlines: TransferDeadlines,
            scheme: SparseScheme, residual: torch.Tensor | None, beta: float, senders: torch.Tensor | None) -> int:
    """Each stream's chunk-aligned slice compressed (zb.collectives.sparse_twins), every rank's payload gathered
    (zb.collectives.gather), then decoded in rank order into zeros: the same bytes in the same order everywhere.
    `senders`: filled with how many ranks sent each entry (each payload's marks decoded: sparse_twins.marks)."""
    slices = [(a, b, g) for g, (a, b) in zip(groups, _slices(flat.numel(), len(groups), scheme.chunk)) if b > a]
    parts = []
    for a, b, g in slices:
        payload = torch.empty(scheme.payload_bytes(b - a), dtype=torch.uint8)
        kernels.sparse_compress(flat[a:b], payload, scheme, residual=residual[a:b] if residual is not None else None,
                                beta=beta)
        parts.append((payload, g))
    gathered, wire = run_gathers(parts, deadlines)
    for (a, b, g), payloads in zip(slices, gathered):
        out = flat[a:b].zero_()
        for owner, payload in enumerate(payloads):
            if not kernels.sparse_decode_add(payload, out, scheme):
                raise PeerFailure(f"sparse exchange: rank {owner}'s payload is forged (an index field that is "
                                  "not K' indices inside its chunk)", rank=owner, observer=g.rank())
        if senders is not None:
            count = senders[a:b].zero_()
            for payload in payloads:
                kernels.sparse_decode_add(sparse_twins.marks(payload, b - a, scheme), count, scheme)
            count.div_(sparse_twins.MARK)
    if avg:
        flat.div_(groups[0].size())
    return wire


def _fp32(flat: torch.Tensor, groups: Sequence[dist.ProcessGroup], avg: bool, deadlines: TransferDeadlines) -> int:
    """Backend all-reduce (gloo or NCCL), one slice per stream in flight at once."""
    world = groups[0].size()
    works = []
    for g, (a, b) in zip(groups, _slices(flat.numel(), len(groups))):
        if b > a:
            opts = dist.AllreduceOptions()
            # gloo has no AVG: divide afterwards, identically everywhere. torch's stub types the field
            # ReduceOp; pybind11 converts the RedOpType member (what torch itself passes) implicitly.
            opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
            works.append((g, b - a, g.allreduce([flat[a:b]], opts)))
    for g, n, work in works:
        seconds = deadlines.for_bytes(8 * n * (world - 1) // world, first=True)
        try:
            work.wait(timedelta(seconds=seconds))
        except Exception as e:  # noqa: BLE001 - gloo names an address, not a rank
            raise PeerFailure(f"fp32 all-reduce failed: {str(e).splitlines()[0]}", rank=None,
                              observer=g.rank()) from e
    if avg:
        flat.div_(world)
    return 8 * flat.numel() * (world - 1) // world


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, op: ReduceOp.RedOpType = ReduceOp.SUM,
               compression: str = "none", streams: Sequence[dist.ProcessGroup] = (),
               min_bandwidth_mbps: float = 10.0, timeout_floor_s: float = 10.0,
               start_timeout_s: float = 300.0, piece_values: int = 1 << 20,
               window: int = 4, residual: torch.Tensor | None = None, sparse: SparseScheme | None = None,
               sparse_beta: float = 1.0, shape: str = "ring", link_ms: float | None = None,
               link_mbps: float | None = None, senders: torch.Tensor | None = None) -> AllReduceStats:
    """All-reduce `tensor` in place over `group` (+ the extra `streams` groups); see the package doc. `shape`
    ("ring", "halving": quantized compressions only, or "auto": pick_shape, with the links' measured delay and
    bandwidth `link_ms` and `link_mbps` when known) picks the ring or recursive halving-doubling. `senders`
    (sparse only: one float32 per value) is filled with how many ranks sent each entry (1 everywhere alone)."""
    groups = [group, *streams]
    _check(tensor, op, compression, groups, residual, sparse, sparse_beta, shape, senders)
    t0 = time.perf_counter()
    world = group.size()
    if world == 1 or tensor.numel() == 0:
        if senders is not None:
            senders.fill_(1.0)
        return AllReduceStats(compression, tensor.numel(), world, 0, 0.0)
    if compression != "none" and tensor.is_cuda:
        raise InvalidInput(f"the {compression} ring runs on CPU tensors over a gloo group; use compression='none' "
                           "for GPU tensors")
    deadlines = TransferDeadlines(min_bandwidth_mbps, timeout_floor_s, start_timeout_s)
    flat = tensor.view(-1) if tensor.dtype == torch.float32 and tensor.is_contiguous() else tensor.reshape(-1).float()
    avg = op == ReduceOp.AVG
    if compression == "none":
        wire = _fp32(flat, groups, avg, deadlines)
    elif compression == "sparse":
        wire = _sparse(flat, groups, avg, deadlines, sparse or SparseScheme(),
                       residual.view(-1) if residual is not None else None, sparse_beta, senders)
    else:
        res = residual.view(-1) if residual is not None else None
        parts = [(flat[a:b], g, res[a:b] if res is not None else None)
                 for g, (a, b) in zip(groups, _slices(flat.numel(), len(groups))) if b > a]
        picked = pick_shape(shape, compression, world, numel=flat.numel(), piece_values=piece_values,
                            link_ms=link_ms, link_mbps=link_mbps)
        run = run_halving if picked == "halving" else run_ring
        wire = run(parts, avg, deadlines, piece_values, window, SCHEMES[compression])
    if flat.data_ptr() != tensor.data_ptr() or flat.dtype != tensor.dtype:
        tensor.copy_(flat.view(tensor.shape))
    return AllReduceStats(compression, tensor.numel(), world, wire, time.perf_counter() - t0)
