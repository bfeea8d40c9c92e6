"""The run's stores: elastic.addr names one, or an ordered list the run fails over along.

`GLOBAL_ADDR=host[:port],host[:port]` (GLOBAL_PORT is the port of an entry without one). One store
is current at a time. When it has not answered for elastic.store_failover_s, every node moves to the
next address and the run re-forms there (zb.elastic.membership). The list is read by zb.addresses
(one line for an empty entry, a bad port or a store named twice). The rules are pure functions here,
tested in-process:
- `start_index`: a starting node goes to the latest address that holds this run's world (a store
  the run failed over to), else to the first that answers; a store that came back empty after the
  run moved on is thus never chosen over the one the run is on;
- `boundary_action`: what a node does at an outer step whose store does not answer: train on the
  old world (one address), wait for the store at the boundary, or move;
- `arrival`: what a node does at a store it moved to (re-form, join, or refuse another run);
- `reform_quorum`: how many of the last world must arrive before the world re-forms at a new store (a
  strict majority, so two halves of a partition never both train);
- `may_train_on`: whether a node that could not reach the store trains the next round (only with its whole world);
- `op_budget`: how long one store operation of a node may wait, so that a store that went silent (no reset)
  is noticed within elastic.store_failover_s, not after TCP's minutes.

Moves go forward only: a node never goes back to an earlier address, so a store that comes back
after the failover is ignored by every node of the run. Nodes that re-formed mark the stores they left
(keys.MOVED, `StoreList.mark_moved`): a node that stayed on a store revived at its address (its silence
was shorter than elastic.store_failover_s on that node's clock) reads the mark and follows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from zb.addresses import StoreAddress, parse_stores
from zb.elastic import keys
from zb.errors import InvalidInput, ZbError
from zb.secret import read_secret
from zb.store_clients import StoreUnreachable, run_client

if TYPE_CHECKING:
    from zb.config_schema import ElasticConfig
    from zb.elastic.store_state import Snapshot
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")
T = TypeVar("T")


def start_index(holds_run: list[bool | None]) -> int | None:
    """Where a starting node goes, from what each address held when asked (None: did not answer; True:
    this run's world; False: answered, no world of this run): the latest address holding the run's world,
    else the first that answered; None when none answered."""
    holding = [i for i, held in enumerate(holds_run) if held]
    if holding:
        return holding[-1]
    answered = [i for i, held in enumerate(holds_run) if held is not None]
    return answered[0] if answered else None


TRAIN_ON, WAIT, MOVE = "train on", "wait", "move"


def boundary_action(silent_s: float, failover_s: float, has_next: bool) -> str:
    """At an outer step whose store did not answer, after `silent_s` s without an answer from it:
    - one address (no next store): train on with the old world and try again at the next outer step;
    - a next store: wait at the boundary, asking the store again, until it has been silent for
      elastic.store_failover_s, then move. Every node waits the same way, so nodes that reach the boundary
      seconds apart still move together instead of one training on with a world the others left."""
    if not has_next:
        return TRAIN_ON
    return MOVE if silent_s >= failover_s else WAIT


REFORM, JOIN, OTHER_RUN = "re-form", "join", "another run"


def arrival(my_run: str, store_run: str | None) -> str:
    """At the store a node moved to, given the run id of the world it holds (None: no world yet):
    re-form the world there (the first nodes to arrive seed it), join the world the others formed
    there already, or refuse a store that holds another run (it must never mix two runs' nodes)."""
    if store_run is None:
        return REFORM
    if my_run and store_run and store_run != my_run:
        return OTHER_RUN
    return JOIN


OP_FLOOR_S = 5.0   # no run client's store operation times out sooner: a busy machine's store can be that slow


def op_budget(op_timeout: float, failover_s: float, failover: bool) -> float:
    """The operation timeout (and reconnect wait) of a node's store client. With a store to fail over to, a
    store machine that goes silent (every packet dropped, no reset: TCP would wait minutes) must be noticed
    within elastic.store_failover_s: a third of it, at least OP_FLOOR_S, so the boundary asks it a few times
    before it moves. With one store there is nowhere to go: elastic.store_timeout, as set."""
    if not failover:
        return op_timeout
    return min(op_timeout, max(OP_FLOOR_S, failover_s / 3))


def reform_quorum(last_world_size: int) -> int:
    """Nodes of the last world that must arrive before the world re-forms at a new store: more than half.
    A partition can cut some nodes off a store that still answers the others, who go on there; the cut-off
    nodes take its silence for its death and move. With exactly half on each side both used to train (two
    worlds, two final models); now the movers need a majority, so half of them wait instead. The side left
    on the old store follows the same rule from its end (zb.elastic.partition.drop_verdict)."""
    return last_world_size // 2 + 1


def may_train_on(store_ok: bool, synced: bool) -> bool:
    """Whether a node trains the next round after an outer step. Without its store, only the whole last
    world goes on, its all-reduce with every member done: a store outage that all nodes share must not stop
    them. A node that lost both the store and part of its world (the check-in failed) cannot tell whether
    the others go on without it (a partition cut it off the store while the rest still reach it), so it
    waits for the store instead of training apart: any change of the world needs the store."""
    return store_ok or synced


@dataclass
class Failover:
    """One move of this node to the next store."""

    from_store: str
    to_store: str
    silent_s: float        # seconds the old store had not answered any of this node's clients
    index: int             # position of the new store in elastic.addr
    from_index: int = 0    # position of the store left


@dataclass
class StoreList:
    """The stores of one node process and which one is current: every client of the process (membership,
    heartbeat, goodbyes, status, the DiLoCo node's writes) connects through it, so all follow a move."""

    addresses: list[StoreAddress]
    failover_s: float = 30.0
    secret: bytes | None = field(default=None, repr=False)   # elastic.secret_file's: every client seals its records
    index: int = 0
    failovers: list[Failover] = field(default_factory=list)
    _last_answer: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _start_lock: threading.Lock = field(default_factory=threading.Lock)
    _started: bool = False

    @property
    def current(self) -> StoreAddress:
        return self.addresses[self.index]

    @property
    def has_next(self) -> bool:
        return self.index + 1 < len(self.addresses)

    @property
    def has_other(self) -> bool:
        """More than one store: failover is on."""
        return len(self.addresses) > 1

    @property
    def text(self) -> str:
        """The list as every node of the run must name it (checked at join)."""
        return ",".join(str(a) for a in self.addresses)

    def answered(self) -> None:
        """A client of this process got an answer from the current store."""
        with self._lock:
            self._last_answer = time.monotonic()

    def silent_s(self) -> float:
        with self._lock:
            return time.monotonic() - self._last_answer

    def move(self, to: int | None = None) -> Failover:
        """Make the next address current, or address `to` (the run moved there: zb.elastic.keys.MOVED);
        forward only."""
        with self._lock:
            assert self.index + 1 < len(self.addresses), "move() only with a next store"
            silent, old = time.monotonic() - self._last_answer, self.index
            self.index = self.index + 1 if to is None else max(self.index + 1, min(to, len(self.addresses) - 1))
            self._last_answer = time.monotonic()   # the new store gets its own elastic.store_failover_s
            moved = Failover(str(self.addresses[old]), str(self.current), round(silent, 3), self.index, old)
            self.failovers.append(moved)
        if to is None:
            log.warning("store %s silent for %.1f s: moving the run to the next store, %s (%d of %d in elastic.addr)",
                        moved.from_store, silent, moved.to_store, self.index + 1, len(self.addresses))
        else:
            log.warning("the run moved on from store %s to %s (%d of %d in elastic.addr): following it",
                        moved.from_store, moved.to_store, self.index + 1, len(self.addresses))
        return moved

    def back(self, to: int, why: str) -> None:
        """Make an earlier address current again: the run's world went on there without this node, which had
        moved on alone (zb.elastic.partition.may_go_back, keys.STAYED). The only move backwards."""
        with self._lock:
            assert to < self.index, "back() only to an earlier store"
            old, self.index = self.index, to
            self._last_answer = time.monotonic()
        log.warning("going back from store %s to %s (%d of %d in elastic.addr): %s", self.addresses[old],
                    self.current, to + 1, len(self.addresses), why)

    @property
    def left(self) -> int | None:
        """The index of the store this node moved away from last, while it is still on a later one (None: it never
        moved, or it went back: chaos seed 18 had a node that went back look back at the store it was on)."""
        if not self.failovers or self.failovers[-1].from_index >= self.index:
            return None
        return self.failovers[-1].from_index

    def peek(self, index: int, namespace: str) -> Snapshot | None:
        """What store `index` holds, read through a client of its own (None: it does not answer within a few
        seconds). For looking at a store this node is not on: a later one the run may have moved to, or the
        one it left."""
        from zb.elastic.store_state import read_snapshot

        return _ask(self.addresses[index], namespace, self.secret, lambda client: read_snapshot(client, None))

    def claim(self, index: int, namespace: str, record: str) -> bool:
        """Write keys.STAYED on store `index` (zb.elastic.partition): False when it does not answer."""
        def write(client: StoreClient) -> bool:
            client.set(keys.STAYED, record)
            return True

        return _ask(self.addresses[index], namespace, self.secret, write) is not None

    def follow(self, index: int) -> None:
        """A local rank takes the store its node's head is on (never an earlier one)."""
        with self._lock:
            self.index = max(self.index, min(index, len(self.addresses) - 1))
            self._started = True

    def connect(self, connect_timeout: float, op_timeout: float, namespace: str = "") -> StoreClient:
        """A client of the current store (the first call of a process with several stores picks where to start).
        A move while it connected makes it a client of the old store: StoreUnreachable then, and the caller's
        next attempt reaches the new one. A client kept across calls checks `index` against the one it was made
        at (a store revived at an old address would otherwise keep it)."""
        if not self._started:
            self._start(connect_timeout, namespace)
        index, address = self.index, self.current
        # Bounded by the failover budget: a silent store answers nothing, and every wait on it would last the
        # whole timeout. gloo's rendezvous, which waits long for peers, wraps it (zb.rendezvous_store).
        budget = op_budget(op_timeout, self.failover_s, self.has_other)
        client = run_client(address.host, address.port, min(connect_timeout, budget), budget,
                            counters=keys.is_counter, namespace=namespace, secret=self.secret)
        if self.index != index:
            raise StoreUnreachable(f"the run moved from {address} to {self.current} while connecting")
        self.answered()
        return client

    def mark_moved(self, namespace: str, give_up_s: float) -> None:
        """Tell the earlier stores that the run moved on (keys.MOVED = the current index), in the background
        and for up to `give_up_s`: nodes that stayed on a store revived at an old address (its restart was
        slower than elastic.store_failover_s for some nodes and not for others) read it at their next
        resolution and follow, so the run never goes on as two."""
        index = self.index

        def tell() -> None:
            from zb.elastic.tcpstore import store_errors

            deadline = time.monotonic() + give_up_s
            pending = list(self.addresses[:index])
            while pending and time.monotonic() < deadline:
                address = pending[0]
                try:
                    run_client(address.host, address.port, 1.0, 5.0, counters=keys.is_counter, namespace=namespace,
                               secret=self.secret).set(keys.MOVED, str(index))
                    pending.pop(0)
                except store_errors() + (ZbError,):
                    pending.append(pending.pop(0))   # not (yet) back: the others first, then again
                    time.sleep(0.5)

        threading.Thread(target=tell, name="zb-store-moved", daemon=True).start()

    def _start(self, connect_timeout: float, namespace: str) -> None:
        """Ask every store what it holds and start where `start_index` says; a store that does not answer is
        warned about once (the run goes on without it until it answers); none answering within
        `connect_timeout` is the usual "store unreachable" failure of the connect that follows."""
        with self._start_lock:
            if self._started:
                return
            if len(self.addresses) > 1:
                deadline = time.monotonic() + connect_timeout
                while True:
                    held = [_holds_world(a, namespace, self.secret) for a in self.addresses]
                    index = start_index(held)
                    if index is not None or time.monotonic() >= deadline:
                        break
                    time.sleep(0.5)
                for address, h in zip(self.addresses, held):
                    if h is None and index is not None:
                        log.warning("store %s of elastic.addr does not answer: the run goes on without it (a failover "
                                    "to it waits for it like any silent store)", address)
                if index is None:
                    return   # none answers: the connect that follows says so; the next one asks again
                self.index = index
                if index > 0:
                    log.info("starting on store %s: it holds the run's world (the run failed over to it)", self.current)
            self._started = True


def _holds_world(address: StoreAddress, namespace: str, secret: bytes | None) -> bool | None:
    """Whether the store at `address` holds a world under `namespace` that the run has not moved on from
    (None: it does not answer)."""
    return _ask(address, namespace, secret, holds_run)


def _ask(address: StoreAddress, namespace: str, secret: bytes | None, what: Callable[[StoreClient], T]) -> T | None:
    """`what` over a client of its own to the store at `address`, None when it does not answer within a few
    seconds (a silent host, packets dropped, costs the connect's 2 s, not TCP's minutes)."""
    import socket

    from zb.elastic.tcpstore import store_errors

    try:
        socket.create_connection((address.host, address.port), timeout=2.0).close()
        client = run_client(address.host, address.port, 2.0, 5.0, counters=keys.is_counter, namespace=namespace,
                            secret=secret)
        return what(client)
    except InvalidInput:
        raise           # it answers, with a run this node may not join (another secret, or none): say so
    except store_errors() + (ZbError,):
        return None


def holds_run(client: StoreClient) -> bool:
    """Whether the store behind `client` holds a world the run has not moved on from (keys.MOVED)."""
    from zb.elastic.tcpstore import read_many

    world, moved = read_many(client, [keys.WORLD, keys.MOVED])
    return bool(world) and not moved


_shared: dict[tuple[tuple[StoreAddress, ...], str, str | None], StoreList] = {}
_shared_lock = threading.Lock()


def shared_stores(cfg: ElasticConfig) -> StoreList:
    """The process's StoreList for elastic config `cfg` (made on first use): one per process, since a node is
    one process (its other local ranks are processes of their own and follow their head's view)."""
    addresses = parse_stores(cfg.addr or "127.0.0.1", cfg.port)
    key = (tuple(addresses), cfg.namespace, cfg.secret_file)
    with _shared_lock:
        if key not in _shared:
            secret = read_secret(cfg.secret_file) if cfg.secret_file else None
            _shared[key] = StoreList(addresses, cfg.store_failover_s, secret=secret)
        return _shared[key]
