"""Reading a run from its store: one document with every node's state and figures, and the run's.

Read-only: the reader never writes a key. One refresh costs ten store operations whatever the
number of nodes (checks and multi_gets for the membership keys, the index, then every record and
heartbeat counter at once; a few more only while keys are missing); a dashboard's refresh adds two
for the histories that changed, at most `history_budget` of them (see scripts/bench_status.py).
Liveness is judged as the mesh judges it (zb.elastic.heartbeat): on this process's own clock, by
when a node's heartbeat counter was last seen changing; so a reader that has watched for less than
a heartbeat interval cannot know an age yet (`sample` watches for one).

A run in a namespace (elastic.namespace: several runs on one store) is read under that prefix, where its
nodes keep their world, heartbeats and status records; zb.status.listing lists the runs of a store.

A run with several stores (elastic.addr `host:port,host:port`, in failover order) is read from the
one it is on: `open_reader` asks each store whether it holds a world and picks by the rule the nodes
start by (zb.elastic.stores.start_index); a store that does not answer is listed, not fatal.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from zb.addresses import StoreAddress
from zb.elastic import keys
from zb.elastic.store_state import Finished, read_snapshot
from zb.elastic.stores import holds_run, start_index
from zb.elastic.tcpstore import read_lines, store_errors
from zb.elastic.world import World
from zb.errors import EnvironmentFailure, InvalidInput, ZbError
from zb.signed_store import for_reading, holds_secret, prefixed, read_marker
from zb.status.record import decode_history, decode_record
from zb.store_clients import asking_client, quiet_stderr, reading_client

DEFAULT_HB_INTERVAL, DEFAULT_HB_TIMEOUT = 2.0, 10.0


class NoRun(EnvironmentFailure):
    """The store answers but holds no zb run (yet), or another program's keys."""


def open_reader(addresses: list[StoreAddress], timeout: float, secret: bytes | None = None,
                namespace: str = "") -> RunReader:
    """A reader of the run on `addresses` (elastic.addr's list, in failover order), in `namespace` (elastic.namespace;
    "" the store's root). One address: its store,
    as zb.store_clients.reading_client opens it. Several: each is asked at once whether it holds the run's world (holds_run), and the
    run is read from the one zb.elastic.stores.start_index picks (the latest holding a world, else the first
    that answers), as a starting node picks it. As the nodes do, a store whose port refuses is one that
    does not answer; the stores are asked again until one answers or `timeout` s pass (then one
    EnvironmentFailure line)."""
    if len(addresses) == 1:
        only = addresses[0]
        return RunReader(reading_client(only.host, only.port, timeout, counters=keys.is_counter, secret=secret),
                         str(only), secret=secret, namespace=namespace)
    deadline = time.monotonic() + timeout
    with quiet_stderr():   # torch's client logs C++ frames on its way to an error
        while True:
            found = _ask_stores(addresses, timeout, deadline, secret, namespace)
            held = [None if f is None else f[1] for f in found]
            index = start_index(held)
            if index is not None or time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    if index is None:
        raise EnvironmentFailure(f"stores {','.join(str(a) for a in addresses)} unreachable after {timeout:g} s "
                                 "(none of them answers); is `zb store` running there? check --store")
    client = found[index]
    assert client is not None   # start_index picks a store that answered
    reader = RunReader(client[0], str(addresses[index]), secret=secret, namespace=namespace)
    reader.stores = [{"address": str(a), "answers": h is not None, "holds_run": h} for a, h in zip(addresses, held)]
    return reader


def _ask_stores(addresses: list[StoreAddress], timeout: float, deadline: float,
                secret: bytes | None, namespace: str = "") -> list[tuple[Any, bool] | None]:
    """(client, holds a world) of each address, asked in parallel; None where it did not answer by `deadline`
    (a refused or unresolvable address is None at once; one that never replies is left to its daemon thread)."""
    found: list[tuple[Any, bool] | None] = [None] * len(addresses)
    refused: list[InvalidInput] = []       # a store of a run with another secret (or one while we have none)

    def ask(i: int, address: StoreAddress) -> None:
        answer_s = max(0.1, deadline - time.monotonic())
        try:
            client = asking_client(address.host, address.port, timeout, answer_s, counters=keys.is_counter,
                                   secret=secret)
            found[i] = (client, holds_run(prefixed(client, namespace) if namespace else client))
        except InvalidInput as e:
            refused.append(e)
        except (OSError, ZbError) + store_errors():
            pass

    threads = [threading.Thread(target=ask, args=(i, a), name=f"zb-status-ask-{a}", daemon=True)
               for i, a in enumerate(addresses)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.1, deadline - time.monotonic()))
    if refused:
        raise refused[0]
    return list(found)


