"""Who is in, who is out, and who leads, for one resolution, as seen by one node.

Every node applies the same rules to what it reads from the store and to its own liveness table;
the lowest-ranked member not excluded is the acting leader. Deadlines (all from ElasticConfig,
measured from this node's own answer on its own clock):

- a member that said goodbye is out at once;
- a member whose unique id is in keys.EVICTED (the layer above excluded it for the rest of the run:
  zb.elastic.membership.exclude) is out at once, and a join request from that id is never admitted;
- a member whose heartbeat has been silent for `heartbeat_timeout` is dead, and so is one silent
  for 2 x `heartbeat_interval` whose port refuses connections (zb.elastic.closedport);
- a member blamed for a failed collective (a suspect) that has not answered within
  `heartbeat_interval` is out (its closed connection named it: no need to wait for the timeout);
- a member that has not answered within `sync_deadline` missed the sync and is out;
- a member that answered and is dead since (silent, or its port refuses) is out at once;
- two members that cannot connect to each other (one's probe timed out on the other after a failed
  collective, reported in its answer: a partition, a firewall) cannot share a group: one of each such
  pair is out, the one in the most pairs first (a node cut off from all), ties to the higher rank.
  Both still reach the store and beat, so no other rule drops either, and keeping both made every
  outer step fail until the cut healed; the one dropped rejoins once it can reach the members;
- a lower-ranked member that answered but has not written the next world within
  `stuck_after` (2 x sync_deadline + heartbeat_timeout) is stuck and is passed over, one at a time:
  the k-th live member in line is passed over after k x `stuck_after` (all at once, a node that
  answered early would pass over the live members waiting for the same stuck one, and lead alone).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zb.elastic.heartbeat import Liveness
from zb.elastic.store_state import Answer, Snapshot
from zb.elastic.world import JoinRequest, Observation, World

if TYPE_CHECKING:
    from zb.config_schema import ElasticConfig


@dataclass
class RoundDeadlines:
    suspect_grace: float
    sync_deadline: float
    stuck_after: float

    @staticmethod
    def from_config(cfg: ElasticConfig) -> RoundDeadlines:
        return RoundDeadlines(suspect_grace=cfg.heartbeat_interval, sync_deadline=cfg.sync_deadline,
                         stuck_after=2 * cfg.sync_deadline + cfg.heartbeat_timeout)


@dataclass
class Verdict:
    acting_leader: str | None
    observation: Observation
    pending: int = 0            # members whose answer is still awaited (the verdict waits for them or their deadline)

    @property
    def settled(self) -> bool:
        """Every member answered or is out: the leader may write."""
        return self.pending == 0


def judge(world: World, snap: Snapshot, me: str, liveness: Liveness, since: float, dl: RoundDeadlines) -> Verdict:
    """The verdict of resolution `world.resolution`, `since` seconds after this node answered."""
    lines = [c for c in snap.answers if world.tokens.get(c.uid) == c.token]
    answered = {c.uid for c in lines}
    suspects = {s for c in lines for s in c.suspects}
    my_rank = world.nodes.index(me) if me in world.nodes else len(world.nodes)
    cut = split_unreachable(world, lines)
    evicted = snap.evicted & set(world.nodes)
    excluded, pending, stuck = (cut & {me}) | evicted, 0, 0
    for rank, m in enumerate(world.nodes):
        if m == me or (m, world.tokens.get(m, "")) in snap.gone or m in evicted:
            continue
        if m in cut:
            excluded.add(m)
            continue
        if m in answered:
            if liveness.is_dead(m):                 # answered, then crashed: no need to wait it out
                excluded.add(m)
            elif rank < my_rank and since > dl.stuck_after * (stuck + 1):
                excluded.add(m)                     # one at a time: the next in line gets its own window
                stuck += 1
            continue
        out = liveness.is_dead(m) or since > dl.sync_deadline or (m in suspects and since > dl.suspect_grace)
        if out:
            excluded.add(m)
        else:
            pending += 1
    acting = next((m for m in world.nodes if m not in excluded
                   and (m, world.tokens.get(m, "")) not in snap.gone), None)
    joiners = admissible_joiners(world, snap, liveness)
    obs = Observation(answered=answered | {me}, gone=snap.gone, excluded=excluded, joiners=joiners,
                      join_end=len(snap.joins), failure=any(c.failed for c in lines))
    return Verdict(acting_leader=acting, observation=obs, pending=pending)


def split_unreachable(world: World, lines: list[Answer]) -> set[str]:
    """Members to drop so that no two left in the world reported each other unreachable: repeatedly
    the member in the most remaining pairs, ties to the higher rank (the same choice on every node)."""
    rank = {m: i for i, m in enumerate(world.nodes)}
    pairs = {frozenset((c.uid, u)) for c in lines for u in c.unreachable if u != c.uid and u in rank and c.uid in rank}
    out: set[str] = set()
    while pairs:
        count = Counter(m for pair in pairs for m in pair)
        drop = max(count, key=lambda m: (count[m], rank[m]))
        out.add(drop)
        pairs = {pair for pair in pairs if drop not in pair}
    return out


def admissible_joiners(world: World, snap: Snapshot, liveness: Liveness) -> list[JoinRequest]:
    """Requests past the cursor from live nodes with the run's local world size, an id the run did not evict,
    made in the last few resolutions (JoinRequest.fresh: a replayed old request is not)."""
    return [r for r in snap.joins[world.join_cursor:]
            if r.uid and r.stripes == world.stripes and not liveness.is_dead(r.uid) and r.uid not in snap.evicted
            and r.fresh(world.resolution)]


def renewed_members(world: World, snap: Snapshot) -> set[str]:
    """Members that asked to join again under another token: previous incarnations, found silent before the
    new one started (zb.elastic.identity). The heartbeat counter both share moves with the new one's beats,
    so judged by it such a member would pass for alive forever."""
    return {r.uid for r in snap.joins[world.join_cursor:] if r.uid in world.tokens and r.token != world.tokens[r.uid]}


def members_all_out(world: World, snap: Snapshot, liveness: Liveness) -> bool:
    """True when no member of `world` is alive: a joiner may then seed the next world itself. Renewed members
    count as gone: else a whole run restarted against a store that outlived it could never start (every node
    waiting for the others' old selves); so do evicted ones."""
    renewed = renewed_members(world, snap)
    return all((m, world.tokens.get(m, "")) in snap.gone or liveness.is_dead(m) or m in renewed or m in snap.evicted
               for m in world.nodes)