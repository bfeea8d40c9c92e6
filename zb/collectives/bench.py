"""`zb bench-allreduce`: time all_reduce per compression, against an exact fp32 all-reduce.

One process per rank. run_rank() is the body of every rank (local spawn or real multi-host);
spawn_local() starts W ranks on this machine through the same CLI and returns rank 0's report.
Compressions are interleaved iteration by iteration, so machine noise hits them alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zb.collectives import all_reduce
from zb.collectives.allreduce import pick_shape
from zb.collectives.kernels import SCHEMES
from zb.errors import EnvironmentFailure
from zb.process_exit import uses_gloo
from zb.signed_store import prefixed


@dataclass
class BenchConfig:
    size_mb: float = 64.0  # fp32 megabytes (1e6 bytes) per rank
    compressions: list[str] = field(default_factory=lambda: ["none", "int8"])
    streams: int = 1
    iterations: int = 5
    warmup: int = 1
    threads: int = 0  # 0: leave torch's default
    data: str = "student_t"  # or gaussian
    min_bandwidth_mbps: float = 10.0
    timeout_s: float = 300.0  # the groups' timeout: a collective that stalls longer fails
    rendezvous_timeout_s: float = 60.0  # to reach the store and for every rank to arrive
    shape: str = "auto"  # the int8/int4/int2 all-reduce's shape (diloco.reduce_shape: auto, ring, halving)


def free_port() -> int:
    """A TCP port free on this host right now (for a local store)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous(store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
    """Every rank checks in before any group is built: building a gloo group waits for a missing rank
    for the groups' whole timeout (300 s), and then does not say which rank was missing."""
    keys = [f"bench/arrived/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        store.set(keys[rank], b"1")  # type: ignore[arg-type]  # the binding takes bytes too; the stub says str
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
                who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(missing)}"
                raise EnvironmentFailure(f"{who} did not arrive within {timeout_s:g} s; start every rank with the "
                                         "same --store and --world-size, or raise --timeout")
            time.sleep(0.05)
    except dist.DistError as e:
        raise EnvironmentFailure(f"lost the store ({str(e).splitlines()[0]}); rank 0 hosts it: did it exit?") from None


def make_group(store: dist.Store, prefix: str, rank: int, world: int, timeout: timedelta) -> Any:
    """A bare ProcessGroupGloo, bound to GLOO_SOCKET_IFNAME when set (needed across namespaces). Typed
    Any: torch types it as a Backend, and it serves as a process group here."""
    uses_gloo()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return dist.ProcessGroupGloo(prefixed(store, prefix), rank, world, timeout)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub calls it Options
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])]
    return dist.ProcessGroupGloo(prefixed(store, prefix), rank, world, opts)


