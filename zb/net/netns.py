"""Emulated hosts for tests and benchmarks: network namespaces on one bridge, tbf-shaped links.

    from zb.net.netns import emulated_hosts, netns_unavailable
    with emulated_hosts(3, rate_mbit=100) as net:
        procs = [h.popen(["python", "-m", "zb", ...]) for h in net.hosts]   # h.addr, h.name
        net.hosts[1].set_link(up=False)                                    # a partition

Every host is a namespace with one interface `eth0` (address 10.<net>.0.<i+1>/24) whose other end
sits on a bridge in a namespace of its own, so nothing touches the machine's real network. With
rate_mbit, both directions of each host's link go through tbf (upload on eth0, download on the
bridge port). Names carry the creating pid: leaving the context deletes everything, and a later
run deletes what a killed run left behind. Needs root and iproute2 (PLATFORM.md).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

PREFIX = "zbns"
IFNAME = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """None when namespaces can be built here, else the reason (for pytest.skip)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return "cannot create network namespaces here"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str  # namespace name
    addr: str  # IPv4 address of eth0
    bridge: str  # namespace holding the bridge
    port: str  # this host's port on the bridge
    ifname: str = IFNAME

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start argv inside this host; GLOO_SOCKET_IFNAME points gloo at eth0."""
        env = {**(env if env is not None else os.environ), "GLOO_SOCKET_IFNAME": self.ifname}
        return subprocess.Popen(self.command(argv), env=env, **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def set_link(self, up: bool) -> None:
        """Take this host's link down (a partition) or back up."""
        _ip("-n", self.bridge, "link", "set", self.port, "up" if up else "down")


@dataclass
class Network:
    bridge: str
    hosts: list[Host] = field(default_factory=list)
    rate_mbit: float | None = None


def _shape(ns: str, dev: str, rate_mbit: float) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", f"{rate_mbit}mbit", "burst", "32kbit", "latency", "400ms"],
                   check=True, capture_output=True, timeout=30)


def _add_host(net: Network, tag: str, i: int, subnet: int, rate_mbit: float | None) -> Host:
    host = Host(name=f"{tag}-h{i}", addr=f"10.{subnet}.0.{i + 1}", bridge=net.bridge, port=f"p{i}")
    _ip("netns", "add", host.name)
    net.hosts.append(host)
    _ip("link", "add", IFNAME, "netns", host.name, "type", "veth", "peer", "name", host.port, "netns", net.bridge)
    _ip("-n", net.bridge, "link", "set", host.port, "master", "br0", "up")
    _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
    _ip("-n", host.name, "link", "set", IFNAME, "up")
    _ip("-n", host.name, "link", "set", "lo", "up")
    if rate_mbit:
        _shape(host.name, IFNAME, rate_mbit)  # upload
        _shape(net.bridge, host.port, rate_mbit)  # download
    return host


def remove_stale() -> list[str]:
    """Delete namespaces of ours whose creating process is gone; returns their names."""
    out = _ip("netns", "list", check=False).stdout.split("\n")
    gone = []
    for line in out:
        name = line.split(" ")[0]
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not os.path.exists(f"/proc/{parts[1]}"):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


@contextmanager
def emulated_hosts(n: int, rate_mbit: float | None = None) -> Iterator[Network]:
    """n hosts on one bridge, each link shaped to rate_mbit in both directions (None: unshaped)."""
    remove_stale()
    tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
    net = Network(bridge=f"{tag}-br", rate_mbit=rate_mbit)
    subnet = 100 + secrets.randbelow(100)
    try:
        _ip("netns", "add", net.bridge)
        _ip("-n", net.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.bridge, "link", "set", "br0", "up")
        for i in range(n):
            _add_host(net, tag, i, subnet, rate_mbit)
        yield net
    finally:
        for name in [h.name for h in net.hosts] + [net.bridge]:
            _ip("netns", "del", name, check=False)
