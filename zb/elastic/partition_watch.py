"""Which side of a partition this node is on, as its membership meets one (the rule: zb.elastic.partition).

Four moments, each a method of `PartitionWatch`, the one per node that keeps what they need between calls:
- `may_drop`: the leader of the current store is about to write a world without members that went silent:
  it goes on, or, keeping no majority with a later store in elastic.addr, waits, follows the run to a
  later store (RunMoved) or claims the later stores and goes on;
- `check_arrival`: every snapshot read; a store claimed for a newer world sends a mover back (RunStayed);
- `look_back`: a mover waiting at the store it moved to for a majority that does not come looks at the
  store it left (RunStayed when the run went on there without it);
- `go_back`: back to that store once it answers.
The membership (zb.elastic.membership) raises and catches RunMoved and RunStayed around its joins and
resolutions; every look at another store goes through the node's StoreList (its own short-lived client).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from zb.elastic import keys
from zb.elastic.partition import (
    FOLLOW,
    GO,
    DropVerdict,
    drop_verdict,
    may_go_back,
    needs_look,
    settle_s,
    stale_arrival,
)
from zb.elastic.store_state import Snapshot, Stayed
from zb.errors import EnvironmentFailure

if TYPE_CHECKING:
    from zb.config_schema import ElasticConfig
    from zb.elastic.heartbeat import Liveness
    from zb.elastic.stores import StoreList
    from zb.elastic.world import Observation, World
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")

LOOK_EVERY_S = 2.0   # how often a node looks at another store of elastic.addr while a partition decides its side


class RunMoved(Exception):
    """The store read says the run moved on to a later store of elastic.addr (keys.MOVED): follow it."""

    def __init__(self, index: int) -> None:
        super().__init__(f"the run moved on to store {index + 1} of elastic.addr")
        self.index = index


class RunStayed(Exception):
    """The run went on at an earlier store of elastic.addr without this node, which moved on (keys.STAYED, or
    the store it left answering with a newer world): go back there and rejoin (zb.elastic.partition)."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(why)
        self.index = index


def holds_this_run(snap: Snapshot | None, world: World, silent: dict[str, int]) -> bool | None:
    """Whether a later store (its snapshot; None: no answer) holds this run: its world, not moved on, or a join
    request from a node gone silent (`silent`: with the version of the last world it was in), naming this run
    and that world or a later one (an older request there, of a node that went back, is not this partition's)."""
    if snap is None:
        return None
    if snap.world is not None and snap.world.run == world.run and not snap.moved:
        return True
    return any(r.uid in silent and r.run == world.run and r.last_version >= silent[r.uid] for r in snap.joins)


