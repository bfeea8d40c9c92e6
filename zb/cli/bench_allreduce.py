"""`zb bench-allreduce`: all-reduce time, bandwidth, wire bytes and error per compression."""

from __future__ import annotations

import click

from zb.cli.multihost import multi_host_options, store_secret
from zb.cli.types import FiniteFloatRange

EPILOG = """Local: zb bench-allreduce --world-size 3 (spawns 3 processes on this machine).
Multi-host, one process per host: zb bench-allreduce --store HOST:PORT --rank R --world-size W
(rank 0 hosts the store at HOST:PORT; set GLOO_SOCKET_IFNAME to the interface peers reach).
Kernels only: zb bench-allreduce --kernels. Machine-readable: --json (one document on stdout).
Exit codes: 0 done; 1 the store unreachable or a rank missing after --timeout (60 s by default), or a
rank failed; 2 invalid options."""


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}, epilog=EPILOG)
@multi_host_options("Ranks: local processes to spawn, or the size of the multi-host run.")
@click.option("--size-mb", type=FiniteFloatRange(min=1e-6), default=64.0, show_default=True,
              help="fp32 tensor size per rank (or per kernel call with --kernels), in MB (1e6 bytes).")
@click.option("--compressions", default="none,int8", show_default=True,
              help="Comma-separated compressions to compare: none (fp32), int8, int4, int2, sparse (the top 64 of every "
                   "4096 values at 2 bits, diloco.sparse_k and sparse_chunk's defaults, gathered by every rank; its error "
                   "is one call's, where training sends the rest later through error feedback).")
@click.option("--streams", type=click.IntRange(min=1), default=1, show_default=True,
              help="Process groups to stripe over (parallel TCP connections); config twin: ZB_DILOCO_STREAMS.")
@click.option("--shape", type=click.Choice(["auto", "ring", "halving"]), default="auto", show_default=True,
              help="Shape of the int8/int4/int2 all-reduce: the ring, recursive halving-doubling, or auto (halving at "
                   "4, 8, 16 ... ranks); config twin: diloco.reduce_shape.")
@click.option("--iterations", type=click.IntRange(min=1), default=5, show_default=True, help="Timed runs per compression.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed runs first.")
@click.option("--threads", type=click.IntRange(min=0), default=0,
              help="Torch threads per rank (0: cores / local ranks when spawning, else torch's default).")
@click.option("--data", type=click.Choice(["student_t", "gaussian"]), default="student_t", show_default=True,
              help="Input values: heavy-tailed Student-t (df=3, like pseudo-gradients) or Gaussian.")
@click.option("--min-bandwidth-mbps", type=FiniteFloatRange(min=1e-3), default=10.0, show_default=True,
              help="Slowest link expected; bounds each transfer's deadline. Config twin: ZB_DILOCO_MIN_BANDWIDTH_MBPS.")
