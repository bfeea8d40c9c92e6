"""The network of scripts/chaos.py --netns: every node on an emulated host of its own (zb.net.netns:
a network namespace with one veth on a shared bridge), the store on another (and, with `standby`, a
second store on a third host, after the first in every node's elastic.addr), and the faults the harness
injects there: a host's link taken down; nft dropping every packet, no reset, between a host and some
others (a partition, a cut from the store) or to and from everyone (a silent host: a reclaimed spot
instance, a closed laptop lid)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from zb.net.netns import IFNAME, Host, Network, netns_unavailable
from zb.testing.cluster import TrainCluster
from zb.testing.procs import REPO, free_port

PARTITION_TABLE = "zbchaos"


def unavailable() -> str | None:
    """None when --netns can run here, else why not (root, iproute2 and nft are needed)."""
    reason = netns_unavailable()
    if reason is None and shutil.which("nft") is None:
        reason = "needs nft (apt-get install nftables) for the partition event"
    return reason


class NetnsCluster(TrainCluster):
    """TrainCluster with `zb store` on net.hosts[0] and each node on a free host of the rest. With `standby`,
    a second `zb store` on net.hosts[1] is the next store of every node's elastic.addr (GLOBAL_ADDR=A,B; the
    caller sets elastic.store_failover_s) and the nodes take the hosts after it."""

    def __init__(self, tmp, world_size: int, net: Network, standby: bool = False, **env: str) -> None:
        self.net, self.store_host = net, net.hosts[0]
        self.standby_host = net.hosts[1] if standby else None
        self.node_hosts = net.hosts[2:] if standby else net.hosts[1:]
        self.host_of: dict[str, Host] = {}
        # Gloo binds eth0's address (else 127.0.0.1, unreachable from the other namespaces); the
        # sidecar advertises the address of the route toward GLOBAL_ADDR, i.e. eth0's too.
        super().__init__(tmp, world_size, GLOBAL_ADDR=self.store_host.addr, GLOO_SOCKET_IFNAME=IFNAME, **env)
        if standby:
            self.standby_ports.append(free_port())   # any port is free in a namespace; a distinct one reads better
            stores = [(self.store_host, self.port), (self.standby_host, self.standby_ports[0])]
            self.env["GLOBAL_ADDR"] = ",".join(f"{host.addr}:{port}" for host, port in stores)
            self.start_store(self.standby_ports[0])

    def store_host_at(self, port: int) -> Host:
        """The host of the store at `port` (the first store's, or the standby's)."""
        return self.store_host if port == self.port else self.standby_host

    def start_store(self, port: int | None = None) -> subprocess.Popen:
        port = port or self.port
        host, err = self.store_host_at(port), self.tmp / f"store-{port}.err"
        cmd = host.command([sys.executable, "-m", "zb", "store", "--host", host.addr, "--port", str(port)])
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=open(err, "a"), cwd=REPO)
        if port == self.port:
            self.store = proc
        else:
            self.standbys[port] = proc
        deadline = time.monotonic() + 60
        while not self._store_listening(host, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"zb store did not listen in {host.name}:\n" + err.read_text()[-2000:])
            time.sleep(0.1)
        return proc

    @staticmethod
    def _store_listening(host: Host, port: int) -> bool:
        out = host.run(["ss", "-ltnH", f"sport = :{port}"], timeout=10).stdout
        return bool(out.strip())

    def start_train(self, uid: str, *args: str, **kwargs):
        busy = {h.name for u, h in self.host_of.items() if self.procs[u].poll() is None}
        free = [h for h in self.node_hosts if h.name not in busy]
        if not free:
            raise RuntimeError(f"no free emulated host for {uid}: all of {len(self.node_hosts)} run a node")
        self.host_of[uid] = host = free[0]
        return super().start_train(uid, *args, prefix=tuple(host.command([])), **kwargs)


def set_partition(a: Host, b: Host | Sequence[Host], on: bool) -> None:
    """Drop (on) or let through again (off) every packet between host a and host(s) b, both directions.
    The rules live in a's namespace (input from b, output to b): b sees a fall silent and a sees b
    fall silent, while both keep reaching the store and every other host."""
    if not on:
        _lift(a)
        return
    peers = ", ".join(h.addr for h in ([b] if isinstance(b, Host) else b))
    _drop(a, f"ip saddr {{ {peers} }} drop", f"ip daddr {{ {peers} }} drop")


def set_silent(a: Host, on: bool) -> None:
    """Host a drops (on) every packet in and out of its link, to and from everyone, with no reset, or lets them
    through again (off): the machine is gone without a word. Its own loopback keeps working."""
    if not on:
        _lift(a)
        return
    _drop(a, f'iifname "{IFNAME}" drop', f'oifname "{IFNAME}" drop')


def _drop(a: Host, rule_in: str, rule_out: str) -> None:
    rules = (f"table inet {PARTITION_TABLE} {{\n"
             f"  chain in {{ type filter hook input priority 0; {rule_in}; }}\n"
             f"  chain out {{ type filter hook output priority 0; {rule_out}; }}\n"
             f"}}\n")
    done = subprocess.run(a.command(["nft", "-f", "-"]), input=rules, capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"nft in {a.name} failed: {done.stderr.strip()}")


def _lift(a: Host) -> None:
    a.run(["nft", "delete", "table", "inet", PARTITION_TABLE], timeout=10)


def partitioned(a: Host) -> bool:
    """Whether a's namespace still holds the partition table (for the cleanup check)."""
    return a.run(["nft", "list", "table", "inet", PARTITION_TABLE], timeout=10).returncode == 0
