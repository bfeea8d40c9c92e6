"""The network of scripts/chaos.py --netns: every node on an emulated host of its own (zb.net.netns:
a network namespace with one veth on a shared bridge), the store on another, and the two network
faults the harness injects there: a host's link taken down, and a two-way partition between two
hosts (nft drops their traffic to each other; both still reach the store and every other host)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from zb.net.netns import IFNAME, Host, Network, netns_unavailable
from zb.testing.cluster import TrainCluster
from zb.testing.procs import REPO

PARTITION_TABLE = "zbchaos"


def unavailable() -> str | None:
    """None when --netns can run here, else why not (root, iproute2 and nft are needed)."""
    reason = netns_unavailable()
    if reason is None and shutil.which("nft") is None:
        reason = "needs nft (apt-get install nftables) for the partition event"
    return reason


class NetnsCluster(TrainCluster):
    """TrainCluster with `zb store` on net.hosts[0] and each node on a free host of net.hosts[1:]."""

    def __init__(self, tmp, world_size: int, net: Network, **env: str) -> None:
        self.net, self.store_host = net, net.hosts[0]
        self.host_of: dict[str, Host] = {}
        # Gloo binds eth0's address (else 127.0.0.1, unreachable from the other namespaces); the
        # sidecar advertises the address of the route toward GLOBAL_ADDR, i.e. eth0's too.
        super().__init__(tmp, world_size, GLOBAL_ADDR=self.store_host.addr, GLOO_SOCKET_IFNAME=IFNAME, **env)

    def start_store(self) -> None:
        cmd = self.store_host.command([sys.executable, "-m", "zb", "store", "--host", self.store_host.addr,
                                       "--port", str(self.port)])
        self.store = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                      stderr=open(self.tmp / "store.err", "a"), cwd=REPO)
        deadline = time.monotonic() + 60
        while not self._store_listening():
            if self.store.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"zb store did not listen in {self.store_host.name}:\n"
                                   + (self.tmp / "store.err").read_text()[-2000:])
            time.sleep(0.1)

    def _store_listening(self) -> bool:
        out = self.store_host.run(["ss", "-ltnH", f"sport = :{self.port}"], timeout=10).stdout
        return bool(out.strip())

    def start_train(self, uid: str, *args: str, **kwargs):
        busy = {h.name for u, h in self.host_of.items() if self.procs[u].poll() is None}
        free = [h for h in self.net.hosts[1:] if h.name not in busy]
        if not free:
            raise RuntimeError(f"no free emulated host for {uid}: all of {len(self.net.hosts) - 1} run a node")
        self.host_of[uid] = host = free[0]
        return super().start_train(uid, *args, prefix=tuple(host.command([])), **kwargs)


def set_partition(a: Host, b: Host, on: bool) -> None:
    """Drop (on) or let through again (off) every packet between hosts a and b, both directions.
    The rules live in a's namespace (input from b, output to b): b sees a fall silent and a sees b
    fall silent, while both keep reaching the store and every other host."""
    if not on:
        a.run(["nft", "delete", "table", "inet", PARTITION_TABLE], timeout=10)
        return
    rules = (f"table inet {PARTITION_TABLE} {{\n"
             f"  chain in {{ type filter hook input priority 0; ip saddr {b.addr} drop; }}\n"
             f"  chain out {{ type filter hook output priority 0; ip daddr {b.addr} drop; }}\n"
             f"}}\n")
    done = subprocess.run(a.command(["nft", "-f", "-"]), input=rules, capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"nft in {a.name} failed: {done.stderr.strip()}")


def partitioned(a: Host) -> bool:
    """Whether a's namespace still holds the partition table (for the cleanup check)."""
    return a.run(["nft", "list", "table", "inet", PARTITION_TABLE], timeout=10).returncode == 0
