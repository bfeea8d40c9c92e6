"""The quantized all-reduce's two shapes: the ring (2 (W - 1) message steps) vs recursive halving-doubling
(about 2 log2 W steps, zb/collectives/halving.py), measured on loopback and modelled on long links.

measured: W local processes over bare gloo groups (127.0.0.1), the same tensor through both shapes, the two
          alternating repeat by repeat in the same processes so machine noise hits both alike; the wall time of
          the all_reduce call is the slowest rank's; median and range over --repeat repeats (after one
          warm-up); wire bytes are what one rank sends (the most over ranks). Each rank gets cores / W threads.
          Loopback has no delay, so on a small machine this mostly measures compute and scheduling.
modelled: one-way link delay d (--delays-ms) and bandwidth B (--mbps) on every link: each step costs d plus
          the biggest message any rank sends in it over B, summed over the steps (the layouts are the code's
          own: zb.collectives.pieces.Layout, zb.collectives.halving.Plan). Ring: 2 (W - 1) (d + chunk / B).
          Halving: 2 log2 P steps of shrinking, then growing, halves (P the largest power of two <= W), plus
          two whole-tensor steps (the fold and the unfold) when W is not a power of two. Per step, a pipelined
          message costs its delay once and its bytes at B; the kernels' time, the pipeline's fill and TCP's
          slow start are left out.

    PYTHONPATH=$PWD python scripts/bench_reduce_shapes.py --worlds 2,4,8 --repeat 3

Prints a table and, last, one JSON line: {"bench": "reduce_shapes", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zb.collectives.allreduce import pick_shape  # noqa: E402
from zb.collectives.bench import communicate_all  # noqa: E402
from zb.collectives.halving import Plan  # noqa: E402
from zb.collectives.kernels import SCHEMES  # noqa: E402
from zb.collectives.shape_model import halving_steps, modelled, ring_steps  # noqa: E402

SHAPES = ("ring", "halving")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


# measured ------------------------------------------------------------------------------------------------------
def _gather(pg: dist.ProcessGroup, values: list[float]) -> torch.Tensor:
    """[world, len(values)] float64 from every rank."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(pg.size())]
    pg.allgather([out], [mine]).wait()
    return torch.stack(out)


def worker(rank: int, world: int, port: int, cfg: dict) -> None:
    """One rank: every size through both shapes, alternating; rank 0 prints the results as JSON."""
    from zb.collectives import all_reduce
    from zb.collectives.bench import make_group
    from zb.collectives.build import use_cpp

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world))
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    pg = make_group(store, "shapes", rank, world, timedelta(seconds=300))
    use_cpp()  # build or load the kernels now, not inside the first timed call
    rows = []
    for n in cfg["sizes"]:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        work = torch.empty_like(x)
        times: dict[str, list[float]] = {s: [] for s in SHAPES}
        wire: dict[str, list[float]] = {}
        crc_ok: dict[str, bool] = {}
        for it in range(cfg["warmup"] + cfg["repeat"]):
            for shape in SHAPES:
                work.copy_(x)
                pg.barrier().wait()
                t0 = time.perf_counter()
                stats = all_reduce(work, pg, compression=cfg["compression"], shape=shape,
                                   piece_values=cfg["piece_values"], start_timeout_s=300.0)
                seconds = time.perf_counter() - t0
                crc = float(zlib.crc32(work.numpy().view("uint8").data))
                both = _gather(pg, [seconds, float(stats.wire_bytes), crc])
                if it >= cfg["warmup"]:
                    times[shape].append(float(both[:, 0].max()))
                wire[shape] = [float(v) for v in both[:, 1]]
                crc_ok[shape] = crc_ok.get(shape, True) and bool((both[:, 2] == both[0, 2]).all())
        for shape in SHAPES:
            rows.append({"world": world, "values": n, "shape": shape, "times_s": times[shape],
                         "median_s": statistics.median(times[shape]), "min_s": min(times[shape]),
                         "max_s": max(times[shape]), "wire_bytes_max": max(wire[shape]),
                         "wire_bytes_mean": statistics.fmean(wire[shape]), "ranks_agree": crc_ok[shape]})
    pg.barrier().wait()
    if rank == 0:
        sys.stdout.write(json.dumps(rows) + "\n")