class RunReader:
    """Reads the run; remembers heartbeat counters across refreshes to judge liveness on its own clock.
    `store`: a client of the store's root; `secret`: the one it was opened with (zb.signed_store.for_reading), if
    any; `namespace`: the run's elastic.namespace ("" the root), under which every key of the run is read."""

    def __init__(self, store, where: str, history_budget: int = 64, secret: bytes | None = None,
                 namespace: str = "") -> None:
        self.where, self.history_budget, self.secret, self.namespace = where, history_budget, secret, namespace
        self._plain = store.inner if holds_secret(store) else store    # the client under the sealing, if any
        self.store = self._under_namespace(store)
        # The run's stores as open_reader found them when it picked this one (one store: only this one).
        self.stores: list[dict[str, Any]] = [{"address": where, "answers": True, "holds_run": None}]
        self._hist_seen: dict[str, int | None] = {}    # uid -> history_version last read
        self._hist_read: dict[str, float] = {}         # uid -> when it was last read (monotonic)
        self._beats: dict[str, tuple[bytes, float | None, float]] = {}   # uid -> (value, changed at, first seen)

    # -- heartbeats ------------------------------------------------------------------------------
    def _observe(self, uids: list[str], values: list[bytes]) -> None:
        now = time.monotonic()
        for uid, value in zip(uids, values):
            old = self._beats.get(uid)
            if old is None:
                self._beats[uid] = (value, None, now)
            elif old[0] != value:
                self._beats[uid] = (value, now, old[2])

    def sample(self, uids: list[str], window: float, poll: float = 0.1) -> None:
        """Watch the counters of `uids` for up to `window` s, until each was seen changing."""
        deadline = time.monotonic() + window
        while True:
            waiting = self.watch_beats(uids)
            if not waiting or time.monotonic() >= deadline:
                return
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))

    def watch_beats(self, uids: list[str]) -> list[str]:
        """Read the counters of `uids` once; the ids not yet seen changing (one store operation or two)."""
        self._observe(uids, self._read([keys.heartbeat(u) for u in uids]))
        return [u for u in uids if self._beats[u][1] is None]

    def heartbeat(self, uid: str) -> tuple[float | None, float]:
        """(seconds since the counter was seen changing or None, seconds this reader has watched it)."""
        value, changed, first = self._beats.get(uid, (b"", None, time.monotonic()))
        now = time.monotonic()
        return (None if changed is None else now - changed), now - first

    # -- the document ----------------------------------------------------------------------------
    def _read(self, names: list[str]) -> list[bytes]:
        return read_present(self.store, names)

    def uids(self) -> list[str]:
        return list(dict.fromkeys(read_lines(self.store, keys.STATUS_INDEX)))

    def read(self, with_history: bool = False) -> dict[str, Any]:
        """The run as one JSON-able document; NoRun when the store holds no zb run."""
        self._follow_marker()
        snap = read_snapshot(self.store, None)
        indexed = self.uids()
        world = snap.world
        if world is None:
            self._no_run(snap.raw_world, indexed)
        pending = [j.uid for j in snap.joins[world.join_cursor:] if j.uid] if world else []
        uids = list(dict.fromkeys([*(world.nodes if world else []), *pending, *indexed]))
        raw = self._read([keys.status(u) for u in uids] + [keys.heartbeat(u) for u in uids])
        n = len(uids)
        records = {u: decode_record(r) for u, r in zip(uids, raw[:n])}
        self._observe(uids, raw[n:])
        nodes = [self._node(u, records[u], world, snap.gone, pending) for u in uids]
        nodes.sort(key=_order)
        doc = {"source": self.where, "namespace": self.namespace, "time": round(time.time(), 3), "nodes": nodes,
               "run": dict(_run(world, nodes, records), finished=_end(snap.finished, world)),
               "stores": self._stores(world is not None, nodes), "warning": self._warning()}
        if with_history:
            doc["history"] = self._histories(records)
        return doc

    def _follow_marker(self) -> None:
        """Given a secret, a run that held none when this reader opened may have one now: its nodes that hold the
        secret write the marker as they start (a dashboard started before them). Looked at again, never written."""
        if self.secret is not None and not holds_secret(self.store):
            self.store = self._under_namespace(for_reading(self._plain, self.secret, self.where, keys.is_counter))

    def _under_namespace(self, store):
        return prefixed(store, self.namespace) if self.namespace else store

    def _warning(self) -> str | None:
        """The line to show beside the run when the secret given has no effect (it is read as it is)."""
        if self.secret is None or holds_secret(self.store):
            return None
        return (f"the run at {self.where} holds no secret (its store has no run marker): --secret-file "
                "(ZB_ELASTIC_SECRET_FILE) has no effect, drop it; the run is shown unauthenticated")

    @property
    def several(self) -> bool:
        """Whether the run has several stores (a reader that loses its store, or finds no run, picks again)."""
        return len(self.stores) > 1

    def _stores(self, holds_run: bool, nodes: list[dict]) -> dict[str, Any]:
        """The run's stores in failover order (whether each answered when this one was picked), the one read,
        and the failovers so far: the most any node's record counts (each node counts its own moves)."""
        listed = [dict(s, current=s["address"] == self.where) for s in self.stores]
        for entry in listed:
            if entry["current"]:
                entry.update(answers=True, holds_run=holds_run)
        counts = [n["failovers"] for n in nodes if isinstance(n.get("failovers"), int)]
        return {"current": self.where, "failovers": max(counts, default=0), "list": listed}

    def _histories(self, records: dict[str, dict | None]) -> dict[str, dict]:
        """The histories that changed since this reader last read them, the longest unread first, at most
        `history_budget` per call: a dashboard's refresh stays bounded however many nodes there are."""
        changed = [u for u, rec in records.items() if rec is not None and
                   (rec.get("history_version") is None or rec.get("history_version") != self._hist_seen.get(u))]
        changed.sort(key=lambda u: self._hist_read.get(u, float("-inf")))
        chosen = changed[:self.history_budget]
        now = time.monotonic()
        out = {}
        for uid, raw in zip(chosen, self._read([keys.status_history(u) for u in chosen])):
            record = records[uid]
            assert record is not None  # `changed` keeps only the nodes with a record
            self._hist_seen[uid], self._hist_read[uid] = record.get("history_version"), now
            history = decode_history(raw)
            if history is not None:
                out[uid] = history
        return out

    def _no_run(self, raw_world: bytes, indexed: list[str]) -> None:
        if self.namespace and not raw_world and not indexed:
            raise NoRun(f"no run in namespace '{self.namespace}' on the store at {self.where} (yet): no node of it has "
                        "joined; `zb status` without --namespace lists the store's runs")
        if raw_world:
            raise NoRun(f"the store at {self.where} holds a '{keys.WORLD}' key that is not a zb world record: "
                        "another program's store, or a zb of another version; check --store")
        if indexed:
            return          # nodes are starting: they published a record but no world exists yet
        try:
            # The run marker alone is a store made for a run (`zb store --new-secret`) that no node joined yet.
            count = self._plain.num_keys() - (read_marker(self._plain) is not None)
        except store_errors():
            count = 0
        if count:
            raise NoRun(f"the store at {self.where} holds {count} key(s) but no zb run (no '{keys.WORLD}'): "
                        "another program's store? check --store")
        raise NoRun(f"no run on the store at {self.where} yet: no node has joined it (start nodes with "
                    "GLOBAL_ADDR/GLOBAL_PORT pointing at it)")

    def _node(self, uid: str, rec: dict | None, world, gone: set, pending: list[str]) -> dict[str, Any]:
        rec = rec or {"uid": uid}
        age, watched = self.heartbeat(uid)
        row = {k: rec.get(k) for k in ("host", "device", "local_world_size", "step", "outer_step", "total_steps",
                                        "loss", "eval_loss", "tokens_per_s", "allreduce_s", "wire_mbps", "wire_bytes",
                                        "compression", "num_peers", "steps_per_s", "mesh_version", "pid",
                                        "heartbeat_interval", "heartbeat_timeout", "store", "failovers")}
        row.update(uid=uid, global_rank=world.nodes.index(uid) if world and uid in world.nodes else None,
                   state=_state(uid, rec, world, gone, pending, age, watched), published=rec.get("state"),
                   heartbeat_age_s=None if age is None else round(age, 2), heartbeat_watched_s=round(watched, 2),
                   record_time=rec.get("time"))
        return row


