"""FSDP2's split of a tensor's rows over ranks, the one rule zb relies on wherever shards meet.

FSDP2 shards dim 0 as torch.chunk splits it: part i of n holds rows [i*c, min((i+1)*c, d0)) with
c = ceil(d0 / n), and the last parts fewer or none. The outer state's stripes (zb.diloco.stripes),
resharding a checkpoint for another local rank count (zb.ckpt.durable.reshard) and joining shards
into whole tensors (zb.export.gather) all follow it.
"""

from __future__ import annotations


def rows(d0: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [a, b) of part `index` of `parts` when d0 rows are split as torch.chunk splits them."""
    c = -(-d0 // parts) if d0 else 0
    a = min(index * c, d0)
    return a, min(a + c, d0)
