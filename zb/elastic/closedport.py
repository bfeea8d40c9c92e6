"""Telling a crashed peer from a slow one before the heartbeat timeout.

A member (answered or not) whose heartbeat has been silent for 2 x heartbeat_interval is
probed on its reachability listener (zb.elastic.probe); if its host refuses the connection, the
process is gone (SIGKILL, OOM kill, crash) and the liveness table marks it dead at once. A hung or
partitioned peer does not refuse, so it still gets the full heartbeat timeout.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from zb.elastic import keys
from zb.elastic.heartbeat import Liveness
from zb.elastic.probe import refuses
from zb.elastic.tcpstore import read_many

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")

PROBE_TIMEOUT = 0.5


class ClosedPortDetector:
    def __init__(self, liveness: Liveness, interval: float) -> None:
        self.liveness, self.interval = liveness, interval
        self._last_probe: dict[str, float] = {}

    def check(self, store: StoreClient, candidates: list[str]) -> None:
        """Probe the silent ones among `candidates` (at most once per interval each)."""
        now = time.monotonic()
        silent = [u for u in candidates if self.liveness.silent_for(u, now) > 2 * self.interval
                  and not self.liveness.is_dead(u, now) and now - self._last_probe.get(u, -1e9) >= self.interval]
        if not silent:
            return
        for uid, endpoint in zip(silent, read_many(store, [keys.probe(u) for u in silent])):
            self._last_probe[uid] = now
            if endpoint and refuses(endpoint.decode(), PROBE_TIMEOUT):
                log.warning("%s is silent and its port refuses connections: its process is gone", uid)
                self.liveness.condemn(uid)
