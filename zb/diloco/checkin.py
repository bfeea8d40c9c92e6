"""The check-in at the start of every outer sync: who sends a real pseudo-gradient, who applies
the update, who must receive the full state.

Each rank of the replica group states its role, its position (outer step, step) and a digest of
its node's outer params in one tiny all-reduce; every rank then derives the same Plan from the same
numbers (a pure function, tested alone).

A node is trusted to contribute only when it stands where the run stands: at the newest outer
step among those that trained, holding the outer params most of them hold. A node that lags (it
was frozen past the heartbeat timeout, evicted, and came back with stale params) or whose params
drifted (a bit flip, a missed update) would otherwise average its stale pseudo-gradient into the
run and train apart from it for good while every node exits 0. Such a node sends zeros and
receives the run's state instead.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from zb.collectives import PeerFailure
from zb.diloco.clip import clip_scales, from_bits, outsized, to_bits


class Role(IntEnum):
    """A node's part in an outer step; its value travels in the check-in table."""
    CONTRIBUTOR = 0   # trained the inner steps: sends its pseudo-gradient
    NEEDS_STATE = 1   # joined (blocking join), rejoined after an eviction or drifted: sends zeros, receives the state
    RECOVERED = 2     # loaded the run's outer state from a live snapshot: sends zeros, applies the update


UNKNOWN_DIGEST = 0  # the node did not hash its params (diloco.drift_guard off): not compared


class Arrived(IntEnum):
    """diloco.overlap: what a node holds of the average launched at the previous boundary."""
    NONE = 0     # nothing was in flight (first boundary, after a resume, blocking mode)
    OK = 1
    FAILED = 2


@dataclass(frozen=True, kw_only=True)
class Plan:
    contributors: list[int]     # ranks whose pseudo-gradients are averaged
    appliers: list[int]         # ranks that apply the averaged update to their outer params
    receivers: list[int]        # ranks that receive the state from `donor` after the step
    donor: int | None
    run_outer_step: int = 0     # the run's position (the first contributor's counters)
    run_step: int = 0
    average_ok: bool = False    # overlap: every contributor holds the whole average launched last boundary
    steps: list[int] = field(default_factory=list)          # every rank's step counter
    round_steps: list[int] = field(default_factory=list)    # diloco.round_seconds: inner steps of this round
    round_tokens: list[int] = field(default_factory=list)   # ... and tokens (the weights of the average)
    norms: list[float] = field(default_factory=list)        # diloco.clip: each rank's pseudo-gradient norm
    scales: list[float] = field(default_factory=list)       # diloco.clip: the factor each rank's is scaled by

    def clipped(self) -> list[int]:
        """Ranks whose pseudo-gradients diloco.clip scales down in this outer step."""
        return [r for r, s in enumerate(self.scales) if s < 1.0]

    def outsized(self) -> list[int]:
        """Clipped ranks whose norm is also over clip.OUTSIZED x the median: what counts toward a node clipped
        in a row."""
        over = set(outsized(self.norms, self.contributors))
        return [r for r in self.clipped() if r in over]



