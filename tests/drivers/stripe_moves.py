"""Driver for tests/test_diloco_mixed_ranks.py: real FSDP2 shards on the torchrun world (gloo, CPU),
checked against whole tensors: StripeLayout.read gives each stripe owner exactly its rows of every
param and AdamW moment, and StripeLayout.write puts every rank's FSDP rows back from the owners.

    torchrun --standalone --nproc-per-node 3 tests/drivers/stripe_moves.py STRIPES
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from zb.diloco.stripes import StripeLayout
from zb.process_exit import leave
from zb.shard_rows import rows


def main() -> None:
    stripes = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # Row counts that do not divide evenly by 2 or 3, one with fewer rows than ranks, a 1-d norm.
    model = nn.Sequential(nn.Embedding(13, 4), nn.Linear(4, 7), nn.LayerNorm(7), nn.Linear(7, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    layout = StripeLayout(stripes, rank, size, dist.group.WORLD)
    params = list(model.parameters())
    moments = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    for tensors in (params, moments):
        shapes = [tuple(t.shape) for t in tensors]
        whole = [t.full_tensor().detach().float() for t in tensors]
        got = [torch.zeros(layout.stripe_shape(s)) for s in shapes]
        layout.read(shapes, tensors, got)
        for s, w, g in zip(shapes, whole, got):
            a, b = rows(s[0], stripes, rank) if rank < stripes else (0, 0)
            assert torch.equal(g, w[a:b]), (s, rank)
        layout.write(shapes, [g * 2 + 1 for g in got], tensors)
        for w, t in zip(whole, tensors):
            assert torch.equal(t.full_tensor().detach().float(), w * 2 + 1), rank
    print("ok", flush=True)
    dist.destroy_process_group()
    leave(0)  # finalizing after gloo can abort an otherwise passing rank (zb.process_exit)


if __name__ == "__main__":
    main()
