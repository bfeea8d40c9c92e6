"""Relative error of the quantized all-reduce at every width, with and without error feedback, and the
ring against an all-to-all reduce-scatter (the collective shape decision of issue 25).

Inputs, like pseudo-gradients: each round, rank i sends s + n_i, with s one heavy-tailed direction shared
by every rank and every round (Student-t, df = 3: the signal training keeps pushing) and n_i fresh
heavy-tailed noise of the same size per rank and round. Over R rounds:
  one call    ||out_r - exact_r|| / ||exact_r||, the mean over rounds (what one outer step is off by)
  cumulative  ||sum_r out_r - sum_r exact_r|| / ||sum_r exact_r|| (what the params are off by after R
              outer steps with outer lr 1)
The ring is zb's own all_reduce (W ranks as threads of this process over real gloo groups, with
diloco.error_feedback's residual when on); the all-to-all is simulated here with the same kernels: each
rank quantizes its whole tensor once (with its residual), the owner of each chunk sums the W
dequantized chunks in fp32 and quantizes the sum once (its error fed back into its own residual).

Run: PYTHONPATH=. python scripts/bench_compression_error.py [--world-sizes 3,8] [--numel 262144] [--rounds 20]
Prints a table (stderr) and one JSON line (stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from zb.collectives import all_reduce, kernels
from zb.collectives.pieces import split_blocks
from zb.testing.procs import free_port


def inputs(world: int, numel: int, rounds: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def heavy() -> torch.Tensor:
        return torch.randn(numel, generator=g) / (torch.distributions.Chi2(3.0).sample((numel,)) / 3).sqrt()

    torch.manual_seed(seed)   # Chi2 samples from the global generator
    shared = heavy() * 0.01
    return [[shared + heavy() * 0.01 for _ in range(world)] for _ in range(rounds)]


def ring(xs: list[list[torch.Tensor]], compression: str, feedback: bool) -> list[torch.Tensor]:
    """zb's all_reduce over W threads; rank 0's output per round."""
    world, numel = len(xs[0]), xs[0][0].numel()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    outs: list[torch.Tensor] = []

    def rank(r: int) -> None:
        client = store if r == 0 else dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", client), r, world, timedelta(seconds=60))
        residual = torch.zeros(numel) if feedback else None
        for round_xs in xs:
            y = round_xs[r].clone()
            all_reduce(y, pg, compression=compression, residual=residual, piece_values=1 << 16)
            if r == 0:
                outs.append(y)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def _quantized(x: torch.Tensor, scheme, residual: torch.Tensor | None) -> torch.Tensor:
    codes = torch.empty(kernels.code_bytes(x.numel(), scheme), dtype=torch.uint8)
    scales = torch.empty(kernels.num_blocks(x.numel(), scheme.block))
    kernels.quantize(x, codes, scales, scheme=scheme, residual=residual)
    out = torch.empty_like(x)
    kernels.dequantize(codes, scales, out, scheme=scheme)
    return out


def all_to_all(xs: list[list[torch.Tensor]], compression: str, feedback: bool) -> list[torch.Tensor]:
    """The all-to-all reduce-scatter + all-gather shape, simulated with the same kernels."""
    scheme = kernels.SCHEMES[compression]
    world, numel = len(xs[0]), xs[0][0].numel()
    bounds = [min(b * scheme.block, numel) for b in split_blocks(kernels.num_blocks(numel, scheme.block), world)]
    chunks = list(zip(bounds, bounds[1:]))
    residuals = [torch.zeros(numel) for _ in range(world)]
    outs = []
    for round_xs in xs:
        total = torch.zeros(numel)
        for r, x in enumerate(round_xs):
            sent = torch.cat([_quantized(x[a:b].clone(), scheme, residuals[r][a:b] if feedback else None)
                              for a, b in chunks])
            total += sent
        out = torch.empty(numel)
        for owner, (a, b) in enumerate(chunks):
            res = torch.zeros(b - a) if feedback else None
            out[a:b] = _quantized(total[a:b].clone(), scheme, res)
            if res is not None:
                residuals[owner][a:b] += res
        outs.append(out)
    return outs


def errors(xs: list[list[torch.Tensor]], outs: list[torch.Tensor]) -> tuple[float, float]:
    exact = [torch.stack(r).double().sum(0) for r in xs]
    one = sum(float((o.double() - e).norm() / e.norm()) for o, e in zip(outs, exact)) / len(outs)
    total, got = sum(exact), sum(o.double() for o in outs)
    return one, float((got - total).norm() / total.norm())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="3,8")
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--compressions", default="int8,int4,int2")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        xs = inputs(world, args.numel, args.rounds)
        for compression in args.compressions.split(","):
            for feedback in (False, True):
                for shape, run in (("ring", ring), ("all-to-all (simulated)", all_to_all)):
                    one, cumulative = errors(xs, run(xs, compression, feedback))
                    rows.append({"world_size": world, "compression": compression, "error_feedback": feedback,
                                 "shape": shape, "one_call": one, "cumulative": cumulative})
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"relative L2 error of the SUM, {args.numel} values, {args.rounds} rounds")
    for col in ("nodes", "width", "error feedback", "shape", "one call", f"after {args.rounds} rounds"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["world_size"]), r["compression"], "on" if r["error_feedback"] else "off", r["shape"],
                      f"{r['one_call']:.4f}", f"{r['cumulative']:.4f}")
    Console(stderr=True).print(table)
    doc = {"benchmark": "compression_error", "numel": args.numel, "rounds": args.rounds, "rows": rows}
    sys.stdout.write(json.dumps(doc) + "\n")
    return doc


if __name__ == "__main__":
    main()