@click.option("--timeout", type=FiniteFloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds to wait for the store and for every rank to arrive; then exit 1 naming what is missing.")
@click.option("--kernels", "kernels_only", is_flag=True,
              help="Measure the quantization kernels of every width (vs memcpy and the PyTorch twins) instead of "
                   "the all-reduce.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def bench_allreduce(world_size: int, store: str | None, rank: int | None, secret_file: str | None, size_mb: float,
                    compressions: str, shape: str,
                    streams: int, iterations: int, warmup: int, threads: int, data: str,
                    min_bandwidth_mbps: float, timeout: float, kernels_only: bool, as_json: bool) -> None:
    """Benchmark all_reduce: median time, algorithm and bus bandwidth, wire bytes, error, agreement.

    Uses the C++ kernels unless ZB_USE_CPP=0 (PyTorch twins).
    """
    from zb.cli.terminal import print_json, stderr
    from zb.collectives.bench import BenchConfig
    from zb.errors import InvalidInput

    comps = [c.strip() for c in compressions.split(",") if c.strip()]
    from zb.collectives import COMPRESSIONS

    if any(c not in COMPRESSIONS for c in comps) or not comps:
        raise InvalidInput(f"--compressions {compressions!r}: use a comma-separated subset of {','.join(COMPRESSIONS)}")
    if kernels_only:
        report = _kernels(threads, max(256, int(size_mb * 1e6) // 4))
        print_json(report) if as_json else stderr.print(kernels_table(report))
        return
    cfg = BenchConfig(size_mb=size_mb, compressions=comps, streams=streams, iterations=iterations,
                      warmup=warmup, threads=threads, data=data, min_bandwidth_mbps=min_bandwidth_mbps,
                      rendezvous_timeout_s=timeout, shape=shape)
    results = _run(world_size, store, rank, cfg, store_secret(store, secret_file))
    if results is None:
        return
    print_json(results) if as_json else stderr.print(results_table(results))


def _kernels(threads: int, numel: int) -> dict:
    import torch

    from zb.collectives.kernel_bench import run_kernel_bench

    if threads:
        torch.set_num_threads(threads)
    return run_kernel_bench(numel, twin_numel=min(numel, 1 << 22))


def _run(world_size: int, store: str | None, rank: int | None, cfg, secret: bytes | None) -> dict | None:
    from zb.collectives.bench import run_rank, spawn_local
    from zb.errors import InvalidInput
    from zb.store_clients import rank_client

    if store is None:
        if rank is not None:
            raise InvalidInput("--rank needs --store HOST:PORT")
        from zb.collectives.bench import free_port

        return spawn_local(world_size, cfg, free_port())
    if rank is None or rank >= world_size:
        raise InvalidInput("--store needs --rank R with 0 <= R < --world-size")
    from zb.net.iperf import parse_host_port

    try:
        host, port = parse_host_port(store, "--store")
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    client = rank_client(host, port, rank, world_size, cfg.rendezvous_timeout_s, raise_hint=", or raise --timeout",
                         secret=secret)
    return run_rank(client, rank, world_size, cfg)


def results_table(report: dict):
    from rich.table import Table

    cfg = report["config"]
    title = (f"all-reduce of {report['bytes'] / 1e6:.1f} MB fp32, {report['world_size']} ranks, "
             f"{cfg['streams']} stream(s), {report['threads']} thread(s)/rank, median of {cfg['iterations']}"
             f"{', int widths as ' + report['shape'] if 'shape' in report else ''}")
    table = Table(title=title)
    for col in ("compression", "median s", "algbw GB/s", "busbw GB/s", "wire MB/rank", "rel. error", "ranks agree"):
        table.add_column(col, justify="right")
    base = report["results"].get("none", {}).get("median_s")
    for comp in cfg["compressions"]:
        r = report["results"][comp]
        speed = f" ({base / r['median_s']:.2f}x)" if base and comp != "none" else ""
        table.add_row(comp, f"{r['median_s']:.4f}{speed}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}",
                      f"{r['wire_bytes'] / 1e6:.2f}", f"{r['rel_error']:.2e}", "yes" if r["bit_identical"] else "NO")
    return table


def kernels_table(report: dict):
    from rich.table import Table

    table = Table(title=f"quantization kernels, {report['threads']} thread(s): memory traffic (read + written) "
                        f"vs memcpy {report['memcpy_gbps']:.2f} GB/s")
    for col in ("width", "kernel", "C++ GB/s", "vs memcpy", "twin GB/s", "C++ vs twin"):
        table.add_column(col, justify="right")
    for scheme, rows in report.get("schemes", {"int8": report["kernels"]}).items():
        for name, r in rows.items():
            table.add_row(scheme, name, f"{r.get('gbps', float('nan')):.2f}", f"{r.get('vs_memcpy', float('nan')):.0%}",
                          f"{r['twin_gbps']:.3f}", f"{r.get('vs_twin', float('nan')):.1f}x")
    return table
