"""Every in-process member's heartbeat thread in one thread (tests/test_membership_scale.py, scripts/bench_scale.py):
for each member, every interval, the `add` to its counter and the read of the counters its own heartbeat thread
would read (Membership.watched) into its liveness table. The same requests as N heartbeat threads, from one
thread and one client: hundreds of members in one process then cost no hundreds of threads fighting over one
interpreter lock, which on 2 cores starved the beats themselves and let live members look dead."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from zb.elastic import keys
from zb.elastic.heartbeat import observe_counters

if TYPE_CHECKING:
    from zb.elastic.membership import Membership
    from zb.store_clients import StoreClient


class Pump(threading.Thread):
    def __init__(self, connect: Callable[[], StoreClient], members: list[Membership], interval: float) -> None:
        super().__init__(name="zb-heartbeat-pump", daemon=True)
        self.members, self.interval, self.halt = members, interval, threading.Event()
        self.client = connect()
        self.late = 0   # rounds that took longer than the interval (the beats fell behind)

    def run(self) -> None:
        while not self.halt.is_set():
            started = time.monotonic()
            for m in self.members:
                self.client.add(keys.heartbeat(m.uid), 1)
            for m in self.members:
                observe_counters(self.client, m.liveness, m.watched())
            spent = time.monotonic() - started
            self.late += spent > self.interval
            self.halt.wait(max(0.0, self.interval - spent))

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
