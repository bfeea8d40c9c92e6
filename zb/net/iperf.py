"""`zb iperf-mesh`: TCP bandwidth and RTT between every ordered pair of nodes, before a run.

Run: `zb iperf-mesh --world-size 3` (3 local processes) or, one process per host,
`zb iperf-mesh --store HOST:PORT --rank R --world-size W` (rank 0 hosts a torch TCPStore there).

run_rank() is the body of every rank. Ranks meet through the store only: each publishes the
address of its own listening socket under iperf/host/<rank>, then all walk the same schedule
(zb/net/schedule.py), phase by phase, with a store barrier between phases. Within a phase each
receiver times its sender (zb/net/link.py) and writes the result as JSON under iperf/result/;
after the barrier every rank reads the phase's results, so every rank ends with the whole mesh.
Barriers have deadlines: a rank that never comes or dies is named instead of waited for.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zb.errors import EnvironmentFailure
from zb.net.link import LinkError, LinkServer, receive, send
from zb.net.schedule import Phase, mesh_phases
from zb.store_clients import rank_client

PREFIX = "iperf/"
POLL_S = 0.05
ABORT_GRACE_S = 1.0  # rank 0 keeps the store up this long after a failure, so the others read why


@dataclass
class MeshConfig:
    duration_s: float = 3.0
    parallel: int = 1  # TCP connections per measurement, like iperf -P
    serial: bool = False  # one ordered pair at a time across the whole mesh
    pings: int = 10
    timeout_s: float = 60.0  # store connection, barriers, a silent socket
    connect_timeout_s: float = 5.0
    bind: str = "0.0.0.0"
    port: int = 0  # 0: a free port
    advertise: str | None = None  # ADDR or ADDR:PORT peers should dial; None: found from the store route
    uid: str | None = None  # the run's unique id of this host, so elastic.link_matrix can name its row
    secret: bytes | None = field(default=None, repr=False)  # --secret-file: the store's records are sealed with it


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); ValueError naming `what` when malformed."""
    if "," in text:   # a run's failover list (elastic.addr) names stores this command does not fail over along
        raise ValueError(f"{what} {text!r}: one HOST:PORT here (the command's own meeting point; a list of stores "
                         "is for zb train and zb status)")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r}: expected HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port)


def advertised_address(cfg: MeshConfig, store_host: str, port: int) -> tuple[str, int]:
    """Where peers should connect: --advertise, else --bind when it is one address, else the local
    address of the interface that routes to the store host (a UDP connect() sends no packet)."""
    if cfg.advertise:
        if ":" in cfg.advertise:
            return parse_host_port(cfg.advertise, "--advertise")
        return cfg.advertise, port
    if cfg.bind not in ("0.0.0.0", ""):
        return cfg.bind, port
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((store_host, 9))
            return probe.getsockname()[0], port
        except OSError as e:
            raise EnvironmentFailure(f"no route to the store host {store_host} ({e.strerror or e}); "
                                     "pass --advertise ADDR") from e


