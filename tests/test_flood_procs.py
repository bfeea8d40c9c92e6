"""Issue 40, finding 3, with real processes: two `zb train` nodes on loopback (their hosts: 127.0.0.1) while an
outsider (127.0.0.2) sends 20,000 connect-and-reset loops to every port each node listens on. With
elastic.peer_filter (the default) both nodes train to the end, agree, and hold about the descriptors they held
before; without it gloo keeps every junk connection (the issue's node died at its limit with exit 134).
Minutes of flooding: soak."""

from __future__ import annotations

import math
import threading
import time

import psutil
import pytest
from test_listener_guard import flood

pytestmark = pytest.mark.soak
JUNK = 20_000


def family(pid: int) -> list[psutil.Process]:
    """A node's processes: itself, or torchrun and its local ranks."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def listening_ports(pid: int) -> list[int]:
    return sorted({c.laddr.port for p in family(pid) for c in p.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN})


def descriptors(pid: int) -> int:
    """Open descriptors of a node's processes; -1 once one of them is gone."""
    try:
        return sum(p.num_fds() for p in family(pid))
    except psutil.NoSuchProcess:
        return -1


def wait_for_outer_step(run, uid: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not run.metrics(uid, "outer_step"):
        assert time.monotonic() < deadline, run.log(uid)
        time.sleep(0.2)


@pytest.mark.parametrize("peer_filter, local_ranks", [("true", 1), ("false", 1), ("true", 2)])
def test_a_connection_flood_from_another_host_does_not_take_a_node_down(make_run, peer_filter, local_ranks):
    """Two local ranks add torch's groups over the node's ranks, whose listeners admit only this host."""
    run = make_run(2)
    flags = ("--optim.total_steps", "400", "--elastic.peer_filter", peer_filter)
    for i, uid in enumerate(("a", "b")):
        run.start_train(uid, *flags, rank=i, local_ranks=local_ranks)
    wait_for_outer_step(run, "a")
    pids = {uid: run.procs[uid].pid for uid in ("a", "b")}
    before = {uid: descriptors(pid) for uid, pid in pids.items()}
    ports = {uid: listening_ports(pid) for uid, pid in pids.items()}
    peak: dict[str, int] = {}

    def attack(uid: str) -> None:
        for port in ports[uid]:
            flood(port, JUNK)
        peak[uid] = descriptors(pids[uid])

    threads = [threading.Thread(target=attack, args=(uid,)) for uid in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    codes = {uid: run.finish(uid, timeout=300) for uid in ("a", "b")}
    if peer_filter == "false":
        # The finding, kept as the reason for the filter: each junk connection stays open in the node
        # until its limit ends it.
        assert any(peak[u] == -1 or peak[u] > before[u] + JUNK // 2 or codes[u] != 0 for u in ("a", "b")), (peak, codes)
        return
    assert codes == {"a": 0, "b": 0}, (run.log("a"), run.log("b"))
    assert not any("elastic.peer_filter" in (run.tmp / f"{u}.log").read_text() for u in ("a", "b"))
    assert all(peak[u] < before[u] + 200 for u in ("a", "b")), (before, peak, ports)
    hashes = [run.hashes(u) for u in ("a", "b")]
    assert hashes[0] and hashes[0] == hashes[1]
    assert all(math.isfinite(e["loss"]) for e in run.metrics("a", "step"))
