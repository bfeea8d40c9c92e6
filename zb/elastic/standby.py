"""Who judges a roll call, and whose heartbeats a member reads: what keeps the store's work per resolution linear
in the members.

Every member's verdict names the same acting leader (zb.elastic.judge), but only a member that may become it
needs the verdict. A member judges (reads the whole roll call, every join request and every member's heartbeat,
at every event) while fewer than STANDBY members ahead of it in rank order are plausibly in: not said goodbye,
not evicted, not dead by its own liveness table. So the acting leader and the next STANDBY - 1 in line judge,
warm, ready to take over; every other member answers and then waits for the roll call's end (keys.written) with
a few hundred bytes a wake-up (zb.elastic.store_state.read_light), reading the heartbeats of the members ahead
of it up to STANDBY plausible ones. When those die it judges in turn. Past elastic.sync_deadline every member
also judges, once per heartbeat interval: judges that are alive but stuck or cut off cannot stall the run.

Measured (BENCHMARKS.md "Scale"): with every member judging, a roll call cost every member a read of the
whole roll call at every answer (N^2 reads of O(N) bytes: 17 s and 70 MB at 128 members on this machine).
"""

from __future__ import annotations

from collections.abc import Iterable

from zb.elastic.heartbeat import Liveness
from zb.elastic.store_state import Snapshot
from zb.elastic.world import World

STANDBY = 3   # members in line that judge every roll call: the acting leader and two ready to take over


def _plausibly_in(uid: str, liveness: Liveness, out: Iterable[str]) -> bool:
    return uid not in out and not liveness.is_dead(uid)


def ahead(world: World, me: str, liveness: Liveness, out: set[str]) -> list[str]:
    """The members ahead of `me` in rank order, up to STANDBY plausibly in (those not in `out`, said goodbye or
    evicted, and not dead by `liveness`); the dead and out ones before them included."""
    rank = world.nodes.index(me) if me in world.nodes else len(world.nodes)
    picked, plausible = [], 0
    for uid in world.nodes[:rank]:
        picked.append(uid)
        if _plausibly_in(uid, liveness, out):
            plausible += 1
            if plausible == STANDBY:
                break
    return picked


def judges(world: World, me: str, liveness: Liveness, out: set[str]) -> bool:
    """Whether `me` judges the roll call of `world`: fewer than STANDBY members ahead of it are plausibly in."""
    return sum(_plausibly_in(u, liveness, out) for u in ahead(world, me, liveness, out)) < STANDBY


def out_of(world: World, snap: Snapshot) -> set[str]:
    """The members of `world` that `snap` shows said goodbye (with their token) or evicted."""
    return {m for m, token in snap.gone if world.tokens.get(m) == token} | snap.evicted


def watched(world: World | None, me: str, liveness: Liveness) -> list[str]:
    """Whose heartbeat counters `me` reads every heartbeat interval: every member while it judges, else the
    members ahead of it up to STANDBY plausibly in (whose deaths would make it judge)."""
    if world is None:
        return []
    if judges(world, me, liveness, set()):
        return list(world.nodes)
    return ahead(world, me, liveness, set())
