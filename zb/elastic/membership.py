"""The membership protocol of one node (its local rank 0): join, answer the roll call, lead, accept. Membership owns
the store session and the node's world; the join itself is zb.elastic.admission's.

- join (zb.elastic.admission): append a request to keys.JOINS and wait until a world holds this node (uid and
  token). With no world in the store yet (a fresh or restarted store), any waiting node seeds one once the
  quorum is there or its deadline passed; with a world whose members are all gone or dead, a joiner
  seeds the next one itself. Bounded by elastic.store_timeout.
- resolve (every outer step): answer the roll call of the current resolution, then poll. The acting
  leader (see zb.elastic.judge) writes the next world with compare_set against the exact text it
  read, so a stale leader (frozen, then woken up) can never overwrite a newer world: it finds
  itself evicted and joins again as a new member.
- a node whose own goodbye is in the store (its deathrattle fired on SIGTERM while it was still
  finishing a step) raises LeavingRun instead of answering or rejoining: the others drop it at
  once, and waiting for a resolution without it, or for an admission it can never get, would hang it;
- exclude (a generic feature: the layer above decides whom, zb.diloco with diloco.evict_clipped) lists unique
  ids in keys.EVICTED: the leader leaves them out of the next world and never admits them again, and a node
  that finds its own id there is refused by the run (InvalidInput, exit 2) instead of answering or rejoining;
- the store going away never raises out of resolve: the node keeps its current world, logs loudly
  and retries at the next call; a restarted (empty) store gets new clients, new requests, a new seed.
  With a next store in elastic.addr (zb.elastic.stores) the node instead waits at the boundary until
  the store has been silent for elastic.store_failover_s, moves to the next one and re-forms the
  world there: seeded once more than half of the last world asked to join (all of it, or a majority
  after elastic.heartbeat_timeout; zb.elastic.stores.reform_quorum), with the run's id, so a node never
  joins another run's store and the two sides of a partition never both re-form.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from zb.elastic import keys, standby
from zb.elastic.admission import Admission, Quorum
from zb.elastic.closedport import ClosedPortDetector
from zb.elastic.heartbeat import Heartbeat, Liveness, observe_counters, stall_hint
from zb.elastic.judge import RoundDeadlines, judge
from zb.elastic.partition_watch import PartitionWatch, RunMoved, RunStayed
from zb.elastic.ring import RingPlanner, apply_ring_order
from zb.elastic.roll_call import RollCall
from zb.elastic.store_state import (
    Finished,
    Snapshot,
    encode_line,
    evicted_ids,
    finished_without,
    read_light,
    read_snapshot,
)
from zb.elastic.stores import MOVE, OTHER_RUN, TRAIN_ON, StoreList, arrival, boundary_action, reform_quorum
from zb.elastic.tcpstore import read_many, reset_if_junk, store_errors
from zb.elastic.world import Observation, World, next_world
from zb.errors import EnvironmentFailure, InvalidInput, LeavingRun, RunFinishedWithout, ZbError
from zb.signed_store import holds, keep_marker
from zb.store_clients import StoreUnreachable

if TYPE_CHECKING:
    from zb.config_schema import ElasticConfig
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")


def exclude(store: StoreClient, uids: list[str]) -> None:
    """Exclude `uids` from the run for good (keys.EVICTED): the next resolution leaves them out of the world and
    no later one admits them. Appends only the ids not listed yet (a duplicate line would be harmless)."""
    listed = evicted_ids(read_many(store, [keys.EVICTED])[0])
    for uid in uids:
        if uid not in listed:
            store.append(keys.EVICTED, uid + "\n")


def refuse_if_evicted(uid: str, evicted: set[str]) -> None:
    """A node whose id the run excluded (keys.EVICTED) is refused by it: one line, exit 2."""
    if uid in evicted:
        raise InvalidInput(f"the run evicted node id {uid!r} (listed in the store's {keys.EVICTED}): it takes no "
                           "further part in this run and is not admitted again under that id; see the other nodes' "
                           "logs for why")


class Membership:
    def __init__(self, cfg: ElasticConfig, uid: str, token: str, stripes: int, liveness: Liveness,
                 connect: Callable[[], StoreClient], before_join: Callable[[Snapshot], None] | None = None,
                 ring_backward: bool = False, stores: StoreList | None = None) -> None:
        self.cfg, self.uid, self.token, self.stripes = cfg, uid, token, stripes
        self.stores = stores     # the run's stores (None: one, with no failover)
        self._told_silent = False  # the store's silence was logged (once per outage)
        self.liveness, self._connect = liveness, connect
        self.deadlines = RoundDeadlines.from_config(cfg)
        self.closed_ports = ClosedPortDetector(liveness, cfg.heartbeat_interval)
        self.store: StoreClient | None = None   # None until ensure_store, and after a failure
        self.store_epoch = 0           # bumps with every new client: other local ranks re-create theirs
        self.world: World | None = None
        self.failed = False
        self.suspects: set[str] = set()
        self.unreachable: set[str] = set()   # members this node's probe could not reach (after a failure)
        self.ring = RingPlanner(backward=ring_backward)
        self.heartbeat: Heartbeat | None = None   # this node's own, to say why it was evicted when it knows
        self._encoded: tuple[World | None, str] = (None, "")   # _text's one entry
        self._first_quorum = 1   # the initial quorum the first join was asked for (elastic.world_size)
        self.partition = PartitionWatch(cfg, stores, liveness)   # which side of a partition this node is on
        self.admission = Admission(self, before_join)   # how this node gets into a world (join, rejoin, re-form)

    def watched(self) -> list[str]:
        """Whose heartbeats this node's heartbeat thread reads (zb.elastic.standby.watched)."""
        return standby.watched(self.world, self.uid, self.liveness)

    # -- store -----------------------------------------------------------------------------
    def ensure_store(self) -> StoreClient:
        if self.store is None:
            self.store = self._connect()
            self.store_epoch += 1
            self.liveness.forget_all()
            if self.world is not None:
                # A client made after a failure: an `add` to a roll-call counter someone overwrote with junk makes
                # the store drop the connection, so the current one starts over before this client adds to it.
                reset_if_junk(self.store, keys.roll_call_events(self.world.resolution))
        return self.store

    @property
    def client(self) -> StoreClient:
        """The client of a join or a resolution under way (they call ensure_store first)."""
        assert self.store is not None, "ensure_store() comes first"
        return self.store

    def drop_store(self, e: BaseException) -> StoreUnreachable:
        self.store = None
        if self._told_silent:   # once per outage: the wait at a boundary asks again every second
            log.debug("store still unreachable: %s", str(e).splitlines()[0][:160])
        elif self.stores is not None and self.stores.has_next:
            log.error("STORE UNREACHABLE (%s): waiting at this boundary until it answers or has been silent for "
                      "elastic.store_failover_s (%g s), then moving to %s", str(e).splitlines()[0][:160],
                      self.stores.failover_s, self.stores.addresses[self.stores.index + 1])
        else:
            log.error("STORE UNREACHABLE during resolution (%s): keeping mesh version %s, training goes on, "
                      "retrying at the next outer step", str(e).splitlines()[0][:160], self.world and self.world.version)
        self._told_silent = True
        return StoreUnreachable(str(e))

    def answered(self) -> None:
        self._told_silent = False
        if self.stores is not None:
            self.stores.answered()

    # -- failover (zb.elastic.stores) ----------------------------------------------------------
    def _or_fail_over(self, attempt: Callable[[], World]) -> World:
        """`attempt`, and while the store is silent with a next one in elastic.addr: ask again at the boundary
        until it answers or elastic.store_failover_s passed, then move to the next store and re-form the world
        there (a silent next store is waited for and left the same way). Raises StoreUnreachable when there
        is no next store: the caller trains on with the old world."""
        moved_on = False   # this call moved to a later store: the ones left are marked once the world re-formed
        while True:
            try:
                world = attempt()
                if moved_on and self.stores is not None:
                    self.stores.mark_moved(self.cfg.namespace, self.cfg.store_timeout)
                return world
            except RunMoved as moved:
                assert self.stores is not None
                self.stores.move(to=moved.index)
                self.store, attempt, moved_on = None, self._reform, True
                continue
            except RunStayed as stayed:
                self.partition.go_back(stayed, self.world.run if self.world else "")
                self.store, moved_on = None, False
                attempt = lambda: self.admission.enter(Quorum(full=1, least=1, grace_at=time.monotonic()))  # noqa: E731
                continue
            except StoreUnreachable:
                if self.stores is None:
                    raise
            stores = self.stores
            action = boundary_action(stores.silent_s(), stores.failover_s, stores.has_next)
            if action == TRAIN_ON:
                raise StoreUnreachable(f"store {stores.current} does not answer")
            if action == MOVE:
                stores.move()
                self.store, attempt, moved_on = None, self._reform, True
            else:
                time.sleep(min(10 * self.cfg.polling_interval, 1.0))

    def _reform(self) -> World:
        """At the store this node just moved to: join the world the run re-formed there, or seed it."""
        last = self.world
        try:
            store = self.ensure_store()
            snap = read_snapshot(store, None)
        except store_errors() as e:
            raise self.drop_store(e) from None
        my_run = last.run if last else ""
        if arrival(my_run, snap.world.run if snap.world else None) == OTHER_RUN:
            assert snap.world is not None
            raise EnvironmentFailure(f"the next store, {self.stores.current if self.stores else '?'}, holds another "
                                     f"run (run id {snap.world.run}, this run's is {my_run}): a standby store of "
                                     "elastic.addr must serve this run alone (or use another elastic.namespace)")
        # Only the last world's members count: a node dropped from an earlier world arriving too must not make a
        # majority of a world it was not in (the side left on the store may hold the majority of that world). A
        # node that moved before it was ever admitted counts the run's initial quorum instead (elastic.world_size):
        # the store it left may only have been slow for it, and the others may seed the run's first world there.
        size = len(last.nodes) if last else self._first_quorum
        quorum = Quorum(full=size, least=reform_quorum(size), grace_at=time.monotonic() + self.cfg.heartbeat_timeout,
                        members=frozenset(last.nodes) if last else None)
        return self.admission.enter(quorum)

    # -- joining -----------------------------------------------------------------------------
    def join(self, quorum: int, quorum_timeout: float) -> World:
        """Register and wait for admission; raises EnvironmentFailure after elastic.store_timeout (with a
        next store: moves there when this one stays silent)."""
        # With a failover list the run's first world needs a majority of the initial quorum at one store, even
        # after quorum_timeout: a node that did not hear from the first store in time (a slow machine, a cut
        # link) starts at, or moves to, the next one, and with fewer it would start a second run there while the
        # others start the first one where they are (two disjoint majorities of one quorum cannot exist).
        self._first_quorum = quorum
        seed = Quorum(full=quorum, least=self._least(quorum), grace_at=time.monotonic() + quorum_timeout)
        return self._or_fail_over(lambda: self.admission.enter(seed))

    def check_same_stores(self, store: StoreClient) -> None:
        """Every node of a run names the same stores in the same order: else they would fail over apart. Checked
        at every join (a store moved to holds no list yet) and at start, before any thread of the node runs."""
        if self.stores is None or not self.stores.has_other:
            return
        mine = self.stores.text
        held = store.compare_set(keys.STORES, "", mine).decode()
        if held != mine:
            raise InvalidInput(f"elastic.addr (GLOBAL_ADDR) names the stores {mine} but the run's nodes name {held}: "
                               "every node must list the same stores in the same order")

    def observe(self, snap: Snapshot, world: World | None) -> None:
        cursor = world.join_cursor if world else 0
        uids = {r.uid for r in snap.joins[cursor:] if r.uid} | set(world.nodes if world else [])
        observe_counters(self.client, self.liveness, sorted(uids))

    def _text(self, world: World) -> str:
        """world.encode(), kept for the world last asked about: a member compares the store's record with its own at
        every read of it, and encoding a world of 1,000 members takes milliseconds (worlds are never changed once
        written or accepted)."""
        if self._encoded[0] is not world:
            self._encoded = (world, world.encode())
        return self._encoded[1]

    def write_world(self, expected: bytes, new: World) -> bool:
        """compare_set against the exact text read: only one writer per resolution can win."""
        text = new.encode()
        return self.client.compare_set(keys.WORLD, expected.decode(), text).decode() == text

    # -- resolving -----------------------------------------------------------------------------
    def resolve(self) -> World:
        """The next world (this node in it); raises StoreUnreachable if the store cannot be reached (with a
        next store: only if it cannot be reached either).

        A client that fails is re-created once at once: a store restarted at the same address is
        then used in the same call instead of one outer step later.
        """
        try:
            return self._or_fail_over(self._resolve)
        except StoreUnreachable:
            return self._or_fail_over(self._resolve)

    def _resolve(self) -> World:
        try:
            store = self.ensure_store()
            # What the start of a resolution needs, without the join requests and answers whose size grows with
            # the run (a judge reads those in the roll call), nor the world when its roll call is open: no world
            # written after it (keys.written) and one in the store (a restarted store has none). A world copied
            # over it meanwhile (a replay), or one forged, is the judges' to write back (_restored).
            if self.world is not None:
                light = read_light(store, self.world.resolution)
                self.answered()
                self.check_snapshot(light)
                if not light.written and light.has_world:
                    return self._roll_call(self.world, start=light)
            snap = read_light(store, None, world=True)
            self.answered()
            self.check_snapshot(snap)
            if self.world is not None and self._restored(snap, self.world):
                return self._roll_call(self.world)
            if snap.world is None or snap.world.rank_of(self.uid, self.token) is None:
                return self._rejoin("the store restarted" if snap.world is None else "evicted while away")
            assert self.world is not None  # resolve follows a join, which set it (or raised)
            if snap.world.resolution > self.world.resolution:
                # A newer world that holds this node (its token, above): the resolution ended while this node's
                # connection failed mid-way (a leader whose housekeeping after its write hit a counter someone
                # junked). It is this outer step's world, as for every other member.
                return self._accept(snap.world, snap.raw_world)
            if snap.raw_world.decode() != self._text(self.world):
                return self._rejoin("the world moved on without this node")
            return self._roll_call(self.world)
        except store_errors() as e:
            raise self.drop_store(e) from None

    def _rejoin(self, why: str) -> World:
        hint = ""
        if self.heartbeat is not None and "evicted" in why:
            gap, outage = self.heartbeat.take_worst_gap()
            hint = stall_hint(gap, self.cfg.heartbeat_timeout, outage)
        log.warning("rejoining (%s); last mesh version %d%s", why, self.world.version if self.world else 0, hint)
        quorum = len(self.world.nodes) if self.world else 1
        # With a failover list a store revived at its address is seeded by a majority of the world, as a new one
        # is: else a few nodes that saw it come back could train there apart from the rest, who moved on.
        return self.admission.enter(Quorum(full=quorum, least=self._least(quorum), grace_at=time.monotonic() + self.cfg.sync_deadline))

    def _least(self, size: int) -> int:
        """The fewest of `size` nodes that may seed a world at a store: with a failover list a majority (fewer could
        train apart from nodes at another store of the list), else one."""
        return reform_quorum(size) if self.stores is not None and self.stores.has_other else 1

    def _roll_call(self, world: World, start: Snapshot | None = None) -> World:
        """Answer the roll call of `world` and wait for its next world (judging it when in line). `start`: what
        the resolution's start read (read_light, the roll call still open): a member not in line then waits for
        the roll call's end at once instead of reading the same few keys again (of its 8 requests, 2 more)."""
        roll_call = RollCall(self.client, world.resolution)
        roll_call.answer(encode_line({
            "uid": self.uid, "token": self.token, "failed": self.failed, "suspects": sorted(self.suspects),
            "unreachable": sorted(self.unreachable)}))
        self.failed, self.suspects, self.unreachable = False, set(), set()
        t0, late_judged, told, woke = time.monotonic(), float("-inf"), False, False
        out: set[str] = set()   # members said goodbye or evicted, as last read
        while True:
            since = time.monotonic() - t0
            late = since > self.cfg.sync_deadline and time.monotonic() - late_judged >= self.cfg.heartbeat_interval
            # `told`: the roll call's end was announced but the world is this one (a replay written over, or a
            # wake-up someone else set): judge, whose waits are bounded, instead of waking again at once.
            if not late and not told and not standby.judges(world, self.uid, self.liveness, out):
                # Not in line to lead: wait for the roll call's end with a few hundred bytes a read
                # (zb.elastic.standby), the world itself read once it is written (at once after a wake-up).
                if start is not None:
                    light, start = start, None   # read just before this node answered: used once
                else:
                    light = read_light(self.client, world.resolution, world=woke)
                    self.check_snapshot(light)
                out = standby.out_of(world, light)
                if woke:   # keys.written is set: this read had the world
                    if light.raw_world.decode() != self._text(world) and not self._restored(light, world):
                        return self._accept(light.world, light.raw_world)
                    told = True
                    continue
                # keys.ENDED says the roll call ended (its hint, read anyway): read the world next; else wait for it.
                # Whether keys.written is set decides, so a junk keys.ENDED costs a read, never a busy loop.
                woke = light.written or roll_call.wait_written(self.cfg.heartbeat_interval)
                continue
            start = None   # judging reads everything: a later wait reads its light keys anew
            if late:
                late_judged = time.monotonic()
            snap = read_snapshot(self.client, world.resolution)
            self.check_snapshot(snap)
            out = standby.out_of(world, snap)
            if snap.raw_world.decode() != self._text(world) and not self._restored(snap, world):
                return self._accept(snap.world, snap.raw_world)
            self.observe(snap, world)
            # Members that answered too: a leader can crash between its answer and its write.
            self.closed_ports.check(self.client, [m for m in world.nodes if m != self.uid])
            verdict = judge(world, snap, self.uid, self.liveness, time.monotonic() - t0, self.deadlines)
            if verdict.acting_leader == self.uid and verdict.settled:
                silent = self.partition.may_drop(self.client, world, snap, verdict.observation, time.monotonic() - t0)
                if silent is not None:
                    self._lead(world, snap, verdict.observation, silent)
                    continue
            roll_call.wait_event(snap.events + max(1, verdict.pending), self.cfg.polling_interval)

    def _restored(self, snap: Snapshot, world: World) -> bool:
        """The store's world is not the run's, and this node's world was written back in its place (compare_set
        against what was read) for the roll call to go on, instead of every node taking it. True when it was:
        - a replay: an older world of this run that holds this node, a sealed record copied back over the current
          one (the seal is bound to the key and the run, not to the resolution). A member's world never goes back.
        - no world at all, though the key is there: junk, or a record someone without the run secret wrote (it
          reads as absent). Read as a restarted store's, it made a node rejoin and seed a world of its own while
          the others trained on in theirs: the key is there, so the store did not restart.
        False for anything else: a newer world, another run's, or none (a restarted store, whose world is
        re-seeded; with a failover list by a majority)."""
        old = snap.world
        if old is None:
            if not snap.raw_world and not holds(self.client, keys.WORLD):
                return False
            log.warning("the store's world record is no world (junk, or written by someone without the run "
                        "secret): written over with the current world")
        # Only a world this node is in, with its token, of the same run: after a store restart the others re-seed
        # the run at a low resolution without it, and it must rejoin that world, not write its own over it.
        elif old.resolution >= world.resolution or old.run != world.run or old.rank_of(self.uid, self.token) is None:
            return False
        else:
            log.warning("the store's world is resolution %d, older than this node's %d: a replayed record, written "
                        "over with the current world", old.resolution, world.resolution)
        self.write_world(snap.raw_world, world)
        return True

    def mark_finished(self, outer_step: int, step: int) -> bool:
        """The run reached its end in this node's world: say so on the store (keys.FINISHED, the first node's
        record stays), so a node of an older world that comes back stops instead of training on alone. Best
        effort: False when the store did not take it."""
        world = self.world
        if world is None or not world.run:
            return False
        record = Finished(world.run, world.version, outer_step, step, round(time.time(), 3))
        try:
            self.client.compare_set(keys.FINISHED, "", record.encode())
            return True
        except store_errors() + (ZbError,) as e:
            log.warning("could not mark the run finished on the store: %s", str(e).splitlines()[0])
            return False

    def check_snapshot(self, snap: Snapshot) -> None:
        """Every snapshot read: this node did not say goodbye, the run did not evict it or finish without it, and
        the run has not moved on from this store."""
        self._check_not_leaving(snap)
        refuse_if_evicted(self.uid, snap.evicted)
        self._check_finished(snap.finished)
        if snap.moved is not None and self.stores is not None and snap.moved > self.stores.index:
            raise RunMoved(snap.moved)
        self.partition.check_arrival(snap, self.world)

    def check_finished(self) -> None:
        """What every snapshot read checks of the run's end (keys.FINISHED), read alone: for a node that cannot reach
        its next resolution (a DiLoCo-SWARM first-stage worker whose later stages have all left). Never connects;
        a store that does not answer tells nothing. Only while no join or resolution is under way: it uses their
        client."""
        store = self.store
        if store is None:
            return
        try:
            raw = read_many(store, [keys.FINISHED])[0]
        except store_errors() + (ZbError,) as e:
            log.debug("could not read the run's end from the store: %s", str(e).splitlines()[0])
            return
        self._check_finished(Finished.decode(raw))

    def _check_finished(self, done: Finished | None) -> None:
        """RunFinishedWithout when the run ended in a later world than this node's (finished_without)."""
        if done is None or not finished_without(done, self.world):
            return
        raise RunFinishedWithout(
            f"the run finished without this node: its other nodes ended it at {done.where_and_when()}, in mesh "
            f"version {done.version} (this node's last was {self.world.version if self.world else 0}); the final "
            "model is in their checkpoints. This node stops without saving a final model of its own")

    def _check_not_leaving(self, snap: Snapshot) -> None:
        if (self.uid, self.token) in snap.gone:
            raise LeavingRun("this node said goodbye (deathrattle sent): it leaves the run instead of "
                             "taking part in the outer step")

    def _accept(self, new: World | None, raw: bytes) -> World:
        """Take `new`, read from the store as `raw`, as this node's world (or rejoin when it is not in it)."""
        if new is None or new.rank_of(self.uid, self.token) is None:
            log.warning("this node is not in mesh version %s (evicted: late, silent or blamed)",
                        new.version if new else "-")
            return self._rejoin("evicted")
        return self.hold(new, raw)

    def hold(self, world: World, raw: bytes) -> World:
        """`world` (read from the store as `raw`) is this node's from now on; its record as read is what the next
        reads compare with (_text), never encoded again."""
        self.world, self._encoded = world, (world, raw.decode())
        return world

    def in_ring_order(self, old: World, new: World) -> World:
        return apply_ring_order(old, new, self.ring.plan(self.client, new.nodes))

    def _lead(self, world: World, snap: Snapshot, obs: Observation, silent: dict[str, int]) -> None:
        new = self.in_ring_order(world, next_world(world, obs))
        new.silent = {m: v for m, v in sorted(silent.items()) if m not in new.nodes}   # back: no longer silent
        if self.write_world(snap.raw_world, new):
            roll_call = RollCall(self.client, world.resolution)
            roll_call.announce()
            roll_call.mark_written()
            if world.resolution >= 2:
                RollCall(self.client, world.resolution - 2).forget(len(world.nodes))
            keep_marker(self.store)   # one operation a resolution: a deleted marker is back for the next joiner
        else:
            log.info("another node wrote resolution %d first", new.resolution)
