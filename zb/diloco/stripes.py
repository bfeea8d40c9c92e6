"""The canonical layout of the outer state: S stripes of every parameter's rows, whatever a node's FSDP sharding.

Stripe s of a parameter with d0 rows is rows [s*c, min((s+1)*c, d0)), c = ceil(d0 / S): the rows
FSDP2 gives local rank s of S (it splits dim 0 with torch.chunk). Local rank s < S of every node
holds stripe s of the outer params, outer momentum and pseudo-gradient, and all-reduces it over
replica group s, so nodes of different local rank counts meet in the same groups with the same
bytes. S (diloco.stripes) is the run's, fixed by its first node (default: that node's local rank
count); every node needs at least S local ranks.

- A node with S local ranks holds exactly its FSDP shards: nothing moves (`identity`), and the
  outer state, its groups and its bytes are what they were before stripes existed.
- A node with L > S local ranks moves rows inside the node: to read its model into stripes, every
  rank adds its FSDP rows into a zero buffer of a window of rows and the buffer is summed over the
  node's gloo group (each row is non-zero on exactly one rank, so the sum is exact); the stripe
  owners take their rows out. Writing back is the same the other way. Windows of at most WINDOW
  values keep any one rank from holding a whole large parameter. Ranks S..L-1 hold no stripe
  ("passengers"): they train and take part in these node-local sums, and nothing else of DiLoCo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zb.shard_rows import rows

WINDOW = 1 << 24   # values per node-local sum: 64 MB of fp32


def _rows_of(t_shape: Sequence[int]) -> tuple[int, int]:
    """(rows, values per row) of a tensor of this shape (a 0-d tensor: one row of one value)."""
    if len(t_shape) == 0:
        return 1, 1
    per_row = 1
    for d in t_shape[1:]:
        per_row *= d
    return t_shape[0], per_row


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: the local shard of an FSDP2 DTensor, else the tensor."""
    data = t.data
    return data.to_local() if hasattr(data, "to_local") else data


# Called with (first row, end row, the buffer of those rows). `...`: the callers' lambdas bind their tensor as a
# default argument, and mypy cannot infer such a lambda against a fixed parameter list.
Rows = Callable[..., None]


class StripeLayout:
    """Where this local rank's stripe lies, and the moves between it and the node's FSDP shards."""

    def __init__(self, stripes: int, local_rank: int, local_world_size: int,
                 group: dist.ProcessGroup | None = None) -> None:
        if local_world_size < stripes:
            raise ValueError(f"{local_world_size} local ranks cannot hold {stripes} stripes")
        self.stripes, self.rank, self.size, self.group = stripes, local_rank, local_world_size, group
        self.identity = stripes == local_world_size
        self.owner = local_rank < stripes

    def stripe_shape(self, full_shape: Sequence[int]) -> torch.Size:
        """Shape of this rank's stripe of a parameter of `full_shape` (0 rows for a passenger)."""
        a, b = self._stripe_rows(full_shape)
        return torch.Size([b - a, *full_shape[1:]])   # a 0-d tensor: one row of one value

    @torch.no_grad()
    def read(self, full_shapes: Sequence[Sequence[int]], shards: Sequence[torch.Tensor],
             out: Sequence[torch.Tensor]) -> None:
        """out[i] := this rank's stripe of tensor i, whose local FSDP shard here is shards[i] (any
        device and dtype; out is fp32 CPU). A collective over the node's local ranks."""
        for shape, shard, dst in zip(full_shapes, shards, out):
            self._move(shape, lambda a, b, buf, s=shard, shape=shape: _put(buf, s, a, b, self._fsdp_rows(shape)),
                       lambda a, b, buf, d=dst, shape=shape: _take(buf, d, a, b, self._stripe_rows(shape)))

    @torch.no_grad()
    def write(self, full_shapes: Sequence[Sequence[int]], stripes: Sequence[torch.Tensor],
              shards: Sequence[torch.Tensor]) -> None:
        """shards[i] (this rank's FSDP shard, in place) := the stripe owners' values of tensor i. A
        collective over the node's local ranks."""
        for shape, src, shard in zip(full_shapes, stripes, shards):
            self._move(shape, lambda a, b, buf, s=src, shape=shape: _put(buf, s, a, b, self._stripe_rows(shape)),
                       lambda a, b, buf, d=shard, shape=shape: _take(buf, d, a, b, self._fsdp_rows(shape)))

    def _fsdp_rows(self, shape: Sequence[int]) -> tuple[int, int]:
        return rows(_rows_of(shape)[0], self.size, self.rank)

    def _stripe_rows(self, shape: Sequence[int]) -> tuple[int, int]:
        return rows(_rows_of(shape)[0], self.stripes, self.rank) if self.owner else (0, 0)

    def _move(self, shape: Sequence[int], put: Rows, take: Rows) -> None:
        d0, per_row = _rows_of(shape)
        step = max(1, WINDOW // max(1, per_row))
        for a in range(0, d0, step):
            b = min(a + step, d0)
            buf = torch.zeros((b - a) * per_row, dtype=torch.float32)
            put(a, b, buf)
            dist.all_reduce(buf, group=self.group)
            take(a, b, buf)


def _overlap(a: int, b: int, mine: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a, mine[0]), min(b, mine[1])
    return (lo, hi) if lo < hi else None


def _put(buf: torch.Tensor, src: torch.Tensor, a: int, b: int, mine: tuple[int, int]) -> None:
    """buf (rows a..b of the whole tensor) += the rows of `src` (which holds rows `mine`) in it."""
    both = _overlap(a, b, mine)
    if both is None:
        return
    lo, hi = both
    flat = local_shard(src).detach().reshape(-1)
    per_row = flat.numel() // max(1, mine[1] - mine[0])
    buf[(lo - a) * per_row:(hi - a) * per_row] = flat[(lo - mine[0]) * per_row:(hi - mine[0]) * per_row].to(
        device="cpu", dtype=torch.float32)


def _take(buf: torch.Tensor, dst: torch.Tensor, a: int, b: int, mine: tuple[int, int]) -> None:
    """The rows of `dst` (which holds rows `mine`) within rows a..b := buf's."""
    both = _overlap(a, b, mine)
    if both is None:
        return
    lo, hi = both
    flat = local_shard(dst).view(-1)     # shards and outer views are contiguous: writes land in place
    per_row = flat.numel() // max(1, mine[1] - mine[0])
    flat[(lo - mine[0]) * per_row:(hi - mine[0]) * per_row].copy_(buf[(lo - a) * per_row:(hi - a) * per_row])
