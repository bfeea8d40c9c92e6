"""What a node with more local ranks than the run's stripes pays per outer step (diloco.stripes).

Two local ranks (gloo, CPU) shard a stack of Linear layers with FSDP2. Per outer step a DiLoCo node
reads its model into the outer state's layout (the pseudo-gradient) and writes the outer params back:
- identity: the run has 2 stripes, each rank's stripe is its FSDP shard (a copy each way);
- moved: the run has 1 stripe (a 1-rank laptop is in it): rows move inside the node by node-local
  sums over gloo (zb.diloco.stripes), rank 1 holds no outer state.
Both are timed in the same run, alternately (the machine is shared), median of --repeats.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_stripes.py --params-m 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from zb.config_schema import DilocoConfig
from zb.diloco.outer import OuterState
from zb.diloco.stripes import StripeLayout
from zb.process_exit import leave


def worker(rank: int, size: int, args, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    width = 2048
    layers = max(1, round(args.params_m * 1e6 / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    states = {"identity": OuterState(model, DilocoConfig(), StripeLayout(size, rank, size, dist.group.WORLD)),
              "moved": OuterState(model, DilocoConfig(), StripeLayout(1, rank, size, dist.group.WORLD))}
    times: dict[str, list[float]] = {k: [] for k in states}
    for _ in range(args.repeats):
        for kind, outer in states.items():
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "moved":
                outer.fill_pseudo_gradients()
            else:
                for i in range(len(outer.params)):
                    outer.pseudo_gradient_of(i)
            outer.push_to_model()
            dist.barrier()
            times[kind].append(time.perf_counter() - t0)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        out.put({"params": params, **{k: statistics.median(v) for k, v in times.items()}})
        out.close()
        out.join_thread()  # the report is through the pipe before the hard exit below
    dist.destroy_process_group()
    leave(0)  # finalizing after gloo can abort a passing rank (zb.process_exit)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=64.0, help="model size, millions of params")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, args, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=3600)
    for p in procs:
        p.join()
    gb = result["params"] * 4 / 1e9
    report = {"params": result["params"], "identity_s": round(result["identity"], 3), "moved_s": round(result["moved"], 3),
              "ratio": round(result["moved"] / result["identity"], 2), "moved_gb_per_s": round(2 * gb / result["moved"], 2)}
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"2 local ranks, {result['params'] / 1e6:.0f}M params (fp32 {gb:.2f} GB): read + write per outer step")
    for col in ("layout", "seconds", "vs identity"):
        table.add_column(col, justify="right")
    table.add_row("identity (2 stripes)", f"{report['identity_s']:.3f}", "1.00x")
    table.add_row("moved (1 stripe)", f"{report['moved_s']:.3f}", f"{report['ratio']:.2f}x")
    Console(stderr=True).print(table)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
