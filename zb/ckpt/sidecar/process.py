"""The standalone sidecar process behind `zb ckpt-serve`: bind, optionally publish, serve until a signal."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Any

from zb.ckpt.recovery.peer import parse_peer
from zb.ckpt.sidecar.live_layout import rank_of, sidecar_id
from zb.ckpt.sidecar.publish import advertised_address, peer_addresses, publish_address, unpublish_address
from zb.ckpt.sidecar.server import MAX_CONNECTIONS, SnapshotServer, make_server
from zb.ckpt.sidecar.token import read_token
from zb.errors import InvalidInput
from zb.store_clients import publishing_client

log = logging.getLogger("zb.ckpt.serve")

STORE_CONNECT_TIMEOUT_S = 10.0


@dataclass
class Sidecar:
    server: SnapshotServer
    address: str                # advertised "host:port"
    store: Any = None
    uid: str | None = None      # the name it is published under: <node id>/r<local rank>
    key: str | None = None      # the store key it is published under
    replaced: str | None = None  # the address that key held before (the node's own sidecar's), given back at the end


def open_sidecar(root: str, host: str, port: int, token_file: str | None, store_addr: str | None,
                 uid: str | None, advertise: str | None, client_timeout: float,
                 connect_timeout: float = STORE_CONNECT_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 secret: bytes | None = None) -> Sidecar:
    """Check the inputs, bind the port, publish the address if asked; every failure is one clear line. With the
    run `secret` the token derives from it and the address record is sealed with it (zb.signed_store)."""
    token = read_token(token_file, secret=secret)
    if store_addr is not None and not uid:
        raise InvalidInput("--publish needs a node id: pass --node-id or set GLOBAL_UNIQUE_ID")
    store_host = parse_peer(store_addr)[0] if store_addr else None
    server = make_server(root, token, host, port, client_timeout, max_connections)
    sidecar = Sidecar(server, advertised_address(host, server.server_address[1], advertise, store_host))
    if store_addr is not None:
        try:
            sidecar.store = _connect_store(store_addr, connect_timeout, secret)
            assert uid  # checked above: publishing needs a node id
            # Under the name a joiner's rank of the same number looks up, as the node's own sidecar is.
            sidecar.uid = sidecar_id(uid, rank_of(server.root))
            sidecar.replaced = peer_addresses(sidecar.store, [sidecar.uid]).get(sidecar.uid)
            sidecar.key = publish_address(sidecar.store, sidecar.uid, sidecar.address)
        except BaseException:
            server.server_close()
            raise
        assert store_host is not None  # parsed from store_addr
        if _loopback(host) and not _loopback(store_host) and advertise is None:
            log.warning("serving on %s only, but the store at %s is on another machine: joiners there cannot reach "
                        "this sidecar; pass --host 0.0.0.0 (or this machine's address)", host, store_host)
    return sidecar


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _connect_store(store_addr: str, connect_timeout: float, secret: bytes | None) -> Any:
    host, port = parse_peer(store_addr)
    return publishing_client(host, port, connect_timeout, secret, store_addr)


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def run_until_signal(sidecar: Sidecar) -> None:
    """Serve in this thread until SIGINT/SIGTERM, then unpublish and close (exit status 0)."""
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sidecar.server.serve_forever(poll_interval=0.2)
    except _Stop:
        log.info("stopping the sidecar")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if sidecar.store is not None and sidecar.uid is not None:   # open_sidecar sets both
            unpublish_address(sidecar.store, sidecar.uid, sidecar.address, sidecar.replaced)
        sidecar.server.server_close()
