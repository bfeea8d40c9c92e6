"""Hosting the global store: `zb store`, or a worker told to host it (elastic.host_store)."""

from __future__ import annotations

import logging
import socket
from typing import Callable

from zb.elastic.tcpstore import host, is_public
from zb.stop_signals import StopSignals

log = logging.getLogger("zb.elastic")


def worker_address(bind: str) -> str:
    """The address workers should use: the bound one, or this host's name for a wildcard bind."""
    return socket.gethostname() if bind in ("0.0.0.0", "::", "") else bind


def serve(bind: str, port: int, ready: Callable[[dict], None]) -> None:
    """Host the store until SIGINT/SIGTERM; `ready` gets the address info once it listens."""
    store = host(bind, port)
    addr = worker_address(bind)
    # Handlers first: whoever reads the ready line may signal at once.
    try:
        with StopSignals() as stop:
            ready({"host": bind, "port": store.port, "addr": addr, "public": is_public(bind),
                   "env": {"GLOBAL_ADDR": addr, "GLOBAL_PORT": str(store.port)}})
            stop.wait()
    finally:
        log.info("store on %s:%d stopped", bind, store.port)
        del store


def host_in_worker(bind: str, port: int):
    """A worker hosting the store itself (Prime style): returns the store; keep it alive."""
    log.warning("this node hosts the global store itself (elastic.host_store): it is a single point of "
                "failure; prefer a separate `zb store` process")
    return host(bind, port)
