"""Which side of a partition goes on training: the rule, as pure functions (tested in-process).

A world changes only on the run's current store, written by its leader (zb.elastic.membership), so the
store decides. The shapes of a partition and who goes on:

- **Nodes cut from each other, not from the store.** The store's leader drops one of each pair that reported
  the other unreachable (zb.elastic.judge.split_unreachable); the one dropped rejoins after the heal.
- **Some nodes cut from the store, one store (no failover list).** The store's side goes on, whatever its size.
  The cut side cannot change its world without the store: it trains on only while its all-reduce with the
  whole last world still works, and otherwise waits for the store (zb.elastic.stores.may_train_on).
- **Some nodes cut from the store, with a failover list.** The cut side takes the store's silence for its
  death and moves to the next store (after elastic.store_failover_s), where it re-forms only with more than
  half of the last world, counting only that world's members (zb.elastic.stores.reform_quorum). The side
  left on the store drops the silent ones and goes on at once when it keeps more than half of the last
  world and of the nodes it dropped for silence before (World.silent): two drops in a row that each keep
  a majority (4 -> 3 -> 2) would otherwise leave only half of the world the first ones left. A smaller side cannot tell a
  dead majority from one that moved (`drop_verdict`): it waits until the silent ones would have moved and
  their join requests landed, then asks every later store. This run there (its world, or a join request
  naming it): it follows. A later store that does not answer: it waits, since it cannot tell. Every later
  store answering without the run: the silent ones are gone, and it goes on, after first writing a claim
  (keys.STAYED) on each later store. Silent nodes that reach a later store after that read the claim
  (`stale_arrival`) and go back to the store the run stayed on instead of re-forming apart.
- **The store silent for everyone.** Every node moves; the first majority re-forms at the next store.
- **A mover waiting at the next store for a majority that never comes** (the rest stayed, and dropped it):
  it asks the store it left; once that store answers with the run's world grown past the one it left
  (`may_go_back`), it goes back and rejoins there as a joiner, receiving the run's state.

Evidence: a goodbye (keys.GONE), an eviction and a port that refuses connections (the process is gone) prove
a node out; silence (no heartbeat, no answer) does not: a silent node may be training on elsewhere.
The cost in availability is the minority's wait, `settle_s` below, once per partition, and a minority
whose later store does not answer waits for it up to elastic.store_timeout, then stops (exit 1, with
its checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass

from zb.elastic.store_state import Stayed
from zb.elastic.stores import reform_quorum

GO, WAIT, FOLLOW = "go on", "wait", "follow"


def settle_s(failover_s: float, sync_deadline: float, heartbeat_timeout: float) -> tuple[float, float]:
    """How long a minority waits before it looks at the later stores, as (silence of the dropped members, time
    since this node reached the boundary). A silent node moves once the store has been silent for
    elastic.store_failover_s, at its own boundary, which comes at most elastic.sync_deadline after this
    node's (later, it would have been dropped for lateness anyway); a heartbeat timeout more covers its
    connecting to the next store and appending its join request there."""
    return failover_s + heartbeat_timeout, sync_deadline + heartbeat_timeout


@dataclass(frozen=True)
class DropVerdict:
    action: str                 # GO, WAIT or FOLLOW
    to: int | None = None       # FOLLOW: the index in elastic.addr holding the run
    why: str = ""               # WAIT: what it waits for, in words


def drop_verdict(counted: int, kept: int, silent: int, settled: bool, later: list[bool | None],
                 first_later: int = 0) -> DropVerdict:
    """Whether the leader of the current store may write a world without `silent` members that stopped
    answering (counted: the last world's members less those the run proved out; kept: the members going on).
    `later[i]`: what store `first_later + i` of elastic.addr showed (True: this run's world or join request,
    False: answered without it, None: no answer); empty without a later store. `settled`: the wait of
    `settle_s` is over. Ask only when `needs_look` holds: a majority, or no later store, goes on unasked."""
    if not needs_look(counted, kept, silent, bool(later)):
        return DropVerdict(GO)
    holding = [first_later + i for i, held in enumerate(later) if held]
    if holding:
        return DropVerdict(FOLLOW, to=holding[-1])
    if not settled:
        return DropVerdict(WAIT, why="the silent nodes' time to move to a later store")
    if any(held is None for held in later):
        return DropVerdict(WAIT, why="a later store of elastic.addr to answer")
    return DropVerdict(GO)


def needs_look(counted: int, kept: int, silent: int, has_later: bool) -> bool:
    """A side that drops silent members while keeping no more than half of the last world, with a later store
    the silent ones could have moved to."""
    return silent > 0 and has_later and kept < reform_quorum(counted)


def stale_arrival(stayed: Stayed | None, run: str, last_version: int, here: int) -> bool:
    """A node arriving at store `here` from a world of `run` at `last_version`: the run went on at an earlier
    store in a newer world without it, so it must not re-form here (it would train apart)."""
    return (stayed is not None and bool(run) and stayed.run == run and stayed.index < here
            and stayed.version > last_version)


def may_go_back(run: str, left_version: int, held_run: str | None, held_version: int, moved_on: bool) -> bool:
    """A mover still waiting for a majority at a later store may go back to the store it left when that store
    holds this run's world, not moved on (keys.MOVED), grown past the world it left: the others went on there
    and dropped it. A world still at the version it left is one nobody changed (the others are moving too,
    or wait themselves): going back then would only split the movers."""
    return bool(run) and held_run == run and not moved_on and held_version > left_version
