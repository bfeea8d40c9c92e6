"""SWARM's routing rule for one stage: send each task to the worker expected to be free first.

Each worker carries the time it is expected to be free. A dispatch picks the worker expected free
first, then moves that time to max(now, it) + task size / its throughput, where throughput is an
exponential moving average (alpha 0.1, bias-corrected as in Adam) of measured task size per second
(round trip: transfer, queueing and compute). A fast worker's time grows slowly, so it is picked
more often: throughput-weighted round robin. Anchoring to the clock, not to a pure virtual time, lets
a worker whose estimate was too pessimistic (a slow first request: connection, warm-up) be tried
again once that estimated busy time has passed instead of starving for good. A newcomer enters at
the current minimum, so it is tried soon and measured; a worker that failed or stalled is dropped
(banned for a while) and its tasks go elsewhere (Ryabinin et al., arXiv 2301.11913; the balancer of
yandex-research/swarm).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter


class NoWorker(RuntimeError):
    """No live worker of the stage to send a task to (all dropped, or none registered yet)."""


class ThroughputEMA:
    def __init__(self, alpha: float = 0.1):
        self.alpha, self.value, self.updates = alpha, 0.0, 0

    def update(self, sample: float) -> None:
        self.value = self.alpha * sample + (1 - self.alpha) * self.value
        self.updates += 1

    def get(self) -> float | None:
        if not self.updates:
            return None
        return self.value / (1 - (1 - self.alpha) ** self.updates)


class Router:
    """Busy times and throughputs of one stage's workers (thread-safe: many micro-batches route at once)."""

    def __init__(self, alpha: float = 0.1, ban_s: float = 30.0, clock=time.monotonic):
        self.alpha, self.ban_s, self.clock = alpha, ban_s, clock
        self.busy: dict[str, float] = {}
        self.speed: dict[str, ThroughputEMA] = {}
        self.banned: dict[str, float] = {}   # uid -> until when
        self.sent: Counter[str] = Counter()   # tasks dispatched, per worker (the routing shares)
        self._lock = threading.Lock()

    def set_workers(self, uids: list[str]) -> None:
        """The stage's registered workers: newcomers enter at the current minimum, the gone leave."""
        with self._lock:
            now = self.clock()
            for uid in list(self.busy):
                if uid not in uids:
                    del self.busy[uid]
            floor = max(min(self.busy.values(), default=now), now)
            for uid in uids:
                if uid not in self.busy and self.banned.get(uid, 0.0) <= now:
                    self.busy[uid] = floor
                    self.speed.setdefault(uid, ThroughputEMA(self.alpha))

    def choose(self, size: float, avoid: set[str] = frozenset()) -> str:
        """The worker expected to be free first (not in `avoid`); charges it the task's expected time."""
        with self._lock:
            candidates = [u for u in self.busy if u not in avoid]
            if not candidates:
                raise NoWorker("no live worker")
            uid = min(candidates, key=lambda u: (self.busy[u], self.sent[u], u))  # ties: the least tried (a newcomer)
            self.busy[uid] = max(self.busy[uid], self.clock()) + size / self._throughput(uid)
            self.sent[uid] += 1
            return uid

    def _throughput(self, uid: str) -> float:
        mine = self.speed[uid].get()
        if mine:
            return mine
        # Unmeasured: as fast as the fastest measured one (no charge at all when none is measured yet), so the
        # first measurement comes soon; a pessimistic guess would keep the worker idle for as long as it lasts.
        return max((s for s in (e.get() for e in self.speed.values()) if s), default=math.inf)

    def done(self, uid: str, size: float, seconds: float) -> None:
        with self._lock:
            if uid in self.speed:
                self.speed[uid].update(size / max(seconds, 1e-6))

    def drop(self, uid: str) -> None:
        """The worker failed or stalled: no tasks for ban_s seconds (or until it registers anew after that)."""
        with self._lock:
            self.busy.pop(uid, None)
            self.banned[uid] = self.clock() + self.ban_s

    def live(self) -> list[str]:
        with self._lock:
            return sorted(self.busy)

    def throughputs(self) -> dict[str, float | None]:
        with self._lock:
            return {u: e.get() for u, e in self.speed.items()}