class PartitionWatch:
    def __init__(self, cfg: ElasticConfig, stores: StoreList | None, liveness: Liveness) -> None:
        self.cfg, self.stores, self.liveness = cfg, stores, liveness
        self._held_since: float | None = None      # a leader keeping a world a silent majority may have left
        self._looked: tuple[float, DropVerdict] | None = None   # the last look at the later stores, and its verdict
        self._looked_back = 0.0                    # when a mover last looked at the store it left

    # -- the leader, before it drops silent members ----------------------------------------------------------
    def may_drop(self, client: StoreClient, world: World, snap: Snapshot, obs: Observation,
                 since: float) -> dict[str, int] | None:
        """Whether the leader may write the next world now, as that world's record of the members dropped for
        silence (World.silent); None: not now. It may, unless it would drop silent members while keeping no more
        than half of the world and of those dropped for silence before, with a later store they may have moved
        to. Then it waits, follows the run to a later store (RunMoved, after marking keys.MOVED on `client`'s
        store), or claims the later stores and goes on (the claim covers them from then on: an empty record).
        `since`: seconds since this node reached the boundary."""
        stores = self.stores
        if stores is None or not stores.has_next:
            return {}
        proven = {m for m in world.nodes if (m, world.tokens.get(m, "")) in snap.gone or m in snap.evicted
                  or self.liveness.proven_dead(m)}
        said_goodbye = {uid for uid, _ in snap.gone}
        earlier = {m: v for m, v in world.silent.items()
                   if m not in world.nodes and m not in said_goodbye and m not in snap.evicted}
        now_silent = {m: world.version for m in world.nodes if m in obs.excluded and m not in obs.answered
                      and m not in proven and self.liveness.silent_for(m) > 2 * self.cfg.heartbeat_interval}
        silent = earlier | now_silent
        # This side: the members that answered here, late ones included (under load a member may miss the sync
        # and be dropped as late, yet it is on this store, not at a later one with the silent ones).
        kept = [m for m in world.nodes if (m not in obs.excluded or m in obs.answered) and m not in proven]
        # Those dropped for silence earlier count too: a side that keeps a majority at each of two drops in a row
        # (4 -> 3 -> 2) keeps only half of the world the first ones left, and they and the second may meet at a
        # later store as a majority of that world.
        counted = len(world.nodes) - len(proven) + len(earlier)
        if not now_silent or not needs_look(counted, len(kept), len(silent), has_later=True):
            self._held_since, self._looked = None, None
            return silent
        silence = min(self.liveness.silent_for(m) for m in now_silent)
        verdict = self._look_later(world, silent, counted, len(kept), silence, since)
        if verdict.action == FOLLOW:
            assert verdict.to is not None
            log.warning("%d of mesh version %d's %d nodes went silent and the run is on store %s: following it",
                        len(now_silent), world.version, len(world.nodes), stores.addresses[verdict.to])
            client.set(keys.MOVED, str(verdict.to))   # the others here follow too, at their next read
            raise RunMoved(verdict.to)
        if verdict.action == GO and self._claim_later(world):
            log.warning("%d of mesh version %d's %d nodes went silent and no later store of elastic.addr holds the "
                        "run: training on without them (they are gone, or cut off from every store)",
                        len(now_silent), world.version, len(world.nodes))
            self._held_since, self._looked = None, None
            return {}
        self._hold(world, now_silent, len(kept), counted, verdict)
        return None

    def _hold(self, world: World, now_silent: dict[str, int], kept: int, counted: int, verdict: DropVerdict) -> None:
        """Say once what the leader waits for; after elastic.store_timeout of it, stop (exit 1)."""
        if self._held_since is None:
            self._held_since = time.monotonic()
            log.warning("keeping mesh version %d: %d of its %d nodes (%s) went silent, and with %d left this side is "
                        "no majority of the %d it counts; they may have moved to a later store of elastic.addr, so it "
                        "waits for %s before training on without them (up to elastic.store_timeout)", world.version,
                        len(now_silent), len(world.nodes), ", ".join(sorted(now_silent)), kept, counted,
                        verdict.why or "the later stores")
        elif time.monotonic() - self._held_since > self.cfg.store_timeout:
            raise EnvironmentFailure(f"{len(now_silent)} of mesh version {world.version}'s {len(world.nodes)} nodes "
                                     "went silent, leaving no majority here, and for elastic.store_timeout "
                                     f"({self.cfg.store_timeout:g} s) the later stores of elastic.addr could not tell "
                                     "whether they went on there: this node stops (its checkpoints stay) rather than "
                                     "train apart; start it again once the stores answer")

    def _look_later(self, world: World, silent: dict[str, int], counted: int, kept: int, silence: float,
                    since: float) -> DropVerdict:
        """What the later stores show of this run (at most every LOOK_EVERY_S): its world there, or a join
        request of a member gone silent. `silence`: how long the members dropped now have been silent."""
        now = time.monotonic()
        if self._looked is not None and now - self._looked[0] < LOOK_EVERY_S:
            return self._looked[1]
        stores = self.stores
        assert stores is not None   # may_drop looks only with later stores
        need_silence, need_since = settle_s(stores.failover_s, self.cfg.sync_deadline, self.cfg.heartbeat_timeout)
        settled = silence >= need_silence and since >= need_since
        first = stores.index + 1
        later = [holds_this_run(stores.peek(i, self.cfg.namespace), world, silent)
                 for i in range(first, len(stores.addresses))]
        verdict = drop_verdict(counted, kept, len(silent), settled, later, first)
        self._looked = (time.monotonic(), verdict)
        return verdict

    def _claim_later(self, world: World) -> bool:
        """keys.STAYED on every later store, before the world without the silent members is written: one of them
        arriving there later goes back instead of re-forming apart. False when a store did not take it."""
        stores = self.stores
        assert stores is not None
        record = Stayed(world.run, stores.index, world.version + 1).encode()
        return all(stores.claim(i, self.cfg.namespace, record) for i in range(stores.index + 1, len(stores.addresses)))

    # -- a mover ----------------------------------------------------------------------------------------------
    def check_arrival(self, snap: Snapshot, last: World | None) -> None:
        """At every snapshot read: RunStayed when this store holds a claim (keys.STAYED) that the run went on at an
        earlier store in a newer world than `last`, the one this node left (zb.elastic.partition.stale_arrival)."""
        stores, stayed = self.stores, snap.stayed
        if stores is not None and last is not None and stayed is not None and stale_arrival(
                stayed, last.run, last.version, stores.index):
            raise self._stayed(stayed.index, stayed.version, last)

    def _stayed(self, index: int, version: int, last: World) -> RunStayed:
        assert self.stores is not None
        return RunStayed(index, f"the run went on at store {self.stores.addresses[index]} without this node (mesh "
                                f"version {version}; this node left version {last.version})")

    def look_back(self, last: World | None) -> None:
        """A mover waiting for a majority at the store it moved to (`last`: the world it left): when the store it
        left answers with the run's world grown past that one, the others went on there without it (it was the
        one cut off): RunStayed, to go back instead of waiting for nodes that never come
        (zb.elastic.partition.may_go_back)."""
        stores = self.stores
        left = stores.left if stores is not None else None
        if stores is None or left is None or last is None or time.monotonic() - self._looked_back < LOOK_EVERY_S:
            return
        self._looked_back = time.monotonic()
        snap = stores.peek(left, self.cfg.namespace)
        if snap is None or snap.world is None:
            return
        if may_go_back(last.run, last.version, snap.world.run, snap.world.version,
                       snap.moved is not None and snap.moved > left):
            raise self._stayed(left, snap.world.version, last)

    def go_back(self, stayed: RunStayed, run: str) -> None:
        """Back to the earlier store the run (`run`) went on at without this node, once it answers with the run's
        world (up to elastic.store_timeout: then exit 1, the checkpoints kept)."""
        stores = self.stores
        assert stores is not None   # RunStayed comes from a failover list's stores
        give_up = time.monotonic() + self.cfg.store_timeout
        while True:
            snap = stores.peek(stayed.index, self.cfg.namespace)
            if snap is not None and snap.world is not None and snap.world.run == run:
                stores.back(stayed.index, str(stayed))
                return
            if time.monotonic() >= give_up:
                raise EnvironmentFailure(f"{stayed}, and store {stores.addresses[stayed.index]} has not answered this "
                                         f"node for elastic.store_timeout ({self.cfg.store_timeout:g} s): it stops "
                                         "(its checkpoints stay); start it again to rejoin the run")
            time.sleep(LOOK_EVERY_S)
