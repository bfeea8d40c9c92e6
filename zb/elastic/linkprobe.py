"""A run's nodes measure their links in the background (elastic.measure_links), for the ring order.

Prime measured every pair with iperf at each mesh change, with training stopped. Here each node's
local rank 0 runs two threads from the moment it joins, and training never waits for them:
- a receiver: a zb.net.link server on the gloo address (the path the ring's bytes take), published
  under keys.link_server(uid). It times each sender that comes, one at a time, as `zb iperf-mesh`
  does (receiver-side clock, never the sender's), and writes the results it holds to
  keys.links_into(uid), a key no other node writes;
- a sender: it walks the world's members and sends to every one it has not measured into yet (or
  that restarted since: a new receiver endpoint)
  (a member's receiver busy with another sender refuses by closing: the sender tries it again after
  a random back-off, so the measurements of a new member spread out instead of colliding).
A joiner thus measures its links to every member, and every member its link to the joiner; the
acting leader reads the rows at the next membership change (zb.elastic.ring), and a ring that
already is within 10% of the best one found is kept, so noise in the figures moves nobody.

What the figures are: TCP goodput of one stream for elastic.link_probe_seconds, taken while the
run trains, so a measurement that overlaps an all-reduce on the same link reads low, and the round trip
of a few pings before it (the latency the reduce's shape is chosen by: zb.collectives.allreduce.pick_shape). The ring
order only needs the links ranked, and the slow links the order must avoid are slow either way.
Each ordered pair is measured once per pair of member processes; a node that restarts is measured
again, both ways.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from zb.elastic import keys
from zb.elastic.tcpstore import read_many, store_errors
from zb.errors import EnvironmentFailure
from zb.net.link import LinkError, LinkServer, receive, send

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")

PINGS = 3
RETRY_S = (1.0, 4.0)          # back-off range after a busy or failed receiver
GIVE_UP_AFTER = 8             # attempts on one member before waiting for the next world to try again
IDLE_S = 1.0                  # how often the sender looks for members not measured yet


class LinkProber:
    """The two background threads of one node (see the module docstring)."""

    def __init__(self, uid: str, address: str, connect: Callable[[], StoreClient], members: Callable[[], list[str]],
                 seconds: float, store_index: Callable[[], int] = lambda: 0) -> None:
        # store_index: the current store's place in elastic.addr; the threads' clients are made anew when it changes
        self.uid, self.seconds = uid, seconds
        self._connect, self._members, self._store_index = connect, members, store_index
        self._server = LinkServer(address, 0)
        self.endpoint = f"{address}:{self._server.port}"
        self.rows: dict[str, dict[str, float]] = {}   # sender uid -> {"mbps": into this node, "rtt_ms": if timed}
        self.sent: dict[str, str] = {}          # member -> the receiver endpoint measured (or given up on)
        self._tries: dict[str, int] = {}
        self._not_before: dict[str, float] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._receive_loop, name="zb-link-receiver", daemon=True),
                         threading.Thread(target=self._send_loop, name="zb-link-sender", daemon=True)]

    def start(self, store: StoreClient) -> None:
        store.set(keys.link_server(self.uid), self.endpoint)
        for t in self._threads:
            t.start()

    def publish_to(self, store: StoreClient) -> None:
        """This node's endpoint and rows into a store that lacks them (restarted empty, or the next one)."""
        store.set(keys.link_server(self.uid), self.endpoint)
        store.set(keys.links_into(self.uid), json.dumps(self.rows, sort_keys=True))
        store.set(keys.LINKS_MEASURED, "1")

    def _client(self, store: StoreClient | None, index: list[int]) -> StoreClient:
        """`store`, or a new client when there is none or the run moved to another store since (`index` holds
        the store index the client was made at)."""
        if store is None or index[0] != self._store_index():
            index[0] = self._store_index()
            store = self._connect()
        return store

    def stop(self) -> None:
        self._stop.set()
        self._server.close()
        for t in self._threads:
            t.join(timeout=self.seconds + 5)

    # -- receiver ----------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        store: StoreClient | None = None
        index = [0]
        while not self._stop.is_set():
            taken = self._server.take_any(wait_s=0.5)
            if taken is None:
                continue
            header, control = taken
            src = str(header["src"])
            m = receive(self._server, src, self.uid, header["tag"], streams=1, pings=PINGS,
                        wait_s=10.0, io_timeout_s=self.seconds + 30, sender_error=lambda: None, control=control)
            if m.mbps is None:
                log.debug("link %s -> %s: not measured (%s)", src, self.uid, m.error)
                continue
            self.rows[src] = {"mbps": round(m.mbps, 3), **({"rtt_ms": round(m.rtt_ms, 3)} if m.rtt_ms else {})}
            log.info("link %s -> %s: %.1f Mbit/s, rtt %.2f ms (measured in the background)", src, self.uid,
                     m.mbps, m.rtt_ms or 0.0)
            store = self._publish(store, index)

    def _publish(self, store: StoreClient | None, index: list[int]) -> StoreClient | None:
        """All of this node's rows into its own key (so a restarted store gets every row back)."""
        try:
            store = self._client(store, index)
            store.set(keys.links_into(self.uid), json.dumps(self.rows, sort_keys=True))
            store.set(keys.LINKS_MEASURED, "1")
            return store
        except store_errors() + (EnvironmentFailure,) as e:
            log.debug("could not publish the measured links (next measurement retries): %s", e)
            return None

    # -- sender ------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        store: StoreClient | None = None
        index = [0]
        while not self._stop.wait(IDLE_S):
            members = [u for u in self._members() if u != self.uid and time.monotonic() >= self._not_before.get(u, 0.0)]
            try:
                store = self._client(store, index)
                endpoints = read_many(store, [keys.link_server(u) for u in members])
            except store_errors() + (EnvironmentFailure,):
                store = None
                continue
            for dst, endpoint in zip(members, endpoints):
                # A member that restarted listens on a new endpoint, with no rows yet: measured again.
                if self._stop.is_set():
                    return
                if endpoint and self.sent.get(dst) != endpoint.decode(errors="replace"):
                    self._send_to(dst, endpoint.decode(errors="replace"))

    def _send_to(self, dst: str, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        try:
            send(host, int(port), self.uid, dst, random.getrandbits(31), streams=1, pings=PINGS,
                 duration_s=self.seconds, connect_timeout_s=5.0, io_timeout_s=self.seconds + 30)
            self.sent[dst] = endpoint
            self._tries.pop(dst, None)
        except (LinkError, ValueError) as e:
            tries = self._tries[dst] = self._tries.get(dst, 0) + 1
            if tries >= GIVE_UP_AFTER:
                log.warning("could not measure the link %s -> %s in %d attempts (%s); the ring order goes without "
                            "it until one of the two restarts", self.uid, dst, tries, e)
                self.sent[dst] = endpoint
                return
            self._not_before[dst] = time.monotonic() + random.uniform(*RETRY_S)
