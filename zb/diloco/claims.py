"""What a node claims in the run's store, and the client it writes it with: the run's fingerprint (the
first node publishes it, every later one must match), its data slot, the position its slot's data
reached, the run's progress (for live recovery) and the ids the run evicted.

Writes after an outer step are best effort: a store that restarted or failed over is written again
at the next outer step, so training never waits on it for more than BEST_EFFORT_CONNECT_S. A
restarted store is empty: the claims are put back whenever the head's store client changed (a
restarted store is always reached through a new client).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from zb.diloco import slots
from zb.elastic import runs
from zb.elastic.membership import exclude
from zb.elastic.store_state import ended_world
from zb.elastic.tcpstore import store_errors
from zb.errors import EnvironmentFailure
from zb.fingerprint import check_against, encode

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")

BEST_EFFORT_CONNECT_S = 2.0   # the most an after-step write waits for the store
FINISHED_WAIT_S = 2.0         # the most the run's end waits to say so on the store's list of runs
FINGERPRINT_KEY = "zb/run/fingerprint"


class Connect(Protocol):
    def __call__(self, wait_s: float | None = None) -> StoreClient: ...


class RunClaims:
    """This node's claims in the run's store, and the store client its writes go through (`store`: None until
    the first write, and after a failed one)."""

    def __init__(self, connect: Connect, fingerprint: dict[str, object], *, local_rank: int, local_world_size: int,
                 namespace: str = ""):
        self.connect, self.fingerprint, self.namespace = connect, fingerprint, namespace
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.store: StoreClient | None = None
        self.slot = 0
        self._claimed_in: int | None = None   # the head's store client epoch whose store holds the claims
        self._client_epoch: int | None = None  # the head's store client epoch when `store` was last trusted

    def check_fingerprint(self, follow_stripes: bool) -> int:
        """The first node publishes the run's fingerprint; every later node must match it (InvalidInput naming
        every differing key, or that the store's run has ended). `follow_stripes`: this node left
        diloco.stripes unset and takes the run's. Returns the run's stripes."""
        client = self.connect()
        published = client.compare_set(FINGERPRINT_KEY, "", encode(self.fingerprint)).decode()
        mine = dict(self.fingerprint)
        if follow_stripes:
            try:
                mine["stripes"] = json.loads(published).get("stripes", mine["stripes"])
            except (ValueError, AttributeError):
                pass  # check_against names the unreadable fingerprint
        check_against(mine, published, self._run_ended)
        runs.announce(client, self.namespace)   # for `zb status`'s list of the store's runs only
        stripes = mine["stripes"]
        assert isinstance(stripes, int)  # check_against accepted it as the run's
        return stripes

    def _run_ended(self) -> str | None:
        """How the store's run ended, when every node of its last world said goodbye (else None)."""
        world = ended_world(self.connect())
        if world is None:
            return None
        return f"every node of its last world, mesh version {world.version}, left: {', '.join(world.nodes) or 'none'}"

    def claim_slot(self, uid: str, nodes: list[str], num: int, preferred: int | None) -> int:
        self.store = self.store or self.connect()
        self.slot = slots.claim_slot(self.store, uid, nodes, num, preferred)
        return self.slot

    def data_position(self) -> dict[str, Any] | None:
        """Where the previous holder of this node's slot stopped (None: start of the shard)."""
        self.store = self.store or self.connect()
        return slots.load_position(self.store, self.slot, self.local_rank, self.local_world_size)

    def follow_client(self, store_epoch: int) -> None:
        """The head made a new store client (a restarted store, or the run moved on to the next one): so does
        this rank, at its next write."""
        if store_epoch != self._client_epoch:
            self.store, self._client_epoch = None, store_epoch

    def save_position(self, data_state: dict[str, Any] | None) -> None:
        if data_state is not None:
            self.write("record the data position", lambda store: slots.save_position(
                store, self.slot, self.local_rank, data_state, self.local_world_size))

    def reassert(self, uid: str, store_epoch: int, evicted: set[str]) -> None:
        """Put the run's fingerprint, this node's slot and the evicted ids back when the head's store client
        changed since they were written (at the first outer step, then only then: two round trips at every
        outer step would otherwise queue on a slow link)."""
        if store_epoch == self._claimed_in:
            return

        def claim(store: StoreClient) -> None:
            store.compare_set(FINGERPRINT_KEY, "", encode(self.fingerprint))
            store.compare_set(slots.slot_key(self.slot), "", uid)
            if evicted:   # diloco.evict_clipped: an id evicted stays out of the run
                exclude(store, sorted(evicted))
            if self._claimed_in is not None:   # a restarted store, or the next of the list: list the run there
                runs.announce(store, self.namespace)

        if self.write("put the run's fingerprint and this node's data slot back", claim):
            self._claimed_in = store_epoch

    def list_evicted(self, uids: list[str]) -> bool:
        """Add ids to the store's list of evicted ids, read by the leader's next resolution."""
        return self.write("list the evicted node(s) " + ", ".join(uids), lambda store: exclude(store, uids))

    def write(self, what: str, write: Callable[[StoreClient], object]) -> bool:
        """A best-effort write after an outer step. An earlier one may have dropped the client (the store
        restarted): reconnect; a failure drops it again, and the next outer step writes again. True when
        it was written."""
        try:
            # A short wait: a store that is down (restarting, or lost for good and about to be failed over) held
            # the training loop for elastic.connect_timeout per write (20 s measured for a joiner).
            self.store = self.store or self.connect(wait_s=BEST_EFFORT_CONNECT_S)
            write(self.store)
            return True
        except store_errors() + (EnvironmentFailure,) as e:
            log.warning("could not %s in the store (retried next outer step): %s", what, str(e).splitlines()[0])
            self.store = None
            return False

    def finish(self) -> bool:
        """The run reached its end: said on the store's list of runs (zb.elastic.runs), waiting at most
        FINISHED_WAIT_S for the store."""
        return runs.finish(lambda: self.store or self.connect(wait_s=BEST_EFFORT_CONNECT_S), self.namespace,
                           FINISHED_WAIT_S)
