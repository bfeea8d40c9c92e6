"""Driver for tests/test_diloco_outer.py: one DiLoCo outer step between N single-rank nodes.

    python diloco_formula.py RANK WORLD PORT COMPRESSION

Each node does 2 inner AdamW steps on its own random tokens, then syncs through OuterState and
sync_pseudo_gradient over a plain ProcessGroupGloo. It also gathers every node's params (fp32,
exact) so the test can recompute the Nesterov outer step by hand. Prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from zb.config import load_config
from zb.diloco.outer import OuterState
from zb.diloco.sync import sync_pseudo_gradient
from zb.models import Transformer, model_args
from zb.models.loss import cross_entropy


def main() -> None:
    rank, world, port, compression = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cfg = load_config([], {"diloco.compression": compression, "diloco.bucket_mb": "0.05",
                           "model.name": "debug"}, environ={})
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("mesh_1", store), rank, world, timedelta(seconds=60))
    model = Transformer(model_args(cfg.model, vocab_size=64, max_seq_len=16))
    model.init_weights(7)
    outer = OuterState(model, cfg.diloco)
    before = outer.flat.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        tokens = torch.randint(0, 64, (2, 17), generator=gen)
        loss, _ = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    current = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(current) for _ in range(world)]
    pg.allgather([everyone], [current]).wait()
    stats = sync_pseudo_gradient(outer, pg, cfg.diloco)
    outer.step()
    outer.push_to_model()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(json.dumps({
        "rank": rank, "buckets": stats.buckets, "wire_bytes": stats.wire_bytes,
        "before": before.tolist(), "everyone": [t.tolist() for t in everyone],
        "outer_after": outer.flat.detach().tolist(), "model_after": after.tolist(),
        "hash": hashlib.sha256(outer.flat.detach().numpy().tobytes()).hexdigest(),
    }), flush=True)


if __name__ == "__main__":
    main()
