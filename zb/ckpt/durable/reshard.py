"""Resuming a checkpoint with another local rank count: the ranks' FSDP2 shards joined and split anew.

FSDP2 shards every parameter and AdamW moment on dim 0 as torch.chunk splits it, in local-rank
order, so the model and optimizer files of a checkpoint's N parts, joined along dim 0, are the
whole tensors, and a node of M local ranks takes chunk r of M (empty past the last chunk). The
outer state needs no resharding: it is laid out in the run's stripes (zb.diloco.stripes), stripe s
in part s whatever the rank count, and a rank holding no stripe holds an empty one. What cannot
be mapped is said once by the caller: the RNG state of a rank beyond the old count (it takes rank
0's, so the resumed run is not bit-identical) and the per-rank data positions (dropped).
"""

from __future__ import annotations

import torch

from zb.shard_rows import rows


def join_and_split(parts: list[dict[str, torch.Tensor]], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Each tensor of `parts` (one dict per old local rank, in rank order) joined along dim 0, then
    this rank's chunk of `size`. A 0-d tensor (AdamW's step) is the same on every rank: part 0's."""
    out = {}
    for name, first in parts[0].items():
        if first.dim() == 0:
            out[name] = first
            continue
        whole = torch.cat([p[name] for p in parts])
        a, b = rows(whole.shape[0], size, rank)
        out[name] = whole[a:b].clone()
    return out


def stripe_of(parts: list[dict[str, torch.Tensor]], rank: int, stripes: int) -> dict[str, torch.Tensor]:
    """This rank's outer state: part `rank`'s when it holds a stripe, else empty tensors."""
    if rank < stripes:
        return parts[rank]
    return {name: t[:0].clone() for name, t in parts[0].items()}