def _input(cfg: BenchConfig, rank: int) -> torch.Tensor:
    n = max(1, int(cfg.size_mb * 1e6) // 4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g)
    if cfg.data == "student_t":  # df = 3: z / sqrt(chi2_3 / 3), a heavy-tailed pseudo-gradient stand-in
        chi2 = torch.randn(3, n, generator=g).square_().sum(0)
        x.div_(chi2.div_(3).sqrt_()).mul_(1e-3)
    return x


def _gather_floats(pg: dist.ProcessGroup, values: list[float]) -> torch.Tensor:
    """[world, len(values)] float64 from every rank (gloo allgather on a bare group)."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(pg.size())]
    pg.allgather([out], [mine]).wait()
    return torch.stack(out)


def _timed(pg: dist.ProcessGroup, streams: list, x: torch.Tensor, work: torch.Tensor, comp: str,
           cfg: BenchConfig):
    work.copy_(x)
    pg.barrier().wait()
    t0 = time.perf_counter()
    stats = all_reduce(work, pg, op=dist.ReduceOp.SUM, compression=comp, streams=streams,
                       min_bandwidth_mbps=cfg.min_bandwidth_mbps, start_timeout_s=cfg.timeout_s,
                       shape=cfg.shape if comp in SCHEMES else "auto")
    return time.perf_counter() - t0, stats


def run_rank(store: dist.Store, rank: int, world: int, cfg: BenchConfig) -> dict | None:
    """Body of one rank; returns the report on rank 0, None elsewhere."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    _rendezvous(store, rank, world, cfg.rendezvous_timeout_s)
    timeout = timedelta(seconds=cfg.timeout_s)
    groups = [make_group(store, f"bench_{s}", rank, world, timeout) for s in range(max(1, cfg.streams))]
    pg, streams = groups[0], groups[1:]
    quantized = any(c != "none" for c in cfg.compressions)
    if quantized:
        from zb.collectives.build import use_cpp

        use_cpp()  # build or load the kernels now, not inside the first timed run
    x = _input(cfg, rank)
    exact, work = x.clone(), torch.empty_like(x)
    all_reduce(exact, pg, compression="none")  # the reference: gloo's fp32 sum
    times: dict[str, list[float]] = {c: [] for c in cfg.compressions}
    wire: dict[str, int] = {}
    for it in range(cfg.warmup + cfg.iterations):
        for comp in cfg.compressions:
            seconds, stats = _timed(pg, streams, x, work, comp, cfg)
            wire[comp] = stats.wire_bytes
            if it >= cfg.warmup:
                times[comp].append(float(_gather_floats(pg, [seconds]).max()))  # the slowest rank counts
    rows = {}
    for comp in cfg.compressions:
        _, _ = _timed(pg, streams, x, work, comp, cfg)  # one more run: check its result
        err = float((work.double() - exact.double()).norm() / exact.double().norm().clamp(min=1e-30))
        crc = zlib.crc32(work.numpy().view("uint8").data)
        crcs = _gather_floats(pg, [float(crc)])[:, 0]
        rows[comp] = _row(times[comp], x, world, wire[comp], err, bool((crcs == crcs[0]).all()))
    pg.barrier().wait()
    if rank != 0:
        return None
    from zb.collectives.build import use_cpp

    return {"world_size": world, "numel": x.numel(), "bytes": 4 * x.numel(), "threads": torch.get_num_threads(),
            "shape": pick_shape(cfg.shape, "int8", world),
            "cpp_kernels": use_cpp() if quantized else None, "config": asdict(cfg),
            "results": rows}


def _row(times: list[float], x: torch.Tensor, world: int, wire: int, err: float, same: bool) -> dict:
    median = statistics.median(times)
    algbw = 4 * x.numel() / median / 1e9
    return {"median_s": median, "times_s": times, "algbw_gbps": algbw,
            "busbw_gbps": algbw * 2 * (world - 1) / world, "wire_bytes": wire, "rel_error": err,
            "bit_identical": same}


def _cli_args(cfg: BenchConfig, world: int) -> list[str]:
    return ["--size-mb", str(cfg.size_mb), "--compressions", ",".join(cfg.compressions),
            "--streams", str(cfg.streams), "--iterations", str(cfg.iterations), "--warmup", str(cfg.warmup),
            "--threads", str(cfg.threads or max(1, (os.cpu_count() or 1) // world)), "--data", cfg.data,
            "--min-bandwidth-mbps", str(cfg.min_bandwidth_mbps), "--timeout", repr(cfg.rendezvous_timeout_s),
            "--shape", cfg.shape, "--json"]


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of every process, each waited for up to `timeout`; whatever is left is killed, also when
    a wait fails (scripts/bench_reduce_shapes.py and scripts/bench_netns_iperf.py launch ranks this way too)."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _collect(procs: list[subprocess.Popen], timeout: float) -> dict:
    """Wait for every rank; rank 0's stdout is the report. Kills leftovers on any failure."""
    outs = communicate_all(procs, timeout)
    failed = [(r, p.returncode, e) for r, (p, (_, e)) in enumerate(zip(procs, outs)) if p.returncode != 0]
    if failed:
        r, code, err = failed[0]
        raise EnvironmentFailure(f"bench rank {r} exited with {code}: {' '.join(err.strip().splitlines()[-1:])}")
    return json.loads(outs[0][0])


def spawn_on(launchers: list, store_addr: str, port: int, cfg: BenchConfig,
             env: dict[str, str] | None = None) -> dict:
    """One rank per launcher (a callable argv -> Popen, e.g. a namespace host's popen); rank 0 hosts the store."""
    world = len(launchers)
    procs = [launch([sys.executable, "-m", "zb", "-q", "bench-allreduce", "--store", f"{store_addr}:{port}",
                     "--rank", str(r), "--world-size", str(world), *_cli_args(cfg, world)],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, launch in enumerate(launchers)]
    return _collect(procs, cfg.timeout_s * 2)


def spawn_local(world: int, cfg: BenchConfig, port: int) -> dict:
    """Run W ranks as local processes through `python -m zb bench-allreduce --store 127.0.0.1:port`."""
    # Every rank shares this host: the kernels take a share of its cores each (zb.collectives.kernels.threads).
    return spawn_on([subprocess.Popen] * world, "127.0.0.1", port, cfg,
                    env={**os.environ, "LOCAL_WORLD_SIZE": str(world)})
