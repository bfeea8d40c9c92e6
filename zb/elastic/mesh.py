"""ElasticDeviceMesh: a fixed local group plus per-replica global gloo groups rebuilt on the fly.

Local rank 0 of each node runs the membership protocol (zb.elastic.membership), the heartbeat
thread and the reachability listener; it broadcasts each new world to its local ranks, and every
local rank r below the run's stripe count then builds the ProcessGroupGloo of replica group r under
keys.mesh_prefix(version, r) (ranks beyond it, on a node with more local ranks than the run has
stripes, build none: zb.diloco.stripes).
See zb/elastic/__init__.py for how the DiLoCo layer uses it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from zb import events
from zb.elastic import keys, localsync
from zb.elastic.deathrattle import Deathrattle
from zb.elastic.heartbeat import Heartbeat, Liveness
from zb.elastic.identity import ensure_unique, new_token, new_uid
from zb.elastic.judge import renewed_members
from zb.elastic.listener_guard import PeerFilter, host_of, options, raise_descriptor_limit
from zb.elastic.membership import Membership
from zb.elastic.probe import ProbeListener, check_peers, gloo_address, reachable, unreachable_peers
from zb.elastic.ring import check_link_matrix, publish_link_matrix
from zb.elastic.store_state import Snapshot
from zb.elastic.stores import shared_stores
from zb.elastic.tcpstore import read_many, store_errors
from zb.elastic.view import WorldView
from zb.errors import EnvironmentFailure, InvalidInput, LeavingRun, ZbError
from zb.rendezvous_store import patient
from zb.signed_store import prefixed
from zb.store_clients import StoreUnreachable

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, TCPStore

    from zb.config_schema import ElasticConfig
    from zb.elastic.linkprobe import LinkProber
    from zb.elastic.world import World
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")

REBUILD_ATTEMPTS = 3


class EventSink(Protocol):
    def log(self, event: str, **fields: Any) -> None: ...


class ElasticDeviceMesh:
    def __init__(self, cfg: ElasticConfig, local_group: ProcessGroup | None = None, *, local_rank: int = 0,
                 stripes: int = 1, sink: EventSink | None = None, ring_backward: bool = False) -> None:
        # stripes: the replica groups of the run (diloco.stripes); local rank r < stripes builds group
        # r, and a node's ranks beyond them (it has more local ranks than the run has stripes) none.
        # ring_backward: the all-reduce sends from rank r to r - 1 (gloo's fp32 ring, measured in
        # BENCHMARKS.md "Ring order") instead of r + 1 (zb's int8 ring); the ring order follows it.
        self.ring_backward = ring_backward
        if cfg.addr is None and not cfg.host_store and local_rank == 0:
            raise InvalidInput("elastic.addr (GLOBAL_ADDR) is not set: point the node at a `zb store`")
        self.cfg, self.local_group, self.sink = cfg, local_group, sink
        self.local_rank, self.stripes = local_rank, stripes
        self.replica = local_rank if local_rank < stripes else None
        self._built = False            # this rank's part of the current groups is up (a passenger's: nothing)
        self.view: WorldView | None = None
        # This replica's ProcessGroupGloo once built; None before, and after a failure. Any: torch types a
        # ProcessGroupGloo as a Backend, and it serves as a ProcessGroup (every collective's group=).
        self.global_pg: Any = None
        self._failed = False
        self._suspects: set[int] = set()
        self._store: StoreClient | None = None   # a follower's client (local rank 0's is its membership's)
        self._store_epoch = 0
        self._deathrattle: Deathrattle | None = None
        self._heartbeat: Heartbeat | None = None
        self._probe: ProbeListener | None = None
        self._links: LinkProber | None = None  # with elastic.measure_links
        self._membership: Membership | None = None
        self._connect_timeout = cfg.connect_timeout
        self._hosted: TCPStore | None = None   # the store when this node hosts it (elastic.host_store)
        self._filter: PeerFilter | None = None   # what gloo's listener admits (zb.elastic.listener_guard)
        self.stores = shared_stores(cfg)  # elastic.addr: the run's store, or the list it fails over along
        self._failovers_told = 0       # store_failover events emitted
        self._endpoints_epoch = 1      # the head's store client epoch that holds its probe endpoint and link rows
        self.rebuild_s = 0.0           # seconds the last global group rebuild took

    def use_stripes(self, stripes: int) -> None:
        """The run's stripe count, once the node knows it (before start)."""
        self.stripes = stripes
        self.replica = self.local_rank if self.local_rank < stripes else None

    @property
    def is_joiner(self) -> bool:
        return bool(self.view and self.view.is_joiner)

    @property
    def _head(self) -> Membership:
        """Local rank 0's membership protocol (started by _start_head, before anything else uses it)."""
        assert self._membership is not None, "local rank 0 starts the membership protocol first"
        return self._membership

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> WorldView:
        """Connect, check the id, heartbeat, join (waiting for the quorum up to elastic.start_timeout),
        build the global groups. Raises ZbError (one clear line) on an expected failure."""
        before, after = raise_descriptor_limit()   # what a flood gets past elastic.peer_filter meets the largest limit
        if after != before:
            log.debug("open files: soft limit raised from %d to %d", before, after)
        payload = self._guarded(self._start_head) if self.local_rank == 0 else None
        view = self._follow(payload)
        if not self._built:              # a peer did not arrive at the first group: resolve again
            self._failed = True
            return self.resolve()
        return view

    def resolve(self) -> WorldView:
        """Outer-step boundary: admit joiners, drop leavers/dead/late nodes, rebuild groups if needed."""
        for _ in range(REBUILD_ATTEMPTS):
            self._merge_local_failures()
            payload = self._guarded(self._resolve_head) if self.local_rank == 0 else None
            view = self._follow(payload)
            if self._built:
                return view
            self._failed = True
        raise EnvironmentFailure(f"could not build the global groups in {REBUILD_ATTEMPTS} attempts; "
                                 "see the log for the peers that failed to arrive")


    def mark_finished(self, outer_step: int, step: int) -> bool:
        """Local rank 0: the run reached its end in this node's world (zb.elastic.membership.mark_finished)."""
        return self.local_rank == 0 and self._membership is not None and self._head.mark_finished(outer_step, step)

    def check_finished(self) -> None:
        """Local rank 0, between outer steps: RunFinishedWithout when the run ended in a later world than this node's
        (zb.elastic.membership.check_finished); for a node that cannot reach its next resolution."""
        if self.local_rank == 0 and self._membership is not None:
            self._head.check_finished()

    def report_failure(self, suspect: int | None = None) -> None:
        """A collective on global_pg failed; `suspect` is the group rank blamed (None: unknown)."""
        self._failed = True
        if suspect is not None:
            self._suspects.add(int(suspect))

    def shutdown(self, graceful: bool = True) -> None:
        """Stop heartbeats; with graceful, send the deathrattle so peers drop this node at once."""
        if self._deathrattle is not None:
            if graceful:
                self._deathrattle.rattle("leave")
            self._deathrattle.uninstall()
        for thread in (self._heartbeat, self._probe, self._links):
            if thread is not None:
                thread.stop()
        self._heartbeat = self._probe = self._links = None

    # -- local rank 0 --------------------------------------------------------------------------
    def host_store_if_asked(self) -> None:
        """With elastic.host_store, host a store of the run in this process (once): before anything of
        this node talks to the store, which may be itself."""
        if self.cfg.host_store and self._hosted is None:
            from zb.elastic.storehost import host_in_worker

            self._hosted = host_in_worker(self.stores.addresses)

    def _connect(self) -> StoreClient:
        return self.stores.connect(self._connect_timeout, self.cfg.store_timeout, self.cfg.namespace)

    def _connect_beating(self) -> StoreClient:
        """The heartbeat thread's client: an operation waits at most elastic.heartbeat_timeout, since a beat that
        late tells nothing, and a store that stopped answering (a cut, its host silent) is then said in the
        node's log within that time instead of after elastic.store_timeout."""
        return self.stores.connect(self._connect_timeout, min(self.cfg.store_timeout, self.cfg.heartbeat_timeout),
                                   self.cfg.namespace)

    def _start_head(self) -> dict[str, Any]:
        cfg = self.cfg
        uid, token = cfg.unique_id or new_uid(), new_token()
        from zb.log import set_uid

        set_uid(uid)
        matrix = check_link_matrix(cfg.link_matrix, uid, gloo_address()) if cfg.link_matrix else None
        self.host_store_if_asked()
        store = self._connect()
        if matrix is not None and cfg.link_matrix:   # the second is the first's condition, for the type checker
            publish_link_matrix(store, matrix, cfg.link_matrix)
        ensure_unique(store, uid, cfg.heartbeat_interval, cfg.heartbeat_timeout, cfg.polling_interval)
        self._connect_timeout = min(cfg.connect_timeout, max(1.0, cfg.heartbeat_interval))
        liveness = Liveness(cfg.heartbeat_timeout)
        self._membership = Membership(cfg, uid, token, self.stripes, liveness, self._connect,
                                      before_join=self._check_reachable, ring_backward=self.ring_backward,
                                      stores=self.stores)
        self._membership.store, self._membership.store_epoch = store, 1
        self._membership.check_same_stores(store)   # a refusal before the threads start: nothing left running
        self._start_threads(uid, token, liveness, store)
        try:
            world = self._membership.join(quorum=cfg.world_size, quorum_timeout=cfg.start_timeout)
        except StoreUnreachable as e:
            raise EnvironmentFailure(f"the store went away while this node was joining: {e}") from None
        return self._payload(world, store_ok=True)

    def _start_threads(self, uid: str, token: str, liveness: Liveness, store: StoreClient) -> None:
        self._deathrattle = Deathrattle(uid, token, self._connect)
        self._deathrattle.install()
        self._probe = ProbeListener()
        self._probe.start()
        store.set(keys.probe(uid), self._probe.endpoint)
        members = lambda: list(self._head.world.nodes) if self._head.world else []  # noqa: E731
        self._heartbeat = Heartbeat(uid, self.cfg.heartbeat_interval, liveness, self._connect_beating, self._head.watched,
                                    answered=self.stores.answered, store_index=lambda: self.stores.index)
        self._head.heartbeat = self._heartbeat
        store.add(keys.heartbeat(uid), 1)   # counter exists before the join request names it
        self._heartbeat.start()
        if self.cfg.measure_links:
            from zb.elastic.linkprobe import LinkProber

            self._links = LinkProber(uid, gloo_address(), self._connect, members, self.cfg.link_probe_seconds,
                                     store_index=lambda: self.stores.index)
            self._links.start(store)

    def _resolve_head(self) -> dict[str, Any]:
        m = self._head
        before = m.world
        assert before is not None  # the head joined at start (join sets the world or raises)
        if self._failed:
            m.failed = True
            m.suspects |= {before.nodes[r] for r in self._suspects if r < len(before.nodes)}
            m.unreachable = self._unreachable_members(before)
        try:
            world = m.resolve()
        except StoreUnreachable:
            return self._payload(before, store_ok=False)
        self._republish_endpoints()
        return self._payload(world, store_ok=True)

    def _republish_endpoints(self) -> None:
        """A store this node's head reaches through a new client (restarted empty, or the next one of the list)
        lacks the node's probe endpoint and link rows: put them back, or peers cannot tell its crash from a
        slow beat and the ring order forgets its links."""
        m = self._head
        if m.store is None or m.store_epoch == self._endpoints_epoch:
            return
        try:
            if self._probe is not None:
                m.store.set(keys.probe(m.uid), self._probe.endpoint)
            if self._links is not None:
                self._links.publish_to(m.store)
            self._endpoints_epoch = m.store_epoch
        except store_errors() as e:
            log.debug("could not publish this node's endpoints (next outer step retries): %s", e)

    def _payload(self, world: World, store_ok: bool) -> dict[str, Any]:
        m = self._head
        changed = self.view is None or world.version != self.view.mesh_version or not self._built
        view = WorldView.of(world, m.uid, m.token, changed=changed, store_ok=store_ok, store_epoch=m.store_epoch,
                            store_index=self.stores.index)
        return view.to_dict()

    def _member_endpoints(self, world: World | WorldView | None) -> dict[str, str] | None:
        """The probe endpoints (gloo address:port) the other members of `world` published; None when the store
        cannot say."""
        if world is None or self._membership is None or self._membership.store is None:
            return None
        peers = [u for u in world.nodes if u != self._membership.uid]
        try:
            raw = read_many(self._membership.store, [keys.probe(u) for u in peers])
        except store_errors():
            return None
        return {u: e.decode() for u, e in zip(peers, raw) if e}

    def _member_hosts(self, view: WorldView, endpoints: dict[str, str] | None) -> list[str] | None:
        """The gloo addresses of every member of `view` (the others' `endpoints`), this node's included: what its
        listener admits (None: one is unknown, and the listener admits every host rather than shut a member out)."""
        if endpoints is None or len(endpoints) != view.global_world_size - 1:
            return None
        assert self._probe is not None  # local rank 0 listens from its start
        hosts = [host_of(e) for e in [*endpoints.values(), self._probe.endpoint]]
        return None if None in hosts else sorted({h for h in hosts if h is not None})

    def _unreachable_members(self, world: World | WorldView | None) -> set[str]:
        """The members of `world` (a World or WorldView) this node cannot connect to (a partition, a link
        down): probed after a failed collective, for the answer to the next roll call (the judge keeps no
        two such nodes in one world), and before building the groups."""
        return self._unreachable(self._member_endpoints(world))

    def _unreachable(self, endpoints: dict[str, str] | None) -> set[str]:
        if not endpoints:
            return set()
        cut = unreachable_peers(endpoints, timeout=min(2.0, self.cfg.heartbeat_timeout / 2))
        if cut:
            log.warning("cannot connect to %s on the gloo interface: reported in its answer", sorted(cut))
        return cut

    def _check_reachable(self, snap: Snapshot) -> None:
        # A renewed member's old endpoint is closed while its new incarnation beats: not a peer to reach.
        assert snap.world is not None  # Membership checks reachability only against an existing world
        renewed = renewed_members(snap.world, snap)
        peers = [u for u in snap.world.nodes if u != self._head.uid and u not in renewed]
        endpoints = {u: e.decode() for u, e in zip(peers, read_many(self._head.client, [keys.probe(u) for u in peers]))
                     if e}
        timeout = min(5.0, self.cfg.connect_timeout)

        def live_and_unreachable(uid: str) -> bool:
            """Its counter moves, and not because a new incarnation (restarting under the id, with a new endpoint
            that answers) took over from the one whose closed endpoint was read."""
            if not self._still_beating(uid):
                return False
            now = read_many(self._head.client, [keys.probe(uid)])[0].decode()
            return now == endpoints[uid] or not reachable(now, timeout)

        check_peers(endpoints, timeout=timeout, still_alive=live_and_unreachable)

    def _still_beating(self, uid: str) -> bool:
        store = self._head.client
        first = read_many(store, [keys.heartbeat(uid)])[0]
        time.sleep(2 * self.cfg.heartbeat_interval)
        return read_many(store, [keys.heartbeat(uid)])[0] != first

    def _guarded(self, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run local rank 0's part; on failure tell the other local ranks before raising."""
        try:
            return fn()
        except ZbError as e:
            localsync.broadcast_json(self.local_group, 0, {"error": str(e), "leaving": isinstance(e, LeavingRun)})
            raise

    # -- every local rank ----------------------------------------------------------------------
    def _follow(self, payload: dict[str, Any] | None) -> WorldView:
        data = localsync.broadcast_json(self.local_group, self.local_rank, payload)
        if data.get("leaving"):
            raise LeavingRun(data["error"])
        if "error" in data:
            raise EnvironmentFailure(f"local rank 0 failed: {data['error']}")
        view = WorldView.from_dict(data)
        if self.local_rank != 0:
            self._follower_setup(view)
        if view.changed or not self._built:
            self._rebuild(view)
        if self.local_rank == 0:
            self._tell_failovers(view)
        if self.local_rank == 0 and (self.view is None or view.mesh_version != self.view.mesh_version):
            self._emit(view)
        self.view = view
        return view

    def _follower_setup(self, view: WorldView) -> None:
        if self._store is None or view.store_epoch != self._store_epoch:
            self.stores.follow(view.store_index)
            self._store = self.stores.connect(self.cfg.connect_timeout, self.cfg.store_timeout, self.cfg.namespace)
            self._store_epoch = view.store_epoch
        if self._deathrattle is None:
            self._deathrattle = Deathrattle(view.uid, view.token, self._follower_store)
            self._deathrattle.install()

    def _follower_store(self) -> StoreClient:
        assert self._store is not None, "_follower_setup connects first"
        return self._store

    def _rebuild(self, view: WorldView) -> None:
        import torch.distributed as dist

        started = time.monotonic()
        # A member this node cannot connect to would hold gloo's full-mesh connect for its own connect
        # timeout (25 s measured, past the sync deadline: every member of the pair is then evicted as
        # late and they may come back together). Not building fails this round at once instead; the
        # next answer reports the cut and the judge drops one of the pair.
        # The head reads the members' endpoints once: to probe them, and for what gloo's listener admits.
        endpoints = self._member_endpoints(view) if self.local_rank == 0 else None
        cut = self._unreachable(endpoints) if view.global_world_size > 1 else set()
        if not localsync.all_ok(self.local_group, not cut):
            log.warning("not building global group v%d: %s unreachable", view.mesh_version, sorted(cut))
            self.global_pg, self._built, self._failed = None, False, True
            self.rebuild_s = time.monotonic() - started
            return
        # Only the members' hosts may reach gloo's listener (elastic.peer_filter), set before they connect.
        hosts = self._member_hosts(view, endpoints) if self.local_rank == 0 and self.cfg.peer_filter else None
        self._filter = self._filter or PeerFilter(self.cfg.peer_filter, gloo_address())
        self._filter.admit(localsync.broadcast_json(self.local_group, self.local_rank, {"hosts": hosts})["hosts"])
        store = self._head.store if self.local_rank == 0 else self._store
        pg, ok = None, True
        if self.replica is not None:
            try:
                # patient: the members wait up to elastic.store_timeout for each other, a silent store
                # is noticed within the client's short operation timeout (zb.rendezvous_store)
                prefix = patient(prefixed(store, keys.mesh_prefix(view.mesh_version, self.replica)),
                                 self.cfg.store_timeout)
                pg = dist.ProcessGroupGloo(prefix, view.global_rank, view.global_world_size,
                                           options(gloo_address(), timedelta(seconds=self.cfg.pg_timeout)))
            except (RuntimeError,) + store_errors() as e:
                log.warning("building global group v%d failed: %s", view.mesh_version, str(e).splitlines()[0][:160])
                ok = False
        self._built = localsync.all_ok(self.local_group, ok)
        self.global_pg = pg if self._built else None
        self.rebuild_s = time.monotonic() - started
        if self._built:
            self._failed, self._suspects = False, set()

    def _merge_local_failures(self) -> None:
        size = self.view.global_world_size if self.view else 0
        self._failed, self._suspects = localsync.merge_failures(self.local_group, size, self._failed, self._suspects)

    def _tell_failovers(self, view: WorldView) -> None:
        """One store_failover event per move of this node to the next store (zb.elastic.stores)."""
        for moved in self.stores.failovers[self._failovers_told:]:
            self._failovers_told += 1
            if self.sink is not None:
                events.emit(self.sink, events.StoreFailover(
                    from_store=moved.from_store, to_store=moved.to_store, silent_s=moved.silent_s,
                    failovers=self._failovers_told, mesh_version=view.mesh_version,
                    global_world_size=view.global_world_size))

    def _emit(self, view: WorldView) -> None:
        old_leader = self.view.leader if self.view else None
        delay = f", longest delay {view.link_ms:.1f} ms" if view.link_ms is not None else ""
        ring = f", ring order by links (slowest hop {view.ring_mbps:.1f} Mbit/s{delay})" if view.ring_mbps is not None else ""
        log.info("membership: mesh v%d, world size %d, rank %d, leader %s, joined %s, left %s, died %s%s",
                 view.mesh_version, view.global_world_size, view.global_rank, view.leader, view.joined,
                 view.left, view.died, ring)
        if old_leader is not None and old_leader != view.leader:
            log.warning("new leader: %s (was %s)", view.leader, old_leader)
        if self.sink is not None:
            events.emit(self.sink, events.Membership(
                mesh_version=view.mesh_version, global_world_size=view.global_world_size, leader=view.leader,
                joined=view.joined, left=view.left, died=view.died, global_rank=view.global_rank,
                new_leader=old_leader is not None and old_leader != view.leader, nodes=view.nodes,
                ring_mbps=view.ring_mbps, link_ms=view.link_ms))
