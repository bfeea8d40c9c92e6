"""Publishing this node's status record to the run's store, without ever holding up training.

The training loop keeps logging its metrics events as before; `publish_status` wraps its sink so
that every event also updates the node's record in memory (a dict under a lock: microseconds). A
thread of its own, with its own store client, writes the record every `elastic.status_interval`
seconds, and at once after an outer step or a change of membership. A slow or unreachable store
delays only that thread; failures are logged once per outage and retried, never raised. (A store
that accepts connections and never answers holds torch's client, and so this thread, without end:
the node's exit waits for it at most CLOSE_TIMEOUT_S (SIGNALLED_CLOSE_S after a stop signal), and not
at all when the last try failed: a signalled node whose store is gone leaves at once.)
"""

from __future__ import annotations

import atexit
import importlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from zb import stop_signals
from zb.elastic import keys
from zb.elastic.stores import StoreList, shared_stores
from zb.elastic.tcpstore import store_errors
from zb.errors import ZbError
from zb.status.record import NodeStatus, encode

log = logging.getLogger("zb.status")

CLOSE_TIMEOUT_S = 3.0   # the most a node's exit waits for its last record to reach the store
SIGNALLED_CLOSE_S = 1.0  # ... when a signal stops it (a store that answers takes milliseconds)
OP_TIMEOUT_S = 5.0      # one store operation of the publisher


def publish_status(sink, cfg, *, is_head: bool):
    """`sink`, publishing the node's status too when this is a DiLoCo node's head (local rank 0) and
    elastic.status_interval > 0; else `sink` itself."""
    if cfg.diloco is None or not is_head or cfg.elastic.status_interval <= 0 or cfg.eval.only:
        return sink
    # The thread's store client needs torch.distributed: imported here, since a first import from the
    # thread while the interpreter shuts down (the atexit goodbye below) fails.
    importlib.import_module("torch.distributed")

    e = cfg.elastic
    first = "recovering" if cfg.ckpt.live_recovery and not cfg.diloco.blocking_join else "joining"
    status = NodeStatus(e.unique_id, state=first, total_steps=cfg.train.max_steps or cfg.optim.total_steps,
                        heartbeat_interval=e.heartbeat_interval, heartbeat_timeout=e.heartbeat_timeout)
    stores = shared_stores(e)
    # Under the run's namespace, beside its world and heartbeats: `zb status --namespace` reads them together.
    publisher = StatusPublisher(status, lambda: stores.connect(min(2.0, e.status_interval), OP_TIMEOUT_S,
                                                               e.namespace),
                                e.status_interval, stores=stores)
    publisher.start()
    # A node that fails before its training run owns the sink (building the model, say) still says "left".
    atexit.register(publisher.close)
    return StatusSink(sink, publisher)


class StatusSink:
    """A metrics sink that also feeds the status record; everything else goes to the wrapped sink."""

    def __init__(self, inner, publisher: StatusPublisher) -> None:
        self.inner, self.publisher = inner, publisher

    def log(self, event: str, **fields: Any):
        result = self.inner.log(event, **fields)
        self.publisher.observe({"event": event, "time": round(time.time(), 3), **fields})
        return result

    def close(self) -> None:
        try:
            self.publisher.close()
        finally:
            self.inner.close()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class StatusPublisher(threading.Thread):
    def __init__(self, status: NodeStatus, connect_fn: Callable[[], Any], interval: float,
                 stores: StoreList | None = None) -> None:
        super().__init__(name="zb-status", daemon=True)
        self.status, self.interval = status, interval
        self._connect, self._stores = connect_fn, stores
        self._index = 0                 # the store's place in elastic.addr when the client was made
        self._wake, self._closing = threading.Event(), threading.Event()
        self._store: Any = None         # a torch Store client; None until connected, and after a failure
        self._history_written = -1
        self._outage_since: float | None = None
        self.published = 0      # records written (for tests and logs)

    def observe(self, record: dict[str, Any]) -> None:
        if self.status.observe(record):
            self._wake.set()

    def run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            closing = self._closing.is_set()
            self._publish()
            if closing:
                return

    def close(self) -> None:
        """Publish the record once more as "left" and stop (bounded: a dead store cannot hold the exit;
        one that has not answered since the last try is not waited for at all)."""
        if self._closing.is_set():
            return
        self.status.end()
        self._closing.set()
        self._wake.set()
        if self.is_alive() and self._outage_since is None:
            self.join(CLOSE_TIMEOUT_S if stop_signals.requested() is None else SIGNALLED_CLOSE_S)

    def _publish(self) -> None:
        record, history, version = self.status.snapshot()
        if self._stores is not None:   # the store this node is on, and how often the run moved it along elastic.addr
            record.update(store=str(self._stores.current), failovers=len(self._stores.failovers))
        uid = record["uid"]
        try:
            index = self._stores.index if self._stores is not None else 0
            if self._store is None or index != self._index:   # none yet, or the run moved on to another store
                self._index = index
                self._store = self._connect()
                self._store.append(keys.STATUS_INDEX, uid + "\n")   # again after a store restart: it is empty
                self._history_written = -1
            if version != self._history_written:
                self._store.set(keys.status_history(uid), encode(history))
                self._history_written = version
            self._store.set(keys.status(uid), encode(record))
            self.published += 1
            if self._outage_since is not None:
                log.info("status: publishing to the store again after %.1f s", time.monotonic() - self._outage_since)
                self._outage_since = None
        except store_errors() + (ZbError,) as e:   # ZbError: an address that does not resolve (the node says so)
            self._store = None
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                # Before the first record the node itself is still reaching the store (or about to host it,
                # elastic.host_store) and says so if it cannot: no second voice then.
                level = logging.WARNING if self.published else logging.DEBUG
                log.log(level, "status: could not publish this node's status to the store (%s); training goes on, "
                        "retrying every %g s", str(e).splitlines()[0][:300], self.interval)
