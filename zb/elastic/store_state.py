"""One read of everything a resolution looks at: the world, goodbyes, evicted ids, join requests, the answers to
the roll call.

Lines from peers are parsed as JSON with known fields only; anything malformed is skipped (a
peer's bytes are never unpickled or trusted beyond their shape).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zb.elastic import keys
from zb.elastic.tcpstore import read_many
from zb.elastic.world import JoinRequest, World

if TYPE_CHECKING:
    from zb.store_clients import StoreClient


@dataclass
class Answer:
    """A member's answer to a resolution's roll call: it reached the boundary, and what it saw."""

    uid: str
    token: str
    failed: bool = False                  # its last collective failed: groups must be rebuilt
    suspects: list[str] = field(default_factory=list)   # unique ids it blames for the failure
    unreachable: list[str] = field(default_factory=list)  # members its probe could not connect to


@dataclass(frozen=True)
class Finished:
    """The run reached its end (keys.FINISHED): in world `version` of run `run`, at that outer step and step."""

    run: str
    version: int
    outer_step: int
    step: int
    time: float

    def encode(self) -> str:
        return json.dumps({"run": self.run, "version": self.version, "outer_step": self.outer_step,
                           "step": self.step, "time": self.time})

    def where_and_when(self) -> str:
        """As every line about the run's end says it: "outer step 12 (step 120) at 2026-11-28 07:13:19 UTC"."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.time))
        return f"outer step {self.outer_step} (step {self.step}) at {when}"

    @staticmethod
    def decode(raw: bytes) -> Finished | None:
        """None for an absent or malformed record: each field of its type and range, or nothing."""
        doc = _record(raw, ("version", "outer_step", "step"))
        when = doc.get("time") if doc else None
        if doc is None or not (isinstance(when, (int, float)) and not isinstance(when, bool) and 0 <= when < 1e11):
            return None
        return Finished(doc["run"], doc["version"], doc["outer_step"], doc["step"], float(when))


@dataclass(frozen=True)
class Stayed:
    """keys.STAYED on a later store (zb.elastic.partition): run `run` went on at store `index` of elastic.addr in
    world `version`, without members that had gone silent."""

    run: str
    index: int
    version: int

    def encode(self) -> str:
        return json.dumps({"run": self.run, "index": self.index, "version": self.version})

    @staticmethod
    def decode(raw: bytes) -> Stayed | None:
        """None for an absent or malformed record: each field of its type and range, or nothing."""
        doc = _record(raw, ("index", "version"))
        return None if doc is None else Stayed(doc["run"], doc["index"], doc["version"])


def _record(raw: bytes, counts: tuple[str, ...]) -> dict[str, Any] | None:
    """A run's JSON record from the store: an object whose "run" is a run id and whose `counts` are integers in
    [0, 2**62); None for anything else (an absent key, or bytes nobody should act on)."""
    try:
        doc = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    run = doc.get("run")
    ints = [doc.get(k) for k in counts]
    if not (isinstance(run, str) and 0 < len(run) <= 64
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in ints)):
        return None
    return doc


def finished_without(finished: Finished | None, world: World | None) -> bool:
    """True when the run this node belongs to ended in a later world than the node's: the others finished it
    while this node was cut off or stopped. A node of the final world (which finished it too) is not late; a
    node of no world yet, or of another run (one started again on the same store), is not concerned."""
    return (finished is not None and world is not None and bool(world.run) and finished.run == world.run
            and world.version < finished.version)


@dataclass
class Snapshot:
    raw_world: bytes
    world: World | None
    gone: set[tuple[str, str]]
    joins: list[JoinRequest]
    answers: list[Answer]
    events: int = 0    # events of the roll call read (keys.roll_call_events): what a waiter waits past
    moved: int | None = None   # the run moved on from this store to this index of elastic.addr (keys.MOVED)
    evicted: set[str] = field(default_factory=set)   # unique ids excluded for the rest of the run (keys.EVICTED)
    finished: Finished | None = None   # the run reached its end (keys.FINISHED)
    stayed: Stayed | None = None   # the run went on at an earlier store without members gone silent (keys.STAYED)
    written: bool = False   # the roll call read has ended: its next world is in the store (keys.ENDED; light reads)
    has_world: bool = True   # the store holds a world (light reads: one restarted empty has none)


def read_snapshot(store: StoreClient, resolution: int | None) -> Snapshot:
    """World, goodbyes, evicted ids and joins, plus the answers to the roll call of `resolution` (none when None).

    One round trip when every key exists (a seeded world creates them all: zb.elastic.membership). Otherwise
    read_many reads them one at a time, so the roll call's events come first: a world written between two
    reads then shows up with its wake-up still ahead of the events read, never behind it (read after the
    world, an events count that already included the next world's wake-up left a waiter waiting for one
    more event that never came)."""
    call = [keys.roll_call_events(resolution), keys.roll_call(resolution)] if resolution is not None else []
    names = [*call, keys.WORLD, keys.GONE, keys.JOINS, keys.MOVED, keys.EVICTED, keys.FINISHED, keys.STAYED]
    raw = dict(zip(names, read_many(store, names)))
    world = raw[keys.WORLD]
    return Snapshot(raw_world=world, world=World.decode(world), gone=_gone(raw[keys.GONE]), joins=_joins(raw[keys.JOINS]),
                    answers=_answers(raw[call[1]]) if call else [], events=counter_value(raw[call[0]]) if call else 0,
                    moved=counter_value(raw[keys.MOVED]) or None, evicted=evicted_ids(raw[keys.EVICTED]),
                    finished=Finished.decode(raw[keys.FINISHED]), stayed=Stayed.decode(raw[keys.STAYED]))


