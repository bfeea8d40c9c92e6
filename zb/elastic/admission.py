"""How a node gets into a world: its join request, the wait for admission, and seeding a world when the store holds
none (a fresh or restarted store) or one whose members are all gone. The half of the membership protocol
(zb.elastic.membership) that runs at start, at a rejoin and at a re-form on the next store of elastic.addr; the
other half, the roll call at every outer step, stays with Membership, which owns the store session and the world
both halves share.

- The first STANDBY joiners in line seed (zb.elastic.standby); the others wait for the world with light reads and
  read every request and heartbeat only as a backstop (_seed_pace).
- A world is seeded once the quorum asked to join (Quorum: all of it, or `least` after its grace); with a failover
  list `least` is a majority, so two stores never both start the run.
- A rejoin (this node was a member: a partition evicted it) waits until the members are reachable again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from zb.elastic import keys, standby
from zb.elastic.identity import new_token
from zb.elastic.judge import admissible_joiners, members_all_out
from zb.elastic.roll_call import RollCall, wait_key
from zb.elastic.store_state import Snapshot, encode_line, read_light, read_snapshot
from zb.elastic.tcpstore import bump, read_many, store_errors
from zb.elastic.world import Observation, World, join_fresh, next_world
from zb.errors import EnvironmentFailure

if TYPE_CHECKING:
    from zb.config_schema import ElasticConfig
    from zb.elastic.heartbeat import Liveness
    from zb.elastic.partition_watch import PartitionWatch
    from zb.store_clients import StoreClient, StoreUnreachable

log = logging.getLogger("zb.elastic")


@dataclass
class Quorum:
    """When a waiting node may seed a world: `full` nodes asked to join, or at least `least` once `grace_at`
    (monotonic) has passed."""

    full: int
    least: int
    grace_at: float
    members: frozenset[str] | None = None   # re-forming: only the last world's members count (None: anyone)

    def met(self, live: set[str], now: float) -> bool:
        count = len(live if self.members is None else live & self.members)
        return count >= self.full or (count >= self.least and now >= self.grace_at)


class Node(Protocol):
    """What the join needs of the node's membership (zb.elastic.membership.Membership): its settings and identity,
    its store session, its world and liveness table, and the steps both halves of the protocol share."""

    cfg: ElasticConfig
    uid: str
    token: str
    stripes: int
    world: World | None
    liveness: Liveness
    partition: PartitionWatch

    @property
    def client(self) -> StoreClient: ...
    def ensure_store(self) -> StoreClient: ...
    def check_same_stores(self, store: StoreClient) -> None: ...
    def answered(self) -> None: ...
    def check_snapshot(self, snap: Snapshot) -> None: ...
    def drop_store(self, e: BaseException) -> StoreUnreachable: ...
    def hold(self, world: World, raw: bytes) -> World: ...
    def observe(self, snap: Snapshot, world: World | None) -> None: ...
    def in_ring_order(self, old: World, new: World) -> World: ...
    def write_world(self, expected: bytes, new: World) -> bool: ...


class Admission:
    """The join of `node` (its Membership: the store session, the world, the liveness table it reads and writes).
    `before_join`: a check run on the store's snapshot before a join request (every member reachable)."""

    def __init__(self, node: Node, before_join: Callable[[Snapshot], None] | None = None) -> None:
        self.node, self._before_join = node, before_join
        self._seat = 1   # where this node's last join request is in line (_ask_to_join)
        self._asked_with_world = False   # ... and whether the store held a world then

    def enter(self, quorum: Quorum) -> World:
        """Ask to join at the node's current store and wait until a world holds it (seeding one when none stands and
        the quorum is there); raises StoreUnreachable through the node when the store fails."""
        try:
            store = self.node.ensure_store()
            self.node.check_same_stores(store)
            snap = read_light(store, None, world=True)
            self.node.answered()
            self.node.check_snapshot(snap)
            if snap.world is not None and self._before_join is not None:
                self._reachable_before_join(store, read_snapshot(store, None))   # its renewed members: the joins
            # The counter moves before the request names this node: on a store it reaches through a new client
            # (the next one of the list, or one restarted) its heartbeat thread may not have beaten yet, and a
            # counter the leader has read as missing for elastic.heartbeat_timeout is a dead node's.
            bump(store, keys.heartbeat(self.node.uid), 1)
            return self._wait_admitted(quorum, self._ask_to_join(store))   # it holds the world it returns
        except store_errors() as e:
            raise self.node.drop_store(e) from None

    def _ask_to_join(self, store: StoreClient) -> int:
        """Append this node's join request; returns the resolution it names (JoinRequest.seen: the request is
        admissible for JOIN_FRESH resolutions from it, so the node asks again when it grew older). Sets
        self._seat: roughly where the request is among those the world has not taken in (keys.JOIN_COUNT, a
        hint anyone can bump: a wrong one only slows seeding down to the backstop's pace)."""
        seen = World.decode(read_many(store, [keys.WORLD])[0])
        last = self.node.world
        resolution = seen.resolution if seen else 0
        store.append(keys.JOINS, encode_line({
            "uid": self.node.uid, "token": self.node.token, "pref_rank": self.node.cfg.rank,
            "last_version": last.version if last else 0,
            "last_rank": last.rank_of(self.node.uid) or 0 if last else 0, "stripes": self.node.stripes,
            "run": last.run if last else "", "seen": resolution}))
        self._seat = bump(store, keys.JOIN_COUNT, 1) - (seen.join_cursor if seen else 0)
        self._asked_with_world = seen is not None
        return resolution

    def _reachable_before_join(self, store: StoreClient, snap: Snapshot) -> None:
        """A first join fails at once on an unreachable member (a misconfigured network). A rejoin (this
        node was a member: a partition or a link down evicted it) waits for the path to come back,
        up to elastic.store_timeout: admitted now, it would break the next outer step again."""
        before_join = self._before_join
        assert before_join is not None  # join calls this only with a before_join check
        if self.node.world is None:
            before_join(snap)
            return
        give_up, warned = time.monotonic() + self.node.cfg.store_timeout, False
        while True:
            try:
                before_join(snap)
                return
            except EnvironmentFailure as e:
                if time.monotonic() >= give_up:
                    raise
                if not warned:
                    log.warning("not rejoining yet: %s; retrying until it is reachable (up to elastic.store_timeout)",
                                str(e).split(" (NAT")[0])
                    warned = True
            time.sleep(max(self.node.cfg.heartbeat_interval, 0.5))
            snap = read_snapshot(store, None)
            self.node.check_snapshot(snap)
            if snap.world is None:
                return

    def _wait_admitted(self, quorum: Quorum, seen: int) -> World:
        # Never before the quorum's grace has passed (elastic.start_timeout can exceed elastic.store_timeout):
        # a first node whose peers start slowly seeds with those present then, as start_timeout promises.
        give_up = max(time.monotonic() + self.node.cfg.store_timeout, quorum.grace_at + self.node.cfg.heartbeat_timeout)
        waiting_said = False
        # When this joiner next reads the join requests and the members' heartbeats (_seed_pace): at once for the
        # first in line, which seed; the others wait for the world (all asking at once, each would seed, its ring
        # plan included, and all but one write in vain).
        full_at = time.monotonic() + self._seed_pace(self._asked_with_world, quorum, first=True)
        while time.monotonic() < give_up:
            full = time.monotonic() >= full_at
            snap = read_snapshot(self.node.client, None) if full else read_light(self.node.client, None, world=True)
            self.node.answered()
            self.node.check_snapshot(snap)
            world = snap.world
            if world is not None and world.rank_of(self.node.uid, self.node.token) is not None:
                return self.node.hold(world, snap.raw_world)
            if world is not None and not join_fresh(seen, world.resolution):
                seen = self._ask_to_join(self.node.client)   # grown too old to be admitted: ask again
            if world is not None and world.stripes != self.node.stripes:
                raise EnvironmentFailure(f"this node's outer state is in {self.node.stripes} stripes but the run's is in "
                                         f"{world.stripes} (diloco.stripes); leave diloco.stripes unset to take the run's")
            pace = self._seed_pace(world is not None, quorum)
            if not full:
                wait_key(self.node.client, keys.written(world.resolution if world else 0), min(pace, full_at - time.monotonic()))
                continue
            full_at = time.monotonic() + pace
            self.node.observe(snap, world)
            if world is None and quorum.least > 1:
                self.node.partition.look_back(self.node.world)
            if self._may_seed(world, snap, quorum):
                self._seed(world, snap)
            elif not waiting_said and quorum.least > 1 and time.monotonic() >= quorum.grace_at:
                waiting_said = True
                log.warning("waiting for %s (up to elastic.store_timeout)", self._majority_wait(quorum))
            wait_key(self.node.client, keys.written(world.resolution if world else 0), self.node.cfg.polling_interval)
        waited = f": still waiting for {self._majority_wait(quorum)}" if quorum.least > 1 else (
            ": no live member resolved the world (are the other nodes running and reaching the store?)")
        raise EnvironmentFailure(f"not admitted within elastic.store_timeout ({self.node.cfg.store_timeout:g} s){waited}")

    def _majority_wait(self, quorum: Quorum) -> str:
        """What a node waiting for a majority at this store waits for, and why (one line's part)."""
        if self.node.world is None:
            return (f"{quorum.least} of the {quorum.full} nodes of elastic.world_size to ask to join at this store "
                    "before the run's first world forms here: with a failover list in elastic.addr, fewer could start "
                    "a second run apart from nodes that start it at another store of the list")
        return (f"{quorum.least} of the last world's {quorum.full} nodes to reach this store before the world "
                "re-forms here: fewer could train apart from nodes that still reach the earlier store")

    def _seed_pace(self, has_world: bool, quorum: Quorum, first: bool = False) -> float:
        """Seconds between a joiner's reads of every join request and heartbeat (what seeding a world needs): the
        first STANDBY joiners in line seed and read at every poll; the others, which only wait for a world that
        holds them, read a few hundred bytes at each world written (keys.written) and in full only as a
        backstop: every half heartbeat timeout while a world stands (its members all out is a seed too), and
        once the quorum's grace plus a heartbeat timeout passed with none (the first in line died)."""
        if self._seat <= standby.STANDBY:
            return 0.0 if first else self.node.cfg.polling_interval
        if has_world:
            return self.node.cfg.heartbeat_timeout / 2
        backstop = quorum.grace_at + self.node.cfg.heartbeat_timeout
        return max(self.node.cfg.heartbeat_interval, backstop - time.monotonic())

    def _may_seed(self, world: World | None, snap: Snapshot, quorum: Quorum) -> bool:
        """With no world, or one whose members are all out (a whole run restarted against a store that
        outlived it), once the quorum asked to join: as a fresh store would."""
        if world is not None and not members_all_out(world, snap, self.node.liveness):
            return False
        live = {r.uid for r in admissible_joiners(world or World(stripes=self.node.stripes), snap, self.node.liveness)}
        return quorum.met(live, time.monotonic())

    def _seed(self, world: World | None, snap: Snapshot) -> None:
        # The run's id goes on from the newest world any joiner was in; a run's first world gets a new one.
        runs = sorted((r.last_version, r.run) for r in snap.joins if r.run)
        base = world or World(stripes=self.node.stripes, run=runs[-1][1] if runs else new_token())
        joiners = admissible_joiners(base, snap, self.node.liveness)
        obs = Observation(answered=set(), gone=snap.gone, excluded=set(base.nodes), joiners=joiners,
                          join_end=len(snap.joins))
        new = self.node.in_ring_order(base, next_world(base, obs))
        if self.node.write_world(snap.raw_world, new):
            RollCall(self.node.client, base.resolution).mark_written()   # wakes the joiners that do not seed
            log.info("seeded mesh version %d with %d nodes: %s", new.version, len(new.nodes), new.nodes)
            # Every list a resolution reads exists from now on (an empty goodbye list): one key missing sends
            # each read of the snapshot down the slow path of read_many, a round trip per key.
            for key in (keys.GONE, keys.MOVED, keys.EVICTED, keys.FINISHED, keys.STAYED):
                self.node.client.append(key, "")