def read_present(store, names: list[str]) -> list[bytes]:
    """Values of `names`, b"" for missing ones, without ever blocking on a missing key: one check and
    one multi_get when all exist; otherwise the missing ones are found by halving (a few checks each)."""
    if not names:
        return []
    if store.check(names):
        return list(store.multi_get(names))
    if len(names) == 1:
        return [b""]
    half = len(names) // 2
    return read_present(store, names[:half]) + read_present(store, names[half:])


def _state(uid: str, rec: dict, world, gone: set, pending: list[str], age: float | None, watched: float) -> str:
    published = rec.get("state")
    interval = rec.get("heartbeat_interval") or DEFAULT_HB_INTERVAL
    timeout = rec.get("heartbeat_timeout") or DEFAULT_HB_TIMEOUT
    silence = age if age is not None else watched     # what this reader can vouch for
    in_world = world is not None and uid in world.nodes
    if published in ("left", "refused"):
        return published
    if in_world and (uid, world.tokens.get(uid, "")) in gone:
        return "leaving"            # its deathrattle is out; the next resolution drops it
    if silence > timeout:
        return "left" if any(u == uid for u, _ in gone) and not in_world else "dead"
    if not in_world:
        if uid not in pending and ((world is not None and uid in world.died) or silence > 2 * interval):
            # Neither a member nor queued to join, and no beat for two intervals: not a node starting up
            # but one that died after the run dropped it (a SIGKILLed node of an earlier world, say).
            return "dead"
        return "recovering" if published == "recovering" else "joining"
    if silence > 2 * interval:
        return "silent"             # not (yet) dead: the mesh waits heartbeat_timeout
    return "joining" if published == "joining" and uid in world.joined else "training"