def read_light(store: StoreClient, resolution: int | None, world: bool = False) -> Snapshot:
    """What a member that does not judge the roll call of `resolution` reads while it waits (zb.elastic.standby):
    whether the roll call ended (keys.ENDED), whether the store holds a world, and what every read checks (goodbyes,
    evictions, the run's end, a move); the world too when `world`. Never the roll call's answers or the join
    requests, whose size grows with the run: a few hundred bytes at any size, the world's record apart.

    Two round trips in a seeded store (every key exists: zb.elastic.membership seeds them), one `check` and one
    `multi_get`; a key missing (a store restarted, a key deleted) reads the keys one at a time."""
    names = [keys.ENDED, *([keys.WORLD] if world else []), keys.GONE, keys.MOVED, keys.EVICTED, keys.FINISHED,
             keys.STAYED]
    if store.check([*names, *([] if world else [keys.WORLD])]):
        raw, has_world = dict(zip(names, store.multi_get(names))), True
    else:
        raw = dict(zip(names, read_many(store, names)))
        has_world = bool(raw[keys.WORLD]) if world else store.check([keys.WORLD])
    text = raw.get(keys.WORLD, b"")
    ended = counter_value(raw[keys.ENDED]) if raw[keys.ENDED] else -1
    return Snapshot(raw_world=text, world=World.decode(text) if world else None, gone=_gone(raw[keys.GONE]), joins=[],
                    answers=[], moved=counter_value(raw[keys.MOVED]) or None,
                    evicted=evicted_ids(raw[keys.EVICTED]), finished=Finished.decode(raw[keys.FINISHED]),
                    stayed=Stayed.decode(raw[keys.STAYED]), written=resolution is not None and ended >= resolution,
                    has_world=has_world)


def ended_world(store: StoreClient) -> World | None:
    """The last world of the run in this store (and namespace) when every node of it said goodbye: that run
    has ended. None while a node of it may be live (one killed without a goodbye counts as live: only
    waiting out its heartbeat would tell), or before any world."""
    snap = read_snapshot(store, None)
    world = snap.world
    if world is None or any((m, world.tokens.get(m, "")) not in snap.gone for m in world.nodes):
        return None
    return world


def counter_value(raw: bytes) -> int:
    """A counter's value (the store's decimal text), 0 when absent or not one: anyone can write a counter key."""
    try:
        return int(raw or b"0")
    except ValueError:
        return 0


def _lines(raw: bytes) -> list[str]:
    return [line for line in raw.decode(errors="replace").split("\n") if line]


def _gone(raw: bytes) -> set[tuple[str, str]]:
    pairs = (line.split(" ") for line in _lines(raw))
    return {(p[0], p[1]) for p in pairs if len(p) == 2}


def evicted_ids(raw: bytes) -> set[str]:
    """The unique ids of keys.EVICTED (one per line; a line that is not one id is skipped)."""
    return {line for line in _lines(raw) if " " not in line}


def _json_lines(raw: bytes) -> list[dict[str, Any] | None]:
    """One entry per line (None for a malformed one), so positions stay meaningful."""
    out: list[dict[str, Any] | None] = []
    for line in _lines(raw):
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        out.append(value if isinstance(value, dict) else None)
    return out


def _joins(raw: bytes) -> list[JoinRequest]:
    out = []
    for index, data in enumerate(_json_lines(raw)):
        if data is None:   # a malformed line
            out.append(JoinRequest(uid="", token="", index=index))   # keeps the cursor counting lines
            continue
        try:
            out.append(JoinRequest(uid=str(data["uid"]), token=str(data["token"]), index=index,
                                   pref_rank=int(data.get("pref_rank", 0)),
                                   last_version=int(data.get("last_version", 0)),
                                   last_rank=int(data.get("last_rank", 0)),
                                   stripes=int(data.get("stripes", 1)), run=str(data.get("run", "")),
                                   seen=int(data.get("seen", 0))))
        except (TypeError, KeyError, ValueError):
            out.append(JoinRequest(uid="", token="", index=index))   # keeps the cursor counting lines
    return out


def _answers(raw: bytes) -> list[Answer]:
    out = []
    for data in _json_lines(raw):
        if data is None:   # a malformed line
            continue
        try:
            out.append(Answer(uid=str(data["uid"]), token=str(data["token"]), failed=bool(data.get("failed")),
                               suspects=[str(s) for s in data.get("suspects", [])],
                               unreachable=[str(u) for u in data.get("unreachable", [])]))
        except (TypeError, KeyError, ValueError):
            continue
    return out


def encode_line(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"
