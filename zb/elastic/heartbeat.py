"""Heartbeats and the liveness table.

One thread per node bumps the node's counter every `heartbeat_interval` and reads the counters of
the nodes it is told to watch. Liveness is judged on this process's own monotonic clock: a peer is
alive while its counter keeps changing, and dead once it has not changed for `heartbeat_timeout`.
No wall clock crosses the network, so skew between continents cannot kill anyone.

The thread has its own store client (a client is not shared across threads). When the store is
unreachable it logs once, keeps trying every interval, and re-creates its client when the store is
back. Stopping the thread never sends a deathrattle (see zb.elastic.deathrattle).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from zb.elastic import keys
from zb.elastic.tcpstore import bump, read_many, store_errors

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")


class Liveness:
    """When each watched counter was last seen changing, on the local monotonic clock.

    Only what is still read counts: a node reads the counters of the members it judges (all of them while it
    may lead, a few otherwise: zb.elastic.standby), and a counter it stopped reading for `timeout` is no
    evidence either way (its last change would otherwise age into a death it never saw)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._seen: dict[str, tuple[bytes, float]] = {}
        self._read_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, uid: str, value: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            old = self._seen.get(uid)
            # a counter read again after a gap: its silence counts from now (a condemned one stays condemned)
            if old is None or old[0] != value or (old[1] != float("-inf") and self._stale(uid, now)):
                self._seen[uid] = (value, now)
            self._read_at[uid] = now

    def _stale(self, uid: str, now: float) -> bool:
        return now - self._read_at.get(uid, now) > self.timeout

    def silent_for(self, uid: str, now: float | None = None) -> float:
        """Seconds since `uid`'s counter last changed (0 for a node never observed, or not read for `timeout`:
        no evidence)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = self._seen.get(uid)
            if seen is None or (seen[1] != float("-inf") and self._stale(uid, now)):
                return 0.0
        return now - seen[1]

    def is_dead(self, uid: str, now: float | None = None) -> bool:
        return self.silent_for(uid, now) > self.timeout

    def proven_dead(self, uid: str) -> bool:
        """Condemned (its port refused connections: the process is gone), not merely silent."""
        with self._lock:
            seen = self._seen.get(uid)
        return seen is not None and seen[1] == float("-inf")

    def condemn(self, uid: str) -> None:
        """Dead now (its process is gone), until its counter changes again (a new incarnation)."""
        with self._lock:
            value = self._seen.get(uid, (b"", 0.0))[0]
            self._seen[uid] = (value, float("-inf"))

    def forget_all(self) -> None:
        """After a store restart every counter starts over; old observations mean nothing."""
        with self._lock:
            self._seen.clear()
            self._read_at.clear()


def observe_counters(store: StoreClient, liveness: Liveness, uids: Iterable[str]) -> None:
    """One round trip: read the counters of `uids` into the liveness table (missing reads as b"").

    A change counts from when it was seen, so the clock is read after the counters: read before,
    a process stopped in between (SIGSTOP, a swap storm) dated its peers' fresh counters back past
    the timeout and judged every live peer dead."""
    uids = list(uids)
    for uid, value in zip(uids, read_many(store, [keys.heartbeat(u) for u in uids])):
        liveness.observe(uid, value)


class Heartbeat(threading.Thread):
    """Bumps this node's counter and observes the watched nodes, every interval, until stopped."""

    def __init__(self, uid: str, interval: float, liveness: Liveness, connect: Callable[[], StoreClient],
                 watch: Callable[[], list[str]], answered: Callable[[], None] = lambda: None,
                 store_index: Callable[[], int] = lambda: 0) -> None:
        # answered: called after each beat the store took (zb.elastic.stores times its silence by them);
        # store_index: the current store's place in elastic.addr: the client is made anew when it changes
        super().__init__(name="zb-heartbeat", daemon=True)
        self.uid, self.interval, self.liveness = uid, interval, liveness
        self._connect, self._watch, self._answered, self._store_index = connect, watch, answered, store_index
        self._index = 0
        self._stop_event = threading.Event()
        self._store: StoreClient | None = None   # a client of its own; None until connected, and after a failure
        self.beats = 0
        self.outage_since: float | None = None
        self._last_beat: float | None = None
        self.worst_gap_s = 0.0   # the longest time between two beats that reached the store, on this clock
        self.worst_outage_s = 0.0   # ... of those gaps, the longest in which the store failed to answer a beat

    def run(self) -> None:
        while not self._stop_event.is_set():
            started = time.monotonic()
            self._beat()
            self._stop_event.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def take_worst_gap(self) -> tuple[float, float]:
        """The longest gap between this node's beats since the last call, and the longest in which the store
        did not answer (both then forgotten), the silence since the last beat included: a node woken from a
        freeze may ask before this thread beats again. A gap the store caused is not the machine's."""
        silent = time.monotonic() - self._last_beat if self._last_beat is not None else 0.0
        outage = max(self.worst_outage_s, silent if self.outage_since is not None else 0.0)
        gap, self.worst_gap_s, self.worst_outage_s = max(self.worst_gap_s, silent), 0.0, 0.0
        return gap, outage

    def _beat(self) -> None:
        try:
            if self._store is None or self._index != self._store_index():   # none yet, or the run moved on
                self._index = self._store_index()
                self._store = self._connect()
                bump(self._store, keys.heartbeat(self.uid), 1)   # a client made after a failure: junk there is why
            else:
                self._store.add(keys.heartbeat(self.uid), 1)
            now = time.monotonic()
            if self._last_beat is not None:
                # A machine too busy to run this thread (or a store too slow to take the beat) shows here; a store
                # that did not answer at all (a cut, its host silent) shows as an outage.
                self.worst_gap_s = max(self.worst_gap_s, now - self._last_beat)
                if self.outage_since is not None:
                    self.worst_outage_s = max(self.worst_outage_s, now - self._last_beat)
            self._last_beat = now
            self._answered()
            observe_counters(self._store, self.liveness, self._watch())
            self.beats += 1
            if self.outage_since is not None:
                log.warning("heartbeat: store reachable again after %.1f s", time.monotonic() - self.outage_since)
                self.outage_since = None
        except store_errors() as e:
            self._store = None
            if self.outage_since is None:
                self.outage_since = time.monotonic()
                log.error("heartbeat: STORE UNREACHABLE (%s); training goes on, retrying every %.1f s",
                          str(e).splitlines()[0][:160], self.interval)

    def stop(self, timeout: float | None = None) -> None:
        """Stop beating (no deathrattle: a restart of the thread is not a departure)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)


def stall_hint(worst_gap_s: float, timeout_s: float, outage_s: float = 0.0) -> str:
    """Why the others may have taken this node for dead, when its own beats say so; else "". A store that did not
    answer the beats (`outage_s`) is named before the machine: a cut is not a busy CPU."""
    if outage_s >= timeout_s / 2:
        return (f"; the store did not answer this node's heartbeats for up to {outage_s:.1f} s (elastic.heartbeat_timeout "
                f"is {timeout_s:g} s): the others could not see it beat (a cut between it and the store, or the "
                "store's host)")
    if worst_gap_s < timeout_s / 2:
        return ""
    return (f"; this node's own heartbeats were up to {worst_gap_s:.1f} s apart (elastic.heartbeat_timeout is "
            f"{timeout_s:g} s): a machine too busy to beat in time looks dead to the others; raise "
            "elastic.heartbeat_timeout (ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS) or give the node more CPU")
