"""Where peers find a node's sidecar: its address under `ckpt_serve/<node id>` in the global store.

The functions take any store client with set/get/check/delete_key (torch.distributed.TCPStore, a
PrefixStore), so the training loop and `zb ckpt-serve --publish` share them. The token never goes
into the store: whoever can reach the store could read it.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

log = logging.getLogger("zb.ckpt.serve")

KEY_PREFIX = "ckpt_serve/"
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def address_key(uid: str) -> str:
    return f"{KEY_PREFIX}{uid}"


def publish_address(store: Any, uid: str, address: str) -> str:
    """Write this node's sidecar address ("host:port"); returns the key."""
    key = address_key(uid)
    store.set(key, address)
    return key


def unpublish_address(store: Any, uid: str, address: str | None = None, replaced: str | None = None) -> None:
    """Remove the address; with `address` (ours), only while the key still holds it, and giving it back to
    the address ours `replaced`: `zb ckpt-serve` on a live node's directory publishes under the node's own
    sidecar's name, and must not leave the node unfindable when it stops. Best effort: a store that is
    already gone is fine at shutdown."""
    key = address_key(uid)
    try:
        if address is not None and peer_addresses(store, [uid]).get(uid) != address:
            return   # published again since ours: that one stays
        if replaced is not None:
            store.set(key, replaced)
        else:
            store.delete_key(key)
    except Exception as e:  # noqa: BLE001 - any store failure here only means there is nothing to clean
        log.debug("could not remove %s from the store: %s", key, e)


def peer_addresses(store: Any, uids: list[str]) -> dict[str, str]:
    """{node id: address} of the nodes that published one (without blocking on the others)."""
    found = {}
    for uid in uids:
        key = address_key(uid)
        if store.check([key]):
            found[uid] = store.get(key).decode()
    return found


def advertised_host(bind_host: str, toward: str | None = None) -> str:
    """The address peers should use: the bind address, or for a wildcard bind the local address of
    the interface that routes to `toward` (the store host), found with a UDP connect (no packet sent)."""
    if bind_host not in _WILDCARDS:
        return bind_host
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((toward, 9))
                return s.getsockname()[0]
        except OSError as e:
            log.debug("cannot find the route to %s: %s", toward, e)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def advertised_address(bind_host: str, port: int, advertise: str | None = None, toward: str | None = None) -> str:
    """"host:port" for peers: `advertise` if given (ZERO_BAND_LIVE_RECO_ADDR), else advertised_host()."""
    host = advertise or advertised_host(bind_host, toward)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
