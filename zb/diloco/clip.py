"""diloco.clip: robust aggregation of the pseudo-gradients (blocking DiLoCo).

Every contributor's pseudo-gradient norm travels in the check-in table (zb.diloco.checkin); every node
then computes the same factors from the same numbers: a contribution whose norm exceeds k times the
median norm of the round's contributors (k = diloco.clip) is scaled down to k times that median before
the all-reduce. One node's outsized update (a bug, a diverged node, a hostile one) then moves the average
by at most k times what a typical node moves it. The median is the lower one (with two contributors,
the smaller norm), so with two nodes the larger of the two is bounded by the other.

With diloco.evict_clipped, a node clipped in a few outer steps in a row (zb.diloco.trust.CLIPPED_REPORT_AFTER) is
evicted: `clipped_in_a_row` and `to_evict` are the decision, a pure function of the check-in tables every
node saw, so every node that saw them takes it alike.

A round's token count (the weight of a node's update under diloco.round_seconds) is a claim too, bounded
the same way (`bounded_tokens`). The norm a node states is checked against what its contribution does
to the sum (zb.diloco.verify).

What it does not stop: an update of normal size that points the wrong way (a sign flip) is averaged in
like any other and moves the average by at most 2/M of one update (M contributors); nor several hostile
nodes that are the majority of a round.
"""

from __future__ import annotations

import math
import statistics
import struct
from collections.abc import Collection, Iterable

import torch

NORM_CHUNK = 4096   # values per fp32 partial norm in `squared_norm`


def squared_norm(t: torch.Tensor) -> float:
    """The sum of squares of `t`: fp32 norms of chunks of NORM_CHUNK values, squared and summed in fp64. Within
    3e-7 of the fp64 sum for heavy-tailed values (a few ulps per chunk), at a fifth of its time (one cast of the
    whole buffer to fp64 took 32 ms for 2M values): the stated norm and the checked average's are the same sum."""
    flat = t.reshape(-1)
    head = flat.numel() - flat.numel() % NORM_CHUNK
    total = torch.linalg.vector_norm(flat[:head].view(-1, NORM_CHUNK), dim=1).double().square().sum() if head else 0.0
    return float(total + flat[head:].double().square().sum())


def clip_scales(norms: list[float], contributors: list[int], k: float | None) -> list[float]:
    """Per rank, the factor its pseudo-gradient is scaled by (1.0: as it is). Non-finite norms are left alone:
    such a node does not contribute (zb.diloco.checkin leaves it out of the contributors)."""
    scales = [1.0] * len(norms)
    finite = [norms[r] for r in contributors if math.isfinite(norms[r])]
    if k is None or len(finite) < 2:
        return scales
    bound = k * statistics.median_low(finite)
    for r in contributors:
        if math.isfinite(norms[r]) and norms[r] > bound > 0:
            scales[r] = bound / norms[r]
    return scales


# A clipped contribution counts toward the nodes "clipped in a row" (reported; with diloco.evict_clipped,
# evicted) only when its norm is over this many times the round's median: with K below it (K = 1 scales
# every contribution above the median) honest nodes a few percent over the median would count too.
OUTSIZED = 2.0


def outsized(norms: list[float], contributors: list[int]) -> list[int]:
    """Contributors whose norm is over OUTSIZED times the round's (lower) median norm."""
    finite = [norms[r] for r in contributors if math.isfinite(norms[r])]
    if len(finite) < 2:
        return []
    bound = OUTSIZED * statistics.median_low(finite)
    return [r for r in contributors if math.isfinite(norms[r]) and norms[r] > bound > 0]


def bounded_tokens(tokens: list[int], contributors: list[int], k: float | None) -> tuple[list[int], list[int]]:
    """diloco.clip with a weighted average (diloco.round_seconds): a round's token count is what the node says it
    trained, and its weight in the average follows it, so it is bounded as a norm is: at most k times the
    contributors' (lower) median. Returns the counts the average weighs by, and the contributors whose claim was
    bounded (logged, never counted toward eviction: in a pool of unlike machines an honest fast node trains many
    times the median, so pick k at least that ratio)."""
    positive = [tokens[r] for r in contributors if tokens[r] > 0]
    if k is None or len(positive) < 2:
        return list(tokens), []
    median = statistics.median_low(positive)
    bound = int(k * median)
    bounded = [min(t, bound) if r in contributors else t for r, t in enumerate(tokens)]
    return bounded, [r for r in contributors if tokens[r] > bound]


def clipped_in_a_row(previous: dict[str, int], clipped: Iterable[str]) -> dict[str, int]:
    """Node id -> outer steps in a row it was clipped, after one more outer step that clipped `clipped`
    (a node not clipped in it starts again from zero)."""
    return {uid: previous.get(uid, 0) + 1 for uid in clipped}


def to_evict(in_a_row: dict[str, int], after: int, evicted: Collection[str] = ()) -> list[str]:
    """diloco.evict_clipped: the node ids clipped in `after` outer steps in a row and not evicted yet, sorted."""
    return sorted(uid for uid, n in in_a_row.items() if n >= after and uid not in evicted)


def to_bits(value: float) -> int:
    """A float64 as the int64 of its bits: how a norm rides in the int64 check-in table (a column only its
    rank writes, summed with zeros, so the bits arrive as they left)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]
