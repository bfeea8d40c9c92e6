"""Background link measurement (elastic.measure_links): nodes time every ordered pair as receivers and
publish the rows the ring planner reads; a restarted member is measured again; a real 3-node mesh
fills the matrix while it keeps summing correctly."""

from __future__ import annotations

import json
import socket

import pytest

from zb.elastic import keys
from zb.elastic.keys import is_counter
from zb.elastic.linkprobe import LinkProber
from zb.elastic.ring import longest_delay_ms, read_links
from zb.elastic.tcpstore import host, read_many
from zb.store_clients import run_client
from zb.testing.procs import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store():
    port = free_port()
    hosted = host("127.0.0.1", port)
    yield lambda: run_client("127.0.0.1", port, 30.0, 30.0, counters=is_counter)
    del hosted


def rows(client, uid: str) -> dict:
    raw = read_many(client, [keys.links_into(uid)])[0]
    return json.loads(raw) if raw else {}


def start(store, uid: str, members: list[str]) -> LinkProber:
    prober = LinkProber(uid, "127.0.0.1", store, lambda: members, seconds=0.2)
    prober.start(store())
    return prober


def test_three_nodes_measure_every_ordered_pair_and_the_planner_reads_them(store):
    members = ["a", "b", "c"]
    probers = [start(store, u, members) for u in members]
    client = store()
    try:
        # Three senders at once: a receiver times one at a time, the others come back after a back-off.
        wait_until(lambda: all(len(rows(client, u)) == 2 for u in members), 60, "every ordered pair measured")
        measured, _, _, delays = read_links(client, members)
        assert set(measured) == {(s, d) for s in members for d in members if s != d}
        assert all(v is not None and v > 1.0 for v in measured.values())     # loopback: far above 1 Mbit/s
        # Every pair's round trip too (the pings before the timed stream), so the planner has the world's delay.
        assert set(delays) == set(measured) and all(0 < ms < 1000 for ms in delays.values())
        assert longest_delay_ms(members, delays) == round(max(delays.values()) / 2, 3)
        # A receiver publishes its row before the sender's send() returns and records the endpoint: wait
        # for the senders' side too (it failed once under load when asserted at once).
        wait_until(lambda: all(p.sent.keys() == set(members) - {p.uid} for p in probers), 30,
                   "every sender recorded its receivers")
    finally:
        for p in probers:
            p.stop()


def test_a_restarted_member_is_measured_again_both_ways(store):
    members = ["a", "b"]
    a, b = start(store, "a", members), start(store, "b", members)
    client = store()
    try:
        wait_until(lambda: len(rows(client, "a")) == 1 and len(rows(client, "b")) == 1, 60, "both links measured")
        b.stop()
        client.set(keys.links_into("b"), "{}")            # the new process starts with no rows of its own
        old_endpoint = b.endpoint
        b = start(store, "b", members)
        assert b.endpoint != old_endpoint
        wait_until(lambda: rows(client, "b").get("a"), 60, "a measuring into the restarted b")
        assert a.sent["b"] == b.endpoint
    finally:
        a.stop()
        b.stop()


def test_an_unreachable_member_is_given_up_on_with_one_warning(store, caplog, monkeypatch):
    import zb.elastic.linkprobe as lp

    monkeypatch.setattr(lp, "RETRY_S", (0.0, 0.05))
    monkeypatch.setattr(lp, "GIVE_UP_AFTER", 3)
    client = store()
    client.set(keys.link_server("ghost"), f"127.0.0.1:{free_port()}")     # nothing listens there
    a = start(store, "a", ["a", "ghost"])
    try:
        with caplog.at_level("WARNING", logger="zb.elastic"):
            wait_until(lambda: "ghost" in a.sent, 30, "a giving up on the ghost")
        warned = [r for r in caplog.records if "could not measure the link a -> ghost" in r.getMessage()]
        assert len(warned) == 1 and rows(client, "ghost") == {}
    finally:
        a.stop()




def test_a_mesh_measures_its_links_while_it_runs(cluster):
    nodes = cluster.start_world(3, ZB_ELASTIC_MEASURE_LINKS="true", ZB_ELASTIC_LINK_PROBE_SECONDS="0.3")
    cluster.agreement(nodes, 3)
    client = run_client("127.0.0.1", cluster.port, 30.0, 30.0, counters=is_counter)
    uids = ["a", "b", "c"]
    wait_until(lambda: all(len(rows(client, u)) == 2 for u in uids), 90, "the mesh's links measured",
               alive=[n.proc for n in nodes])
    # The ring keeps summing right whatever order the measurements give it, and every node sees the same
    # order at each mesh version. (Loopback links are alike, but on a machine busy with the rest of the
    # suite one 0.3 s probe can differ by more than the 10% a ring is kept within, so the order may move;
    # that rule itself is held by test_ring_order.test_a_ring_within_ten_percent_of_the_best_is_kept.)
    cluster.agreement(nodes, 3)
    seen: dict[int, list[str]] = {}
    for n in nodes:
        for e in n.events("membership"):
            assert sorted(e["nodes"]) == uids
            assert seen.setdefault(e["mesh_version"], e["nodes"]) == e["nodes"], (e["mesh_version"], seen)
