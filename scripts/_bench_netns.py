"""TEMPORARY minimal network-namespace topology for scripts/bench_recovery.py.

Replace with zb.net.netns once that module (branch int8) is on main. Needs root and iproute2.
Hosts hang off one bridge that lives in its own namespace; each host's uplink (egress of its veth)
can be shaped with tbf, the only rate limiter this machine's kernel has (see PLATFORM.md).
"""

from __future__ import annotations

import os
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Topology:
    """Hosts 10.77.<net>.<i+1> on a bridge; `exec_prefix(host)` runs a command inside a host."""

    def __init__(self, hosts: list[str], net: int = 77):
        self.tag = f"{os.getpid() % 100000}"
        self.hosts = hosts
        self.net = net
        self.bridge_ns = f"zbr{self.tag}-br"
        self.addresses = {h: f"10.{net}.0.{i + 1}" for i, h in enumerate(hosts)}
        self.created: list[str] = []

    def ns(self, host: str) -> str:
        return f"zbr{self.tag}-{host}"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def __enter__(self) -> Topology:
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                self._add_host(i, host)
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, i: int, host: str) -> None:
        ns, inner, outer = self.ns(host), f"v{self.tag}h{i}", f"b{self.tag}h{i}"
        self._add_ns(ns)
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "netns", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", outer, "master", "br0")
        _ip("-n", self.bridge_ns, "link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")

    def shape_uplink(self, host: str, mbit: float) -> None:
        """tbf on the host's egress: its uplink is `mbit` whatever it talks to."""
        i = self.hosts.index(host)
        burst = max(4096, int(mbit * 1e6 / 8 / 100))  # 10 ms worth of bytes
        subprocess.run([*self.exec_prefix(host), "tc", "qdisc", "replace", "dev", f"v{self.tag}h{i}", "root", "tbf",
                        "rate", f"{mbit}mbit", "burst", str(burst), "latency", "400ms"], check=True,
                       capture_output=True)

    def close(self) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def __exit__(self, *exc) -> None:
        self.close()


def available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"zbr{os.getpid() % 100000}-probe"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"ip netns add failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None