class Mesh:
    """This rank's view of the store: barriers with deadlines, published addresses, results."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, store_addr: str) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.store_addr = store_addr

    def _lost(self, e: Exception) -> EnvironmentFailure:
        return EnvironmentFailure(f"lost the store at {self.store_addr} ({str(e).splitlines()[0]}); "
                                  "rank 0 hosts it: did it exit or fail?")

    def set(self, key: str, value: dict) -> None:
        try:
            self.store.set(PREFIX + key, json.dumps(value))
        except RuntimeError as e:
            raise self._lost(e) from e

    def get(self, key: str) -> dict:
        try:
            return json.loads(self.store.get(PREFIX + key))
        except RuntimeError as e:
            raise self._lost(e) from e

    def peek(self, key: str) -> dict | None:
        """The value if some rank has set it already, else None (never blocks)."""
        try:
            return json.loads(self.store.get(PREFIX + key)) if self.store.check([PREFIX + key]) else None
        except RuntimeError as e:
            raise self._lost(e) from e

    def arrive(self, name: str) -> None:
        self.set(f"barrier/{name}/{self.rank}", {})

    def wait_all(self, name: str, what: str, timeout_s: float) -> None:
        """Until every rank has arrived at barrier `name`; else one line naming the missing ranks.

        The first rank to give up publishes its reason under `abort`: the others stop waiting and
        say the same, instead of timing out one by one (or finding the store gone with rank 0).
        """
        keys = [f"{PREFIX}barrier/{name}/{r}" for r in range(self.world)]
        deadline = time.monotonic() + timeout_s
        try:
            while not self.store.check(keys):
                aborted = self.peek("abort")
                if aborted:
                    raise EnvironmentFailure(aborted["error"])
                if time.monotonic() > deadline:
                    missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                    if not missing:
                        return
                    who = "rank " if len(missing) == 1 else "ranks "
                    error = (f"{who}{', '.join(map(str, missing))} did not reach {what} within {timeout_s:g} s; "
                             "is it running, with the same --store and --world-size, and still alive?")
                    self.set("abort", {"error": error})
                    raise EnvironmentFailure(error)
                time.sleep(POLL_S)
        except RuntimeError as e:
            raise self._lost(e) from e

    def barrier(self, name: str, what: str, timeout_s: float | None = None) -> None:
        self.arrive(name)
        self.wait_all(name, what, self.timeout_s if timeout_s is None else timeout_s)


def run_rank(store_addr: str, rank: int, world: int, cfg: MeshConfig,
             on_link: Callable[[Phase, dict], None] | None = None) -> dict:
    """Body of one rank; every rank returns the whole report."""
    store_host, store_port = parse_host_port(store_addr, "--store")
    server = LinkServer(cfg.bind, cfg.port)  # first: a busy --port fails before any waiting
    mesh = None
    try:
        mesh = Mesh(rank_client(store_host, store_port, rank, world, cfg.timeout_s, secret=cfg.secret), rank, world,
                    cfg.timeout_s, store_addr)
        addr, port = advertised_address(cfg, store_host, server.port)
        mesh.set(f"host/{rank}", {"addr": addr, "port": port, "node": cfg.uid})
        mesh.barrier("start", "the start")
        hosts = {r: mesh.get(f"host/{r}") for r in range(world)}
        links = _measure(mesh, server, hosts, cfg, on_link)
        if rank == 0:
            # Rank 0 hosts the store: it leaves last, once everyone has read every result.
            mesh.barrier("end", "the end")
        else:
            mesh.arrive("end")
    except EnvironmentFailure:
        if rank == 0 and mesh is not None:
            time.sleep(ABORT_GRACE_S)
        raise
    finally:
        server.close()
    return build_report(world, cfg, hosts, links)


def _measure(mesh: Mesh, server: LinkServer, hosts: dict[int, dict], cfg: MeshConfig,
             on_link: Callable[[Phase, dict], None] | None) -> list[dict]:
    # A phase lasts a connect, the pings, --duration and the drain of the socket buffers.
    phase_timeout = cfg.timeout_s + cfg.connect_timeout_s + 2 * cfg.duration_s
    wait_s = cfg.connect_timeout_s + 10.0
    links = []
    for tag, phase in enumerate(mesh_phases(mesh.world, cfg.serial)):
        for src, dst in phase.pairs:
            if mesh.rank == src:
                _send_one(mesh, hosts[dst], src, dst, tag, cfg)
            elif mesh.rank == dst:
                def sender_error(s: int = src, d: int = dst) -> str | None:
                    return _sender_error(mesh, s, d)

                result = receive(server, src, dst, tag, streams=cfg.parallel, pings=cfg.pings, wait_s=wait_s,
                                 io_timeout_s=cfg.timeout_s, sender_error=sender_error)
                mesh.set(f"result/{src}-{dst}", result.to_json())
        mesh.barrier(f"phase/{tag}", f"{phase.label} (phase {tag + 1})", phase_timeout)
        for src, dst in phase.pairs:
            link = mesh.get(f"result/{src}-{dst}")
            links.append(link)
            if on_link:
                on_link(phase, link)
    return links


def _send_one(mesh: Mesh, host: dict, src: int, dst: int, tag: int, cfg: MeshConfig) -> None:
    try:
        send(host["addr"], host["port"], src, dst, tag, streams=cfg.parallel, pings=cfg.pings,
             duration_s=cfg.duration_s, connect_timeout_s=cfg.connect_timeout_s, io_timeout_s=cfg.timeout_s)
    except LinkError as e:
        mesh.set(f"senderr/{src}-{dst}", {"error": str(e)})  # the receiver records it as the result


def _sender_error(mesh: Mesh, src: int, dst: int) -> str | None:
    found = mesh.peek(f"senderr/{src}-{dst}")
    return found["error"] if found else None


def build_report(world: int, cfg: MeshConfig, hosts: dict[int, dict], links: list[dict]) -> dict:
    links = sorted(links, key=lambda link: (link["src"], link["dst"]))
    matrix: list[list[float | None]] = [[None] * world for _ in range(world)]
    for link in links:
        matrix[link["src"]][link["dst"]] = link["mbps"]
    return {"world_size": world, "duration_s": cfg.duration_s, "parallel": cfg.parallel, "serial": cfg.serial,
            "hosts": {str(r): f"{h['addr']}:{h['port']}" for r, h in sorted(hosts.items())},
            "nodes": {str(r): h["node"] for r, h in sorted(hosts.items()) if h.get("node")},
            "links": links, "matrix_mbps": matrix}


def failed_links(report: dict) -> list[dict]:
    return [link for link in report["links"] if link["error"]]


def _cli_args(cfg: MeshConfig, rank: int) -> list[str]:
    args = ["--duration", repr(cfg.duration_s), "--parallel", str(cfg.parallel), "--timeout", repr(cfg.timeout_s),
            "--connect-timeout", repr(cfg.connect_timeout_s), "--bind", cfg.bind, "--json"]
    if cfg.port:
        args += ["--port", str(cfg.port + rank)]
    if cfg.advertise:
        args += ["--advertise", cfg.advertise]
    return args + (["--serial"] if cfg.serial else [])


def spawn_local(world: int, cfg: MeshConfig, store_port: int,
                on_link: Callable[[Phase, dict], None] | None = None) -> dict:
    """W ranks on this machine: this process is rank 0 (it hosts the store and shows progress),
    ranks 1..W-1 run `python -m zb iperf-mesh --store 127.0.0.1:PORT --rank R` as child processes.
    With cfg.port, rank r listens on port + r."""
    store_addr = f"127.0.0.1:{store_port}"
    children = [subprocess.Popen([sys.executable, "-m", "zb", "-q", "iperf-mesh", "--store", store_addr,
                                  "--rank", str(r), "--world-size", str(world), *_cli_args(cfg, r)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
                for r in range(1, world)]
    try:
        report = run_rank(store_addr, 0, world, cfg, on_link)
    except EnvironmentFailure as e:
        said = _children_said(_reap(children))
        raise EnvironmentFailure(f"{e}{' (' + said + ')' if said else ''}") from e
    except BaseException:
        _reap(children, grace_s=0)
        raise
    _reap(children)
    return report


def _reap(children: list[subprocess.Popen], grace_s: float = 10.0) -> list[tuple[int | None, str]]:
    """Wait for the children (they leave right after rank 0's end barrier), kill stragglers;
    returns (exit code, stderr) per child."""
    out = []
    for child in children:
        try:
            _, err = child.communicate(timeout=grace_s) if grace_s else ("", "")
        except subprocess.TimeoutExpired:
            err = ""
        if child.poll() is None:
            child.kill()
            err = (err or "") + (child.communicate()[1] or "")
        out.append((child.returncode, err or ""))
    return out


def _children_said(outcomes: list[tuple[int | None, str]]) -> str:
    """The first error line of each child that failed, to say why rank 0 waited in vain."""
    said = []
    for r, (code, err) in enumerate(outcomes, start=1):
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        if code not in (0, None) and lines:
            said.append(f"rank {r}: {lines[0]}")
    return "; ".join(said)