def measure(world: int, cfg: dict, timeout: float) -> list[dict]:
    """Start W ranks of this script on loopback; rank 0's rows."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LOCAL_WORLD_SIZE": str(world), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port), json.dumps(cfg)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    outs = communicate_all(procs, timeout)
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"W={world}: rank {r} exited with {p.returncode}: {err.strip()[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


# modelled ------------------------------------------------------------------------------------------------------
def model_rows(worlds: list[int], sizes: list[int], delays_ms: list[float], mbps: float, piece_values: int,
               compression: str) -> list[dict]:
    rows = []
    for world in worlds:
        for n in sizes:
            shapes = {"ring": ring_steps(n, world, piece_values, compression),
                      "halving": halving_steps(n, world, piece_values, compression)}
            for d in delays_ms:
                # what diloco.reduce_shape auto takes on such links (measured: the world's link figures)
                auto = pick_shape("auto", compression, world, numel=n, piece_values=piece_values, link_ms=d,
                                  link_mbps=mbps)
                for shape, steps in shapes.items():
                    rows.append({"world": world, "values": n, "shape": shape, "delay_ms": d, "mbps": mbps,
                                 "steps": len(steps), "seconds": modelled(steps, d / 1e3, mbps),
                                 "wire_bytes_max": sum(steps), "auto": shape == auto})
    return rows


# report --------------------------------------------------------------------------------------------------------
def table(measured: list[dict], model: list[dict], mbps: float) -> str:
    head = f"{'kind':<9} {'W':>3} {'values':>9} {'shape':<8} {'delay':>7} {'steps':>5} {'median s':>10} " \
           f"{'min..max s':>17} {'wire MB/rank':>12} {'halving/ring':>12} auto"
    lines = [head, "-" * len(head)]
    by_key = {(r["world"], r["values"], r["shape"]): r for r in measured}
    for r in measured:
        ratio = ""
        if r["shape"] == "halving":
            ratio = f"{r['median_s'] / by_key[(r['world'], r['values'], 'ring')]['median_s']:.2f}x"
        steps = 2 * (r["world"] - 1) if r["shape"] == "ring" else Plan(1, r["world"], 0, 1, SCHEMES["int8"]).steps
        agree = "" if r["ranks_agree"] else "  RANKS DISAGREE"
        lines.append(f"{'measured':<9} {r['world']:>3} {r['values']:>9} {r['shape']:<8} {'0 (lo)':>7} {steps:>5} "
                     f"{r['median_s']:>10.4f} {r['min_s']:>8.4f}..{r['max_s']:<8.4f} "
                     f"{r['wire_bytes_max'] / 1e6:>12.3f} {ratio:>12}{agree}")
    model_key = {(r["world"], r["values"], r["shape"], r["delay_ms"]): r for r in model}
    for r in model:
        ratio = ""
        if r["shape"] == "halving":
            ratio = f"{r['seconds'] / model_key[(r['world'], r['values'], 'ring', r['delay_ms'])]['seconds']:.2f}x"
        lines.append(f"{'modelled':<9} {r['world']:>3} {r['values']:>9} {r['shape']:<8} {r['delay_ms']:>5g}ms "
                     f"{r['steps']:>5} {r['seconds']:>10.4f} {'':>17} {r['wire_bytes_max'] / 1e6:>12.3f} {ratio:>12}"
                     f" {'<-' if r['auto'] else ''}")
    lines.append(f"(modelled: {mbps:g} Mbit/s links, one-way delay as shown; measured: loopback; auto <-: the shape "
                 "diloco.reduce_shape auto takes with those link figures in the world)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=_ints, default=[2, 4, 8, 16], help="world sizes, comma-separated")
    parser.add_argument("--values", type=int, default=1_000_000, help="values of the large tensor")
    parser.add_argument("--small", type=int, default=4096, help="values of the small tensor (latency); 0: none")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--compression", default="int8", choices=sorted(SCHEMES))
    parser.add_argument("--piece-values", type=int, default=1 << 20, help="all_reduce's piece_values")
    parser.add_argument("--delays-ms", type=_floats, default=[0.0, 25.0, 50.0, 100.0], help="modelled one-way delays")
    parser.add_argument("--mbps", type=float, default=100.0, help="modelled link bandwidth, Mbit/s")
    parser.add_argument("--no-measure", action="store_true", help="the model only")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per world size")
    args = parser.parse_args(argv)
    sizes = [args.values] + ([args.small] if args.small else [])
    cfg = {"sizes": sizes, "repeat": args.repeat, "warmup": args.warmup, "compression": args.compression,
           "piece_values": args.piece_values}
    measured: list[dict] = []
    if not args.no_measure:
        for world in args.worlds:
            measured += measure(world, cfg, args.timeout)
    model = model_rows(args.worlds, sizes, args.delays_ms, args.mbps, args.piece_values, args.compression)
    print(table(measured, model, args.mbps))
    report = {"bench": "reduce_shapes", "config": {**cfg, "worlds": args.worlds, "delays_ms": args.delays_ms,
                                                   "mbps": args.mbps, "cores": os.cpu_count()},
              "measured": measured, "modelled": model}
    sys.stdout.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        main()
