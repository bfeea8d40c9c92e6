"""elastic.peer_filter: gloo's listener admits only the run's hosts, so a connection flood cannot take a node down.

gloo's TCP listener accepts any connection and keeps it until a peer's pair claims it by sequence number:
a junk connection is never claimed, so each one holds a file descriptor for the process's life (measured:
3,000 connect-and-reset loops left 3,000 more descriptors; 20,500 in 0.8 s ended a node with `accept: Too
many open files`, exit 134). gloo cannot authenticate a connection, and zb does not move its traffic off gloo
(a transport of its own would copy every pseudo-gradient byte once more through a proxy, and lose gloo's
tested collectives). Instead the kernel keeps junk from reaching the listener:

- Every gloo group of this process is built on one device (`device()`), so there is one listener for the
  process's life instead of a new one per mesh version (whose first seconds would be unguarded).
- `PeerFilter.admit` attaches a classic BPF program to that listening socket (SO_ATTACH_FILTER, no privilege
  needed) that drops every packet whose IPv4 source is not one of the world's members' gloo addresses (the
  addresses their probe listeners publish, zb.elastic.probe). A dropped SYN is never accepted, so an outsider's
  connections cost the node nothing; established connections are separate sockets, untouched. The list is set
  again before each new world's groups are built (a joiner's first SYN that arrives before it is retransmitted).
- `only_this_host` does the same for the listeners of torch's groups over a node's local ranks, once they are
  connected: only this host's addresses.
- `raise_descriptor_limit` lifts the soft limit on open files to the hard one (often 1,024 against 524,288), so
  what gets through (a member's own host misbehaving) meets the largest limit the system allows.

Where a member's connections leave from another address than the one it publishes (NAT between nodes, several
interfaces without GLOO_SOCKET_IFNAME) they are dropped too: the group build then times out; set
elastic.peer_filter false there. Linux only (elsewhere the setting warns once and admits every host).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("zb.elastic")

SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27
SKF_NET_OFF = -0x100000            # cBPF: offsets from the network header (the IPv4 header of a TCP packet)
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
MAX_ADDRESSES = 250                # a jump offset is one byte: at most this many addresses in one program


class _Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


def program(addresses: Iterable[str]) -> list[tuple[int, int, int, int]]:
    """The cBPF program that accepts a packet whose IPv4 source is one of `addresses` and drops the rest:
    load the source word, one equality test per address, drop, accept."""
    words = sorted({int(ipaddress.IPv4Address(a)) for a in addresses})
    if len(words) > MAX_ADDRESSES:
        raise ValueError(f"{len(words)} addresses: one filter program holds at most {MAX_ADDRESSES}")
    out = [(BPF_LD_W_ABS, 0, 0, (SKF_NET_OFF + 12) & 0xFFFFFFFF)]
    out += [(BPF_JEQ_K, len(words) - i, 0, w) for i, w in enumerate(words)]
    return out + [(BPF_RET_K, 0, 0, 0), (BPF_RET_K, 0, 0, 0xFFFFFFFF)]


def attach(fd: int, addresses: Iterable[str]) -> None:
    """Attach (or replace) the filter of socket `fd`; OSError when the kernel refuses it."""
    code = program(addresses)
    instructions = (_Instruction * len(code))(*[_Instruction(*i) for i in code])
    _setsockopt(fd, SO_ATTACH_FILTER, _Program(len(code), instructions))


def detach(fd: int) -> None:
    """Remove the filter of socket `fd` (it admits every host again)."""
    _setsockopt(fd, SO_DETACH_FILTER, ctypes.c_int(0))


def _setsockopt(fd: int, option: int, value: Any) -> None:
    """setsockopt on a descriptor Python's socket module does not own (gloo's), with a ctypes value."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setsockopt(fd, socket.SOL_SOCKET, option, ctypes.byref(value), ctypes.sizeof(value)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def ipv4_listeners() -> dict[int, int]:
    """This process's IPv4 TCP sockets in LISTEN: socket inode -> file descriptor (Linux /proc)."""
    fds: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue   # closed while listing
        if target.startswith("socket:["):
            fds[target[8:-1]] = int(name)
    with open("/proc/self/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {int(r[9]): fds[r[9]] for r in rows if len(r) > 9 and r[3] == "0A" and r[9] in fds}


def host_of(endpoint: str) -> str | None:
    """The IPv4 address of a "host:port" endpoint (None when it is not one)."""
    host = endpoint.rsplit(":", 1)[0]
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        return None


_lock = threading.Lock()
_device: Any = None
_listeners: list[int] = []          # socket inodes of the device's listener


def device(address: str) -> Any:
    """The process's one gloo device, bound to `address` (the gloo address, zb.elastic.probe.gloo_address); made
    at the first call, with its listener noted for the filter."""
    global _device
    import torch.distributed as dist

    with _lock:
        if _device is None:
            before = set(ipv4_listeners()) if sys.platform == "linux" else set()
            _device = dist.ProcessGroupGloo.create_device(hostname=address)
            if sys.platform == "linux":
                _listeners[:] = sorted(set(ipv4_listeners()) - before)
        return _device


def options(address: str, timeout: Any) -> Any:
    """ProcessGroupGloo options that build a group on the process's one device."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub calls it Options
    opts._devices = [device(address)]
    opts._timeout = timeout
    return opts


class PeerFilter:
    """What the device's listener admits: the world's members' gloo addresses (elastic.peer_filter)."""

    def __init__(self, enabled: bool, address: str):
        self.enabled, self.address = enabled, address   # address: the gloo address the device binds
        self.admitted: set[str] | None = None    # None: every host (no filter attached)
        self._warned = False

    def admit(self, addresses: Iterable[str] | None) -> None:
        """Admit only `addresses` (None: every host: a member's address is unknown) on the device's listener."""
        wanted = None if addresses is None else set(addresses)
        if not self.enabled or wanted == self.admitted:
            return
        device(self.address)   # the listener to filter exists before anyone connects to it
        if sys.platform != "linux" or not _listeners:
            self._warn("elastic.peer_filter: this platform offers no socket filter (Linux only) or gloo's listener "
                       "was not found: its port admits every host")
            return
        inodes = ipv4_listeners()
        try:
            for inode in _listeners:
                if inode in inodes and wanted is not None:
                    attach(inodes[inode], wanted)
                elif inode in inodes and self.admitted is not None:
                    detach(inodes[inode])
        except (OSError, ValueError) as e:
            self._warn(f"elastic.peer_filter: could not filter gloo's listener ({e}): its port admits every host")
            return
        self.admitted = wanted

    def _warn(self, line: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", line)


def own_addresses() -> list[str]:
    """Every IPv4 address of this host (what a local rank's connection to another can come from)."""
    import psutil

    found = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    return sorted(found | {"127.0.0.1"})


@contextmanager
def only_this_host(enabled: bool) -> Iterator[None]:
    """The listeners opened inside the block (torch's groups over a node's local ranks) admit only this host's
    addresses once it ends: the local ranks are connected by then, and nothing else has a reason to connect."""
    if not enabled or sys.platform != "linux":
        yield
        return
    before = set(ipv4_listeners())
    yield
    listeners = ipv4_listeners()
    try:
        for inode in set(listeners) - before:
            attach(listeners[inode], own_addresses())
    except (OSError, ValueError) as e:
        log.warning("elastic.peer_filter: could not filter the local group's listener (%s): its port admits every "
                    "host", e)


def raise_descriptor_limit() -> tuple[int, int]:
    """Lift the soft limit on open files to the hard one; returns (before, after)."""
    try:
        import resource
    except ImportError:   # not a POSIX system
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return (soft, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return (soft, soft)
    return (soft, target)
