"""SWARM's routing rule for one stage: send each task to the worker expected to be free first.

Each worker carries the time it is expected to be free. A dispatch picks the worker expected to
finish the task first, max(now, free time) + task size / its throughput, and moves its free time
there; throughput is an exponential moving average (alpha 0.1, bias-corrected as in Adam) of
measured task size per second (round trip: transfer, queueing and compute). While every worker is
busy this is SWARM's rule (least expected busy time first: throughput-weighted round robin); when
several are idle, as at the start of a synchronous step, it still sends the task to the faster one
(SWARM's rule alone would alternate between idle workers whatever their speed). Anchoring to the
clock, not to a pure virtual time, lets a worker whose estimate was too pessimistic be tried again,
and a worker not measured for reprobe_s seconds is priced as the fastest, so a recovered slow worker
gets work again. A newcomer enters at the current minimum, so it is tried soon and measured; a
worker that failed or stalled is dropped (banned for a while) and its tasks go elsewhere (Ryabinin
et al., arXiv 2301.11913; the balancer of yandex-research/swarm).
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

    def __init__(self, alpha: float = 0.1, ban_s: float = 30.0, reprobe_s: float = 20.0, clock=time.monotonic):
        self.alpha, self.ban_s, self.reprobe_s, self.clock = alpha, ban_s, reprobe_s, clock
        self.measured: dict[str, float] = {}   # when each worker's throughput was last measured
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

    def choose(self, size: float, avoid: set[str] | frozenset[str] = frozenset()) -> str:
        """The worker expected to be free first (not in `avoid`); charges it the task's expected time."""
        with self._lock:
            candidates = [u for u in self.busy if u not in avoid]
            if not candidates:
                raise NoWorker("no live worker")
            now = self.clock()
            # Earliest expected finish of this task: when the worker is free, plus the task at its throughput. With
            # every worker busy this is SWARM's least-loaded rule; with idle ones it still prefers the faster.
            finish = {u: max(self.busy[u], now) + size / self._throughput(u, now) for u in candidates}
            uid = min(candidates, key=lambda u: (finish[u], self.sent[u], u))   # ties: the least tried (a newcomer)
            self.busy[uid] = finish[uid]
            self.sent[uid] += 1
            return uid

    def _throughput(self, uid: str, now: float) -> float:
        mine = self.speed[uid].get()
        if mine and now - self.measured.get(uid, now) < self.reprobe_s:
            return mine
        # Unmeasured, or not measured for reprobe_s (a slow worker that got no task since may have recovered): as
        # fast as the fastest measured one (no charge when none is), so it gets a task and a new measurement soon;
        # a pessimistic guess would keep it idle for as long as the guess lasts.
        return max((s for s in (e.get() for e in self.speed.values()) if s), default=math.inf)

    def done(self, uid: str, size: float, seconds: float) -> None:
        with self._lock:
            if uid in self.speed:
                self.speed[uid].update(size / max(seconds, 1e-6))
                self.measured[uid] = self.clock()

    def drop(self, uid: str) -> None:
        """The worker failed or stalled: no tasks for ban_s seconds (or until it registers anew after that)."""
        with self._lock:
            self.busy.pop(uid, None)
            self.banned[uid] = self.clock() + self.ban_s

    def renew(self, uid: str) -> None:
        """A new process registered under `uid` (a restart): a newcomer, not the one banned or measured."""
        with self._lock:
            self.banned.pop(uid, None)
            self.speed.pop(uid, None)
            self.measured.pop(uid, None)
            self.busy.pop(uid, None)

    def live(self) -> list[str]:
        with self._lock:
            return sorted(self.busy)

    def throughputs(self) -> dict[str, float | None]:
        with self._lock:
            return {u: e.get() for u, e in self.speed.items()}
