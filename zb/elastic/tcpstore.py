"""The global TCPStore: hosting it and reading it without blocking (its clients: zb.store_clients).

torch's TCPStore blocks on `get` of a missing key until its timeout; zb never does that: readers
`check` first and treat a missing key as empty. A store host that went away makes every client
call fail at once (DistNetworkError); a restarted host starts empty and needs new clients.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from zb.dial import unresolvable
from zb.errors import EnvironmentFailure
from zb.store_clients import StoreUnreachable

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")


class NotHostable(EnvironmentFailure):
    """The address is taken (another store) or not one of this machine's: a node hosting a store of a list
    tries the next entry (zb.elastic.storehost)."""


def store_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "the store is unreachable or too slow" (not a bug)."""
    import torch.distributed as dist

    return (dist.DistError, OSError, TimeoutError, StoreUnreachable)


def host(addr: str, port: int) -> TCPStore:
    """Host a store at addr:port in this process (libuv backend); one clear error when it cannot bind.

    torch's TCPStore listens on every interface whatever host it is given (the host is only what
    clients dial), and the store has no authentication: so zb binds the socket to exactly `addr`
    itself and hands it over (`master_listen_fd`)."""
    import torch.distributed as dist

    sock = _listen(addr, port)
    bound_port = sock.getsockname()[1]
    try:
        return dist.TCPStore(addr, bound_port, is_master=True, use_libuv=True, wait_for_workers=False,
                             timeout=timedelta(seconds=30), master_listen_fd=sock.detach())
    except dist.DistError as e:
        raise EnvironmentFailure(f"cannot host the store on {addr}:{port}: {str(e).splitlines()[0]}") from None


def _listen(addr: str, port: int) -> socket.socket:
    """A socket listening on exactly addr:port (a plain bind first: torch's error for a taken port is
    a C++ stack dump)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise unresolvable("--host", addr, e) from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        failure = NotHostable if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL) else EnvironmentFailure
        raise failure(_bind_message(addr, port, e)) from None
    return sock


def _bind_message(addr: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {addr} is already in use (another `zb store`?); choose another with --port"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to bind {addr}:{port} (ports below 1024 need root); choose a port >= 1024"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"{addr} is not an address of this machine; use one of its interface addresses or 0.0.0.0"
    return f"cannot bind {addr}:{port}: {e.strerror}"


def is_public(addr: str) -> bool:
    """True when `addr` may be reachable from the internet (not loopback, private or link-local)."""
    try:
        ips = {str(info[4][0]) for info in socket.getaddrinfo(addr, None)}  # AF_INET(6): always a str
    except socket.gaierror:
        return False
    for ip in ips:
        parsed = ipaddress.ip_address(ip.split("%")[0])
        if parsed.is_unspecified or not (parsed.is_loopback or parsed.is_private or parsed.is_link_local):
            return True
    return False


def is_loopback(addr: str) -> bool:
    """True when every address `addr` resolves to is a loopback one (only this machine reaches it)."""
    try:
        ips = {str(info[4][0]) for info in socket.getaddrinfo(addr, None)}
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips)


def read_many(store: StoreClient, keys: Sequence[str]) -> list[bytes]:
    """Values of `keys` in one round trip when all exist; missing keys read as b"" (never blocks)."""
    if not keys:
        return []
    if store.check(list(keys)):
        return list(store.multi_get(list(keys)))
    return [store.get(k) if store.check([k]) else b"" for k in keys]


def read_lines(store: StoreClient, key: str) -> list[str]:
    """The entries of an append-only list key (see zb.elastic.keys)."""
    raw = read_many(store, [key])[0]
    return [line for line in raw.decode().split("\n") if line]


def reset_if_junk(store: StoreClient, key: str) -> None:
    """Delete the counter `key` when it holds no integer: anyone who reaches the store can overwrite a counter, and
    the store drops the connection of every `add` to such a value (the counter starts over; a counter is a
    liveness or wake-up signal, never a decision: zb.elastic.keys). Two round trips: for a client just made
    (after a failure), not before every `add`."""
    raw = read_many(store, [key])[0]
    if raw and not _is_integer(raw):
        log.warning("counter %s held %r, which is no integer (someone wrote it): starting it over", key, raw[:32])
        store.delete_key(key)


def bump(store: StoreClient, key: str, amount: int) -> int:
    """`add` to the counter `key` after `reset_if_junk`."""
    reset_if_junk(store, key)
    return store.add(key, amount)


def _is_integer(raw: bytes) -> bool:
    text = raw.strip()
    return 0 < len(text) <= 19 and text.lstrip(b"-").isdigit()