_RANKLESS = {"joining": 0, "recovering": 0, "leaving": 1, "silent": 1, "dead": 2, "refused": 3, "left": 3}


def _order(node: dict) -> tuple:
    rank = node["global_rank"]
    return (0, rank, "") if rank is not None else (1 + _RANKLESS.get(node["state"], 0), 0, node["uid"])


def _run(world, nodes: list[dict], records: dict[str, dict | None]) -> dict[str, Any]:
    live = [n for n in nodes if n["state"] in ("training", "joining", "silent", "leaving")]
    training = [n for n in nodes if n["state"] == "training"]
    leader = world.leader if world else None
    lead = next((n for n in nodes if n["uid"] == leader), None) or (max(live, key=lambda n: n["step"] or 0)
                                                                     if live else None)
    counted = live or nodes        # a finished run still shows where it ended
    step = max((n["step"] or 0 for n in counted), default=None)
    total = lead.get("total_steps") if lead else None
    rate = lead.get("steps_per_s") if lead else None
    eta = None
    if training and step is not None and total and total > step and rate and rate > 0:   # a finished run has none
        eta = (total - step) / rate
    tps = [n["tokens_per_s"] for n in training if isinstance(n["tokens_per_s"], (int, float))]
    newest = max((r for r in records.values() if r), key=lambda r: r.get("outer_step") or 0, default=None)
    clipped = [u for u in (newest or {}).get("clipped") or [] if isinstance(u, str)]
    return {"clipped": clipped, "mesh_version": world.version if world else None, "world_size": len(world.nodes) if world else 0,
            "leader": leader, "step": step, "outer_step": max((n["outer_step"] or 0 for n in counted), default=None),
            "total_steps": total, "tokens_per_s": round(sum(tps), 1) if tps else None,
            "eta_s": round(eta, 1) if eta is not None else None,
            "states": {s: sum(1 for n in nodes if n["state"] == s) for s in sorted({n["state"] for n in nodes})}}


def _end(finished: Finished | None, world: World | None) -> dict[str, Any] | None:
    """The run's end as its nodes sealed it (keys.FINISHED): where, when and the line that says so; None before it,
    and for a record of an earlier run in this namespace or a run started again since (a later world)."""
    if finished is None or world is None or finished.run != world.run or world.version > finished.version:
        return None
    return {"mesh_version": finished.version, "outer_step": finished.outer_step, "step": finished.step,
            "time": finished.time, "line": f"finished at {finished.where_and_when()}"}


def sample_window(doc: dict) -> float:
    """How long a one-shot reader should watch heartbeats: two intervals of the slowest node (capped)."""
    intervals = [n.get("heartbeat_interval") for n in doc.get("nodes", [])]
    return min(5.0, 2 * max([i for i in intervals if i] or [DEFAULT_HB_INTERVAL]) + 0.2)


