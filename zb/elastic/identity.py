"""Who this node is in the run: its unique id, its incarnation token, and the duplicate-id check.

The unique id (GLOBAL_UNIQUE_ID) names the node across restarts; the token is new in every
process, so the world can tell a restarted node from the old one. A node whose id belongs to a node
with a fresh heartbeat is refused; a crashed node restarting with its old id waits until its old
counter has been silent for the heartbeat timeout, then joins as a new member.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from typing import TYPE_CHECKING

from zb.elastic import keys
from zb.elastic.tcpstore import read_lines, read_many
from zb.errors import EnvironmentFailure

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")


def new_uid() -> str:
    """A readable id for nodes started without GLOBAL_UNIQUE_ID: host name plus random suffix."""
    host = socket.gethostname().split(".")[0][:24] or "node"
    return f"{host}-{secrets.token_hex(3)}"


def new_token() -> str:
    return secrets.token_hex(6)


def ensure_unique(store: StoreClient, uid: str, heartbeat_interval: float, heartbeat_timeout: float,
                  poll: float) -> None:
    """Raise EnvironmentFailure if a live node already uses `uid`; bounded by heartbeat_timeout."""
    key = keys.heartbeat(uid)
    first = read_many(store, [key])[0]
    if not first:
        return
    # A goodbye was said by some incarnation of this id: a live one would still beat every
    # interval, so a few intervals settle it; otherwise wait out the full heartbeat timeout.
    watch = 3 * heartbeat_interval if _said_goodbye(store, uid) else heartbeat_timeout
    log.info("unique id %s was used before; checking that its old node is gone (up to %.1f s)", uid, watch)
    deadline = time.monotonic() + watch
    while time.monotonic() < deadline:
        time.sleep(min(poll, heartbeat_interval))
        if read_many(store, [key])[0] != first:
            raise EnvironmentFailure(f"unique id {uid!r} belongs to a live node (its heartbeat is fresh); give this "
                                     "node another GLOBAL_UNIQUE_ID (elastic.unique_id) or leave it unset")
    log.info("unique id %s: the old node is silent, joining as a new member", uid)


def _said_goodbye(store: StoreClient, uid: str) -> bool:
    """True when some incarnation of `uid` sent a deathrattle (tokens are unknown here)."""
    return any(line.split(" ")[0] == uid for line in read_lines(store, keys.GONE))
