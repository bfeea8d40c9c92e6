"""Every key zb writes in the global store, in one place.

Lists (join requests, leave notices, roll-call answers) are single keys grown with the store's atomic
`append`, one JSON line or token line per entry, so one `get` reads all of them; counters use `add`.
A restarted store is empty: every reader treats a missing key as "nothing yet".
"""

from __future__ import annotations

import re

ROOT = "zb"

WORLD = f"{ROOT}/world"          # JSON of the current World; written only with compare_set
JOINS = f"{ROOT}/joins"          # append-only: one JSON join request per line
GONE = f"{ROOT}/gone"            # append-only: "<uid> <token>" per line (the deathrattle)
MOVED = f"{ROOT}/moved"          # the index in elastic.addr the run moved on to from this store ("" while it is here)
STAYED = f"{ROOT}/stayed"        # on a later store of elastic.addr: JSON {run, index, version}, the run went on at an
                                 # earlier store without members gone silent (zb.elastic.partition): they go back there
STORES = f"{ROOT}/stores"        # elastic.addr's list as the run's first node named it (compare_set): all must match
FINISHED = f"{ROOT}/finished"    # JSON {run, version, outer_step, step, time}: the run reached its end in that world
                                 # (compare_set, the first node to finish); a node of an older world of the run stops
EVICTED = f"{ROOT}/evicted"      # append-only: one unique id per line, excluded for the rest of the run (the layer
                                 # above decides whom: zb.elastic.membership.exclude); the leader drops it, never admits it
JOIN_COUNT = f"{ROOT}/join_count"  # counter (`add`) bumped after each join request: where a request is in line, a hint
                                 # for who seeds first (zb.elastic.admission._seed_pace), never a decision
RUNS = f"{ROOT}/runs"            # append-only, at the store's root whatever the namespace, never sealed: one JSON line
                                 # per node that starts or finishes a run (zb.elastic.runs); for listing runs only,
                                 # never read by a node


def heartbeat(uid: str) -> str:
    """Counter bumped by the node's heartbeat thread (`add`)."""
    return f"{ROOT}/hb/{uid}"


# Counters (`add`): with a run secret they are the only values not sealed (zb.signed_store), since the store
# parses them as integers. Each is a liveness or wake-up signal, never a decision: anyone who reaches the store
# can bump one, which at worst keeps a dead node looking alive until a collective blames it, or wakes a waiter.
# DiLoCo-SWARM's stage-arrival counter (zb.swarm.registry.ARRIVALS) is one too.
_COUNTERS = re.compile(rf"(?:^|/)(?:{ROOT}/hb/[^/]+|{ROOT}/roll_call/\d+/events|{ROOT}/join_count|swarm/arrivals)$")


def is_counter(key: str) -> bool:
    """Whether the full key (under any namespace) is one of the counters above."""
    return _COUNTERS.search(key) is not None


def roll_call(resolution: int) -> str:
    """Append-only: one JSON line (its answer) per node that reached the outer-step boundary of resolution
    `resolution`."""
    return f"{ROOT}/roll_call/{resolution}"


def roll_call_events(resolution: int) -> str:
    """Counter (`add`) of what happened in the roll call of `resolution`: an answer, or the next world
    written. Event n also sets `<this key>/<n>`, which the nodes waiting for the roll call to end `wait`
    for instead of polling (zb.elastic.membership)."""
    return f"{ROOT}/roll_call/{resolution}/events"


def written(resolution: int) -> str:
    """Set (empty) once the world that ends the roll call of `resolution` is in the store (the seed of a run ends
    resolution 0): the members that do not judge the roll call wait for it instead of reading the whole roll call
    (zb.elastic.standby). A wake-up, never a decision: the world itself is read and checked."""
    return f"{ROOT}/roll_call/{resolution}/written"


ENDED = f"{ROOT}/ended"  # decimal: the last resolution whose roll call ended (set with keys.written). Unlike that key it
                        # always exists once a world is seeded, so a light read tells an open roll call from an ended
                        # one in the same round trip as the rest. A hint, never a decision: the world is read and checked


def probe(uid: str) -> str:
    """"ip:port" of the node's reachability listener on its gloo interface."""
    return f"{ROOT}/probe/{uid}"


def mesh_prefix(version: int, local_rank: int) -> str:
    """PrefixStore of the global ProcessGroupGloo of replica group `local_rank` at mesh `version`."""
    return f"{ROOT}/mesh/{version}/r{local_rank}"


LINK_FILE = f"{ROOT}/links/file"  # text of an elastic.link_matrix file (zb iperf-mesh --json), set by nodes given one


LINKS_MEASURED = f"{ROOT}/links/measured"   # set once any node published a measured row (keys.links_into): without it
                                           # and without LINK_FILE the leader skips reading 2N + 1 missing keys


def link_server(uid: str) -> str:
    """host:port of the node's link-measurement receiver (zb.elastic.linkprobe, elastic.measure_links)."""
    return f"{ROOT}/links/server/{uid}"


def links_into(uid: str) -> str:
    """JSON {sender uid: Mbit/s or null} of the links into `uid`, timed and written by `uid` alone."""
    return f"{ROOT}/links/into/{uid}"


# What `zb status` and the dashboard read (zb.status): one bounded record and one bounded history per
# node, overwritten in place, and an index of the unique ids that ever published one.
STATUS_INDEX = f"{ROOT}/status/index"   # append-only: one unique id per line, per publishing process


def status(uid: str) -> str:
    """JSON of the node's status record (zb.status.record), a few hundred bytes."""
    return f"{ROOT}/status/node/{uid}"


def status_history(uid: str) -> str:
    """JSON of the node's recent steps, outer steps and membership changes (bounded)."""
    return f"{ROOT}/status/history/{uid}"