def make_plan(roles: list[int], outer_steps: list[int], steps: list[int] | None = None,
              digests: list[int] | None = None, arrived: list[int] | None = None,
              round_steps: list[int] | None = None, round_tokens: list[int] | None = None,
              norms: list[float] | None = None, clip: float | None = None, evicted: list[int] | None = None) -> Plan:
    """`evicted`: ranks of nodes diloco.evict_clipped evicted that are still in the world (the leader drops them
    at the next resolution): their contributions count for nothing, and they neither apply nor receive."""
    n = len(roles)
    steps = steps or [0] * n
    digests = digests or [UNKNOWN_DIGEST] * n
    arrived = arrived or [Arrived.NONE] * n
    out = set(evicted or ())
    ranks = [r for r in range(n) if r not in out] or list(range(n))
    contributors = _current([r for r in ranks if roles[r] == Role.CONTRIBUTOR], outer_steps, digests)
    if not contributors:
        # Nobody trained with the run yet (every earlier node is gone): those holding recovered state
        # carry the run on; with none, this is a fresh start from identical seeded weights.
        contributors = _current([r for r in ranks if roles[r] == Role.RECOVERED], outer_steps, digests) or ranks
    first = contributors[0]
    run_outer_step = outer_steps[first]
    appliers = sorted(set(contributors) | {r for r in ranks if roles[r] == Role.RECOVERED and outer_steps[r] == run_outer_step
                                           and _same(digests[r], digests[first])})
    receivers = [r for r in ranks if r not in appliers]
    # A transfer can end on some nodes and fail on others (a peer died mid-ring): the average is applied
    # only when every contributor has it, so no node ever applies what another skips.
    average_ok = all(arrived[r] == Arrived.OK for r in contributors)
    return Plan(contributors=contributors, appliers=appliers, receivers=receivers,
                donor=first if receivers else None, run_outer_step=run_outer_step, run_step=steps[first],
                average_ok=average_ok, steps=list(steps), round_steps=list(round_steps or [0] * n),
                round_tokens=list(round_tokens or [0] * n), norms=list(norms or [0.0] * n),
                scales=clip_scales(list(norms or [0.0] * n), contributors, clip))


def _current(ranks: list[int], outer_steps: list[int], digests: list[int]) -> list[int]:
    """The ranks that stand where the run stands: the newest outer step among `ranks`, then the
    params digest most of those hold (a tie goes to the lowest rank's)."""
    if not ranks:
        return []
    newest = max(outer_steps[r] for r in ranks)
    at_newest = [r for r in ranks if outer_steps[r] == newest]
    known = [digests[r] for r in at_newest if digests[r] != UNKNOWN_DIGEST]
    if not known:
        return at_newest
    counts = Counter(known)
    majority = max(counts, key=lambda d: (counts[d], -known.index(d)))
    return [r for r in at_newest if _same(digests[r], majority)]


def _same(a: int, b: int) -> bool:
    return UNKNOWN_DIGEST in (a, b) or a == b


def digest_value(digest: bytes) -> int:
    """A params digest as one int64 for the check-in table (never UNKNOWN_DIGEST)."""
    return int.from_bytes(digest[:8], "little", signed=True) or 1


def check_in(pg: dist.ProcessGroup, rank: int, size: int, role: int, *, outer_step: int, step: int,
             deadline_s: float, digest: int = UNKNOWN_DIGEST, arrived: int = Arrived.NONE,
             round_steps: int = 0, round_tokens: int = 0, norm: float = 0.0, clip: float | None = None,
             evicted: list[int] | None = None) -> Plan:
    """All-reduce every rank's (role, outer step, step, digest, arrived, round steps, round tokens, pseudo-
    gradient norm) and derive the plan (with diloco.clip's factors, without the `evicted` ranks); PeerFailure
    if a peer is missing. Each rank writes only its own column, so SUM assembles the table."""
    table = torch.zeros(8, size, dtype=torch.int64)
    table[:, rank] = torch.tensor([role, outer_step, step, digest, arrived, round_steps, round_tokens,
                                   to_bits(norm)], dtype=torch.int64)
    try:
        pg.allreduce([table]).wait(timedelta(seconds=deadline_s))
    except Exception as e:  # noqa: BLE001 - gloo names an address; the retry resolves the world anyway
        raise PeerFailure(f"outer-step check-in failed: {str(e).splitlines()[0]}", rank=None) from None
    roles, outer_steps, steps, digests, all_arrived, all_round_steps, all_round_tokens, bits = table.tolist()
    return make_plan(roles, outer_steps, steps, digests, all_arrived, all_round_steps, all_round_tokens,
                     [from_bits(b) for b in bits], clip, evicted)
