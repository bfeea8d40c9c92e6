"""`zb iperf-mesh`: bandwidth and RTT of every ordered link between nodes, before a run."""

from __future__ import annotations

import click

from zb.cli.multihost import multi_host_options, store_secret
from zb.cli.types import TEXT, FiniteFloatRange

EPILOG = """Local: zb iperf-mesh --world-size 3 (3 processes on this machine, over loopback).
Multi-host, one process per host: zb iperf-mesh --store HOST:PORT --rank R --world-size W
(rank 0 hosts the store at HOST:PORT; every host must accept TCP on its --port from the others).
Exit codes: 0 every link measured; 1 a link unreachable, a rank missing, the store unreachable or a
port in use; 2 invalid options. Machine-readable: --json (one document on stdout)."""

# Refused at parse time, so a typo cannot hold every host of the mesh: a run takes about
# 2 * (W - 1) * --duration, and past a few seconds TCP has left slow start, so ten minutes per
# measurement is already far more than a bandwidth needs.
MAX_DURATION_S = 600
# Each stream is a socket and a thread at both ends (ulimit -n is often 1024); iperf3 caps -P at
# 128 too, and DiLoCo never opens more than streams x local ranks.
MAX_PARALLEL = 128


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}, epilog=EPILOG)
@multi_host_options("Ranks: local processes to spawn, or the number of hosts in the multi-host run (a mesh has "
                    "links: at least 2).", min_world=2)
@click.option("--duration", type=FiniteFloatRange(min=0, min_open=True, max=MAX_DURATION_S), default=3.0,
              show_default=True, help=f"Seconds each sender streams per measurement (at most {MAX_DURATION_S}).")
@click.option("--parallel", "-P", type=click.IntRange(min=1, max=MAX_PARALLEL), default=1, show_default=True,
              help=f"TCP connections per measurement (like iperf -P, at most {MAX_PARALLEL}); DiLoCo uses one per "
                   "stream and local rank.")
@click.option("--serial", is_flag=True,
              help="One ordered pair at a time across the whole mesh (slower; no shared bottleneck between "
                   "measurements). Default: rounds of disjoint pairs.")
@click.option("--bind", type=TEXT, default="0.0.0.0", show_default=True, help="Address this rank's server listens on.")
@click.option("--port", type=click.IntRange(min=1, max=65535), default=None,
              help="Port this rank's server listens on (default: a free one). Local mode: rank r uses PORT + r.")
@click.option("--advertise", type=TEXT, default=None, metavar="ADDR[:PORT]",
              help="Address (and port, e.g. a NAT port forward) peers should dial "
                   "[default: --bind if one address, else this host's address on the route to the store].")
