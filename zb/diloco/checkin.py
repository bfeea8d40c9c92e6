"""The check-in at the start of every outer sync: who sends a real pseudo-gradient, who applies
the update, who must receive the full state.

Each rank of the replica group states its role, its position (outer step, step) and a digest of
its node's outer params in one tiny all-reduce; every rank then derives the same Plan from the same
numbers (a pure function, tested alone).

A node is trusted to contribute only when it stands where the run stands: at the outer step most of
those that trained hold, with the outer params most of them hold. A node that lags (it was frozen past
the heartbeat timeout, evicted, and came back with stale params) or whose params drifted (a bit flip,
a missed update) would otherwise average its stale pseudo-gradient into the run and train apart from
it for good while every node exits 0. Such a node sends zeros and receives the run's state instead.

No rank's word alone decides the run (an insider can claim anything in its column, issue 40): the
run's position is the newest outer step more than half of the contributors reached (an even split
takes the older), so a node that claims to be ahead is a receiver, not the donor; the run's step is
the contributors' median; with diloco.clip, a non-finite norm leaves its node out of the average
(it applies the others'), and a round's token count is bounded like a norm (zb.diloco.clip; bounded only:
a fast honest node's count differs too). Each rank whose claim did not hold is named in `Plan.discredited`,
which counts toward eviction as an outsized clip does (zb.diloco.trust).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from zb.collectives import PeerFailure
from zb.diloco.clip import bounded_tokens, clip_scales, from_bits, outsized, to_bits
from zb.diloco.verify import credible_residuals


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
    donor: int | None           # a contributor, in turn by outer step: a donor that lies about its params is not
                                # the donor again at the next outer step, when its receiver's digest gives it away
    run_outer_step: int = 0     # the run's position (the first contributor's counters)
    run_step: int = 0
    average_ok: bool = False    # overlap: every contributor holds the whole average launched last boundary
    steps: list[int] = field(default_factory=list)          # every rank's step counter
    round_steps: list[int] = field(default_factory=list)    # diloco.round_seconds: inner steps of this round
    round_tokens: list[int] = field(default_factory=list)   # ... and tokens (the weights of the average)
    norms: list[float] = field(default_factory=list)        # diloco.clip: each rank's pseudo-gradient norm
    scales: list[float] = field(default_factory=list)       # diloco.clip: the factor each rank's is scaled by
    residuals: list[float] = field(default_factory=list)    # diloco.clip: each rank's error-feedback residual norm
    ahead: list[int] = field(default_factory=list)          # contributors that claimed an outer step (or a step) the run is not at
    non_finite: list[int] = field(default_factory=list)     # diloco.clip: contributors whose norm is NaN/Inf
    overweight: list[int] = field(default_factory=list)     # diloco.clip: round tokens bounded to k x the median (logged,
                                                            # not discredited: honest nodes of unlike speed differ too)
    failed_check: list[int] = field(default_factory=list)   # contributions the checked average left out (zb.diloco.verify)

    def clipped(self) -> list[int]:
        """Ranks whose pseudo-gradients diloco.clip scales down in this outer step."""
        return [r for r, s in enumerate(self.scales) if s < 1.0]

    def discredited(self) -> list[int]:
        """Ranks whose claims did not hold in this outer step: counted toward eviction as an outsized clip is."""
        return sorted(set(self.outsized()) | set(self.ahead) | set(self.non_finite) | set(self.failed_check))

    def outsized(self) -> list[int]:
        """Clipped ranks whose norm is also over clip.OUTSIZED x the median: what counts toward a node clipped
        in a row."""
        over = set(outsized(self.norms, self.contributors))
        return [r for r in self.clipped() if r in over]



def make_plan(roles: list[int], outer_steps: list[int], steps: list[int] | None = None,
              digests: list[int] | None = None, arrived: list[int] | None = None,
              round_steps: list[int] | None = None, round_tokens: list[int] | None = None,
              norms: list[float] | None = None, clip: float | None = None, evicted: list[int] | None = None,
              residuals: list[float] | None = None) -> Plan:
    """`evicted`: ranks of nodes diloco.evict_clipped evicted that are still in the world (the leader drops them
    at the next resolution): their contributions count for nothing, and they neither apply nor receive."""
    n = len(roles)
    steps = steps or [0] * n
    digests = digests or [UNKNOWN_DIGEST] * n
    arrived = arrived or [Arrived.NONE] * n
    norms = list(norms or [0.0] * n)
    # Counts a rank states for itself are never negative: a negative token count would flip the sign of its
    # update's weight, a negative round a step count the others would add.
    round_tokens = [max(0, t) for t in (round_tokens or [0] * n)]
    round_steps = [max(0, t) for t in (round_steps or [0] * n)]
    out = set(evicted or ())
    ranks = [r for r in range(n) if r not in out] or list(range(n))
    trained = [r for r in ranks if roles[r] == Role.CONTRIBUTOR]
    # diloco.clip: a NaN/Inf norm would poison the average; its node applies the others' instead.
    non_finite = [r for r in trained if clip is not None and not (math.isfinite(norms[r]) and norms[r] >= 0)]
    contributors, ahead = _current([r for r in trained if r not in non_finite], outer_steps, digests)
    if not contributors:
        # Nobody trained with the run yet (every earlier node is gone): those holding recovered state
        # carry the run on; with none, this is a fresh start from identical seeded weights.
        recovered = [r for r in ranks if roles[r] == Role.RECOVERED]
        contributors = _current(recovered, outer_steps, digests)[0] or ranks
    first = contributors[0]
    run_outer_step = outer_steps[first]
    appliers = sorted(set(contributors) | {r for r in ranks if roles[r] in (Role.RECOVERED, Role.CONTRIBUTOR)
                                           and r not in ahead and outer_steps[r] == run_outer_step
                                           and _same(digests[r], digests[first])})
    receivers = [r for r in ranks if r not in appliers]
    # A transfer can end on some nodes and fail on others (a peer died mid-ring): the average is applied
    # only when every contributor has it, so no node ever applies what another skips.
    average_ok = all(arrived[r] == Arrived.OK for r in contributors)
    tokens, overweight = bounded_tokens(round_tokens, contributors, clip)
    step, off_start = run_step(steps, round_steps, contributors, clip)
    return Plan(contributors=contributors, appliers=appliers, receivers=receivers,
                donor=contributors[run_outer_step % len(contributors)] if receivers else None,
                run_outer_step=run_outer_step,
                run_step=step,
                average_ok=average_ok, steps=list(steps), round_steps=round_steps,
                round_tokens=tokens, norms=norms, scales=clip_scales(norms, contributors, clip),
                residuals=credible_residuals(residuals or [0.0] * n, clip), ahead=sorted(ahead + off_start), non_finite=non_finite,
                overweight=overweight)


def run_step(steps: list[int], round_steps: list[int], contributors: list[int],
             k: float | None) -> tuple[int, list[int]]:
    """The run's step after this round: where the contributors started it (the median of step - round steps;
    every honest contributor started where the last outer step left the run) plus the furthest credible round
    (diloco.round_seconds: the fastest node's steps set the LR schedule; with fixed rounds all are equal). A
    contributor whose start is not the run's claims a step it did not train to: it is returned with the step
    (the plan names it `ahead`). With diloco.clip a round counts at most k x the contributors' (lower) median
    round."""
    starts = {r: steps[r] - round_steps[r] for r in contributors}
    start = statistics.median_low(starts.values())
    credible = [r for r in contributors if starts[r] == start]
    furthest = max(round_steps[r] for r in credible)
    positive = [round_steps[r] for r in credible if round_steps[r] > 0]
    if k is not None and len(positive) >= 2:
        furthest = min(furthest, int(k * statistics.median_low(positive)))
    return start + furthest, [r for r in contributors if r not in credible]


def _current(ranks: list[int], outer_steps: list[int], digests: list[int]) -> tuple[list[int], list[int]]:
    """The ranks that stand where the run stands, and those that claim to be past it. The run stands at
    the newest outer step more than half of `ranks` reached (an even split takes the older: one node's
    claim of being ahead never outvotes another's), then with the params digest most of those hold (a
    tie goes to the lowest rank's)."""
    if not ranks:
        return [], []
    newest_first = sorted((outer_steps[r] for r in ranks), reverse=True)
    position = newest_first[len(ranks) // 2]
    ahead = [r for r in ranks if outer_steps[r] > position]
    at = [r for r in ranks if outer_steps[r] == position]
    known = [digests[r] for r in at if digests[r] != UNKNOWN_DIGEST]
    if not known:
        return at, ahead
    counts = Counter(known)
    majority = max(counts, key=lambda d: (counts[d], -known.index(d)))
    return [r for r in at if _same(digests[r], majority)], ahead


def _same(a: int, b: int) -> bool:
    return UNKNOWN_DIGEST in (a, b) or a == b


def digest_value(digest: bytes) -> int:
    """A params digest as one int64 for the check-in table (never UNKNOWN_DIGEST)."""
    return int.from_bytes(digest[:8], "little", signed=True) or 1


def check_in(pg: dist.ProcessGroup, rank: int, size: int, role: int, *, outer_step: int, step: int,
             deadline_s: float, digest: int = UNKNOWN_DIGEST, arrived: int = Arrived.NONE,
             round_steps: int = 0, round_tokens: int = 0, norm: float = 0.0, clip: float | None = None,
             evicted: list[int] | None = None, residual: float = 0.0) -> Plan:
    """All-reduce every rank's (role, outer step, step, digest, arrived, round steps, round tokens, pseudo-
    gradient norm, error-feedback residual norm) and derive the plan (with diloco.clip's factors, without the
    `evicted` ranks); PeerFailure if a peer is missing. Each rank writes only its own column, so SUM assembles
    the table."""
    table = torch.zeros(9, size, dtype=torch.int64)
    table[:, rank] = torch.tensor([role, outer_step, step, digest, arrived, round_steps, round_tokens,
                                   to_bits(norm), to_bits(residual)], dtype=torch.int64)
    try:
        pg.allreduce([table]).wait(timedelta(seconds=deadline_s))
    except Exception as e:  # noqa: BLE001 - gloo names an address; the retry resolves the world anyway
        raise PeerFailure(f"outer-step check-in failed: {str(e).splitlines()[0]}", rank=None) from None
    roles, outer_steps, steps, digests, all_arrived, all_round_steps, all_round_tokens, bits, res = table.tolist()
    # A residual's norm only widens the check's bound: one that is not a finite non-negative number widens nothing.
    residuals = [v if math.isfinite(v) and v > 0 else 0.0 for v in map(from_bits, res)]
    return make_plan(roles, outer_steps, steps, digests, all_arrived, all_round_steps, all_round_tokens,
                     [from_bits(b) for b in bits], clip, evicted, residuals)
