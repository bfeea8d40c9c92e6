"""Hosting the global store: `zb store`, or a worker told to host it (elastic.host_store)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zb.addresses import StoreAddress
from zb.elastic.tcpstore import NotHostable, host, is_loopback, is_public
from zb.errors import EnvironmentFailure
from zb.signed_store import declare
from zb.stop_signals import StopSignals

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger("zb.elastic")


def worker_address(bind: str) -> str:
    """The address workers should use: the bound one, or this host's name for a wildcard bind."""
    return socket.gethostname() if bind in ("0.0.0.0", "::", "") else bind


def serve(bind: str, port: int, ready: Callable[[dict[str, Any]], None], secret: bytes | None = None) -> None:
    """Host the store until SIGINT/SIGTERM; `ready` gets the address info once it listens. With the run's
    `secret`, the store holds the run marker from the start (zb.signed_store): only nodes with the secret join."""
    store = host(bind, port)
    addr = worker_address(bind)
    if secret is not None:
        declare(store, secret, f"{addr}:{store.port}")
    # Handlers first: whoever reads the ready line may signal at once.
    try:
        with StopSignals() as stop:
            ready({"host": bind, "port": store.port, "addr": addr, "public": is_public(bind),
                   "loopback": is_loopback(bind), "secret": secret is not None,
                   "env": {"GLOBAL_ADDR": addr, "GLOBAL_PORT": str(store.port)}})
            stop.wait()
    finally:
        log.info("store on %s:%d stopped", bind, store.port)
        del store


def host_in_worker(addresses: list[StoreAddress]) -> TCPStore:
    """A worker hosting a store of the run itself (elastic.host_store): the first entry of elastic.addr this
    machine can bind (an entry another store holds, or that names another machine, is skipped), so with a
    list a node can host a standby for the run to fail over to. Returns the store; keep it alive."""
    for address in addresses:
        try:
            store = host(address.host, address.port)
        except NotHostable:
            continue
        if len(addresses) == 1:
            log.warning("this node hosts the global store itself (elastic.host_store): it is a single point of "
                        "failure; prefer a separate `zb store` process, or name a standby after it in elastic.addr")
        else:
            log.warning("this node hosts the store %s of elastic.addr (elastic.host_store, %d of %d)", address,
                        addresses.index(address) + 1, len(addresses))
        return store
    raise EnvironmentFailure(f"elastic.host_store: no store of elastic.addr ({', '.join(map(str, addresses))}) can be "
                             "hosted here (each one is taken, or names another machine); name a free address of "
                             "this machine in the list")