@click.option("--timeout", type=FiniteFloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds to wait for the store, for a rank at a barrier, or for a silent socket.")
@click.option("--connect-timeout", type=FiniteFloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds a sender waits for a TCP connection before calling the link unreachable.")
@click.option("--node-id", "uid", type=TEXT, default=None, envvar="GLOBAL_UNIQUE_ID", show_envvar=True,
              help="With --store: this host's unique id in the training run, written into the JSON's `nodes`, so "
                   "elastic.link_matrix finds its row by id (without it, by address).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def iperf_mesh(world_size: int, store: str | None, rank: int | None, secret_file: str | None, duration: float,
               parallel: int, serial: bool,
               bind: str, port: int | None, advertise: str | None, timeout: float, connect_timeout: float,
               uid: str | None, as_json: bool) -> None:
    """Measure TCP bandwidth (Mbit/s, timed by the receiver) and round-trip time between every ordered
    pair of nodes, to find slow or asymmetric links and unreachable peers before a run.

    Each rank listens on a TCP port and publishes it in the store; pairs are measured in rounds in which
    no node takes part in two measurements, each direction in turn. Every rank prints the whole matrix.
    """
    from zb.cli.terminal import print_json, stderr
    from zb.net.iperf import MeshConfig, failed_links, parse_host_port

    _check_addresses(store, advertise, parse_host_port)
    cfg = MeshConfig(duration_s=duration, parallel=parallel, serial=serial, timeout_s=timeout,
                     connect_timeout_s=connect_timeout, bind=bind, port=port or 0, advertise=advertise,
                     uid=uid if store is not None else None, secret=store_secret(store, secret_file))
    with _Progress(world_size) as progress:
        report = _run(world_size, store, rank, cfg, progress.on_link)
    if as_json:
        print_json(report)
    else:
        stderr.print(matrix_table(report))
        for line in summary_lines(report):
            stderr.print(line, markup=False)
    _fail_on_unreachable(report, failed_links)


def _check_addresses(store: str | None, advertise: str | None, parse_host_port) -> None:
    from zb.errors import InvalidInput

    try:
        if store is not None:
            parse_host_port(store, "--store")
        if advertise and ":" in advertise:
            parse_host_port(advertise, "--advertise")
    except ValueError as e:
        raise InvalidInput(str(e)) from e


def _run(world_size: int, store: str | None, rank: int | None, cfg, on_link) -> dict:
    from zb.errors import InvalidInput
    from zb.net.iperf import run_rank, spawn_local

    if store is None:
        if rank is not None:
            raise InvalidInput("--rank needs --store HOST:PORT")
        if cfg.port and cfg.port + world_size - 1 > 65535:
            raise InvalidInput(f"--port {cfg.port}: local rank r listens on PORT + r, past 65535 here")
        from zb.collectives.bench import free_port

        return spawn_local(world_size, cfg, free_port(), on_link)
    if rank is None or rank >= world_size:
        raise InvalidInput(f"--store needs --rank R with 0 <= R < --world-size ({world_size})")
    return run_rank(store, rank, world_size, cfg, on_link)


def _fail_on_unreachable(report: dict, failed_links) -> None:
    from zb.errors import EnvironmentFailure

    failed = failed_links(report)
    if failed:
        pairs = ", ".join(f"{link['src']} -> {link['dst']}" for link in failed)
        raise EnvironmentFailure(f"unreachable (sender -> receiver): {pairs} ({failed[0]['error']}); "
                                 "check firewalls and NAT between these hosts, or --advertise")


class _Progress:
    """One plain line per measurement in logs; a progress bar when a human watches stderr."""

    def __init__(self, world_size: int) -> None:
        from zb.cli.terminal import interactive

        self.total = world_size * (world_size - 1)
        self.bar = None
        if interactive() and self.total:
            from zb.cli.terminal import stderr
            from zb.progress import count_bar

            self.bar = count_bar(console=stderr)
            self.task = self.bar.add_task("measuring links", total=self.total)

    def __enter__(self) -> _Progress:
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()

    def on_link(self, phase, link: dict) -> None:
        from zb.cli.terminal import stderr

        line = f"{phase.label}: {describe_link(link)}"
        if self.bar:
            self.bar.update(self.task, advance=1, description=line)
        else:
            stderr.print(line, markup=False)


def describe_link(link: dict) -> str:
    head = f"{link['src']} -> {link['dst']}"
    if link["error"]:
        return f"{head} unreachable ({link['error']})"
    return f"{head} {link['mbps']:.1f} Mbit/s, rtt {link['rtt_ms']:.2f} ms"


def matrix_table(report: dict):
    from rich.table import Table

    world = report["world_size"]
    errors = {(link["src"], link["dst"]) for link in report["links"] if link["error"]}
    mode = "one pair at a time" if report.get("serial") else "disjoint pairs at a time"
    table = Table(title=f"TCP Mbit/s, sender (row) -> receiver (column); {report['duration_s']:g} s, "
                        f"{report['parallel']} connection(s), {mode}")
    table.add_column("from \\ to", justify="right")
    for dst in range(world):
        table.add_column(f"{dst} {report['hosts'][str(dst)]}", justify="right")
    for src in range(world):
        cells = []
        for dst in range(world):
            mbps = report["matrix_mbps"][src][dst]
            cells.append("—" if src == dst else "unreachable" if (src, dst) in errors or mbps is None
                         else f"{mbps:,.1f}")
        table.add_row(str(src), *cells)
    return table


def summary_lines(report: dict) -> list[str]:
    from zb.net.summary import most_asymmetric_pair, rtt_per_pair, slowest_link

    lines = []
    slow = slowest_link(report)
    if slow:
        lines.append(f"slowest link: {slow['src']} -> {slow['dst']} {slow['mbps']:.1f} Mbit/s")
    skew = most_asymmetric_pair(report)
    if skew:
        fast, slower, ratio = skew
        lines.append(f"most asymmetric pair: {fast['src']} -> {fast['dst']} {fast['mbps']:.1f} Mbit/s vs "
                     f"{slower['src']} -> {slower['dst']} {slower['mbps']:.1f} Mbit/s ({ratio:.2f}x)")
    rtts = rtt_per_pair(report)
    if rtts:
        lines.append("median rtt per pair (ms): " + ", ".join(f"{a}-{b} {ms:.2f}" for (a, b), ms in rtts.items()))
    if slow:
        lines.append(f"hint: keep diloco.min_bandwidth_mbps (ZB_DILOCO_MIN_BANDWIDTH_MBPS) at or below the "
                     f"slowest link, {slow['mbps']:.0f} Mbit/s: it bounds each transfer's deadline")
    return lines
