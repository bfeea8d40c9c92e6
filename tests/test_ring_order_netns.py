"""Ring order from links the nodes measure themselves (elastic.measure_links, no matrix file), across
emulated hosts where rank order puts a slow link in the ring: the run reorders itself around it and
keeps summing correctly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import load_script

from zb.net.netns import emulated_hosts, netns_unavailable
from zb.testing.procs import REPO, subprocess_env, wait_until

pytestmark = pytest.mark.netns

PORT = 29611


def events(path, kind: str) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == kind:
            out.append(event)
    return out


def test_measured_links_move_the_ring_off_a_slow_link(tmp_path):
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    from zb.testing.cluster import PROFILE

    shape = load_script("bench_netns_ring_order").shape_per_destination
    with emulated_hosts(4) as net:
        nodes, store_host = net.hosts[:3], net.hosts[3]
        # a -> b at 5 Mbit/s, every other link 100: rank order a -> b -> c -> a has the slow hop.
        shape(nodes[0], {nodes[1].addr: 5}, 100)
        for h in nodes[1:]:
            shape(h, {}, 100)
        env = subprocess_env(GLOBAL_ADDR=store_host.addr, GLOBAL_PORT=str(PORT), **PROFILE)
        procs = [store_host.popen([sys.executable, "-m", "zb", "store", "--host", store_host.addr,
                                   "--port", str(PORT)], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                  stderr=open(tmp_path / "store.err", "w"))]
        outs = [tmp_path / f"{u}.out" for u in "abc"]
        try:
            for r, (uid, host, out) in enumerate(zip("abc", nodes, outs)):
                node_env = dict(env, GLOBAL_UNIQUE_ID=uid, GLOBAL_RANK=str(r), GLOBAL_WORLD_SIZE="3",
                                ZB_ELASTIC_MEASURE_LINKS="true", ZB_ELASTIC_LINK_PROBE_SECONDS="1")
                procs.append(host.popen([sys.executable, str(REPO / "tests" / "elastic_node.py"), "--duration", "150"],
                                        env=node_env, cwd=REPO, stdout=open(out, "w"),
                                        stderr=open(tmp_path / f"{uid}.err", "w")))

            def reordered():
                moved = [e for e in events(outs[0], "membership") if e["nodes"] != ["a", "b", "c"]]
                return moved[-1] if moved else None

            event = wait_until(reordered, 120, "the ring reordered by measured links", alive=procs[1:],
                               details=lambda: (tmp_path / "a.err").read_text()[-3000:])
            assert event["nodes"] == ["a", "c", "b"] and event["ring_mbps"] > 50
            first = events(outs[0], "membership")[0]
            print(f"ring reordered {event['time'] - first['time']:.1f} s after the first world "
                  f"(slowest hop {event['ring_mbps']:.1f} Mbit/s)")
            version = event["mesh_version"]
            # Every node sums correctly over the reordered groups.
            wait_until(lambda: all(any(s["version"] >= version and s["ok"] for s in events(o, "step")) for o in outs),
                       60, "steps over the reordered world", alive=procs[1:])
        finally:
            for p in procs:
                p.kill()
                p.wait(10)
