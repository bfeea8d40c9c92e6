"""Worker process for tests/test_allreduce.py: one rank of an all-reduce over a bare gloo group.

argv: rank world port outdir spec_json. Writes <outdir>/rank<r>.pt (inputs and results) or
<outdir>/rank<r>.err (the PeerFailure: rank and message) and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp


def make_input(spec: dict, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * spec.get("seed", 0) + rank)
    x = torch.randn(spec["numel"], generator=g) * spec.get("scale", 1.0)
    if spec.get("heavy"):
        x = x / torch.rand(spec["numel"], generator=g).clamp(min=1e-3).sqrt()  # heavy tails
    for index, value in spec.get("poison", {}).get(str(rank), []):
        x[index] = float(value)
    return x.to(getattr(torch, spec.get("dtype", "float32")))


def group(rank: int, world: int, port: int, prefix: str) -> dist.ProcessGroup:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, timedelta(seconds=30))


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    spec = json.loads(sys.argv[5])
    torch.set_num_threads(1)
    from zb.collectives import PeerFailure, all_reduce

    groups = [group(rank, world, port, f"mesh_{s}") for s in range(spec.get("streams", 1))]
    x = make_input(spec, rank)
    out = x.clone()
    op = ReduceOp.AVG if spec.get("op") == "avg" else ReduceOp.SUM
    kwargs = dict(op=op, compression=spec["compression"], streams=groups[1:],
                  timeout_floor_s=spec.get("floor", 10.0), start_timeout_s=spec.get("floor", 10.0),
                  piece_values=spec.get("piece", 1 << 20))
    if spec.get("die") == rank:
        # die mid-ring: after the first piece is in flight (the hook runs inside the ring)
        from zb.collectives import ring

        original = ring.RingPart._send

        def send_then_die(self, k, buf):
            original(self, k, buf)
            if k >= spec.get("die_after", 1):
                os.kill(os.getpid(), signal.SIGSTOP if spec.get("hang") else signal.SIGKILL)

        ring.RingPart._send = send_then_die
    try:
        stats = all_reduce(out, groups[0], **kwargs)
    except PeerFailure as e:
        (outdir / f"rank{rank}.err").write_text(json.dumps({"rank": e.rank, "message": str(e)}))
        return
    torch.save({"input": x, "output": out, "wire_bytes": stats.wire_bytes}, outdir / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
