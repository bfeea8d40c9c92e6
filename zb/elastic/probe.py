"""Peer reachability on the gloo interface, checked before a node joins.

Gloo opens a TCP connection between every pair of ranks on the address it binds to (the host name's
address, or GLOO_SOCKET_IFNAME's). A peer behind NAT or a firewall shows up as a gloo timeout long
after the fact; instead each node runs a tiny listener on that same address and a joiner connects
to every member's listener first, failing in one line that names the unreachable peer. This is a
check only: all traffic still goes through torch.distributed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from zb.errors import EnvironmentFailure

log = logging.getLogger("zb.elastic")


def gloo_address() -> str:
    """The IPv4 address gloo will use on this host (GLOO_SOCKET_IFNAME's, else the host name's)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        import psutil

        for addr in psutil.net_if_addrs().get(ifname, []):
            if addr.family == socket.AF_INET:
                return addr.address
        raise EnvironmentFailure(f"GLOO_SOCKET_IFNAME={ifname} has no IPv4 address on this host")
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ProbeListener(threading.Thread):
    """Accepts and closes connections on the gloo address, so joiners can test the path here."""

    def __init__(self, address: str | None = None) -> None:
        super().__init__(name="zb-probe", daemon=True)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((address or gloo_address(), 0))
        self._sock.listen(64)
        self._sock.settimeout(0.5)
        self._stop_event = threading.Event()

    @property
    def endpoint(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                conn, _ = self._sock.accept()
                conn.close()
            except OSError:
                continue

    def stop(self) -> None:
        self._stop_event.set()
        self._sock.close()


def dial(endpoint: str, timeout: float) -> str:
    """One connection to `endpoint` (host:port): "ok", "refused" (the host answered, nothing listens:
    the peer's process is gone) or "silent" (timeout, no route, bad address: a partition, a
    firewall, a link down, or a dead machine)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return "ok"
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError):
        return "silent"


def reachable(endpoint: str, timeout: float) -> bool:
    return dial(endpoint, timeout) == "ok"


def refuses(endpoint: str, timeout: float) -> bool:
    """True when the host answers but nothing listens there: the peer's process is gone.

    A stopped (SIGSTOP) process still accepts into its backlog and a dead machine times out, so
    only a refusal counts as evidence, and only for a peer whose heartbeat is already silent.
    """
    return dial(endpoint, timeout) == "refused"


def unreachable_peers(endpoints: dict[str, str], timeout: float) -> set[str]:
    """The peers whose probe listener this node cannot connect to within `timeout` (all probed at
    once). A refusal is not unreachability: the host answered, its process is gone, and the
    crash rules deal with it. A timeout or no route is: a partition, a firewall, a link down."""
    from concurrent.futures import ThreadPoolExecutor

    if not endpoints:
        return set()
    with ThreadPoolExecutor(len(endpoints)) as pool:
        answers = dict(zip(endpoints, pool.map(lambda e: dial(e, timeout), endpoints.values())))
    return {uid for uid, answer in answers.items() if answer == "silent"}


def check_peers(endpoints: dict[str, str], timeout: float, still_alive: Callable[[str], bool]) -> None:
    """Raise EnvironmentFailure naming the first live peer this node cannot connect to.

    A peer that does not answer but has since stopped beating (`still_alive` false) is dead, not
    unreachable, and is skipped: the leader will drop it.
    """
    for uid, endpoint in sorted(endpoints.items()):
        started = time.monotonic()
        if reachable(endpoint, timeout) or not still_alive(uid):
            continue
        raise EnvironmentFailure(f"cannot reach peer {uid} at {endpoint} on the gloo interface within "
                                 f"{time.monotonic() - started:.1f} s (NAT or firewall?); all nodes must reach "
                                 "each other directly, e.g. over a private WireGuard/Tailscale network, and "
                                 "GLOO_SOCKET_IFNAME must name that interface")
