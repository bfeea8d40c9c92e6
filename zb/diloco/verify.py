"""diloco.clip: the checked average (blocking DiLoCo). A node states its pseudo-gradient's norm in the check-in
and scales its own contribution by diloco.clip's factor (zb.diloco.clip): both are its word alone. What the
all-reduce brings is checked against those words on every node alike:

- the sum must be finite;
- its norm must be at most what the stated norms allow: sum_i w_i s_i n_i (the triangle inequality; w_i the
  contributor's weight, s_i its clip factor, n_i its stated norm), plus the error-feedback residuals the ring
  adds, times the quantization's proven error bound (`slack`; 1 + 2^-18 x ranks for fp32).

An honest round passes by construction (the bound holds for any honest vectors), so the check costs one norm
over the average. A round that fails is reduced again in halves, each half checked alike (contributors outside
a half send zeros), down to single contributions: a part that passes is kept, a lone contribution that fails
is left out and its node named (Plan.failed_check, counted toward eviction by zb.diloco.trust), and the update
is the kept parts' sum over their weight. Every node reaches the same verdicts from the same bytes, so they
split alike. A round with one liar among M costs up to 2 ceil(log2 M) more all-reduces; the parts run without
error feedback (this round's residual is kept as it was before the round).

What it does not catch: a contribution under its stated norm but pointing the wrong way (a sign flip), and a
lie smaller than the slack (at int4 and int2 the quantization's worst case is a wide bound; see `slack`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from zb.collectives.kernels import SCHEMES
from zb.collectives.sparse_twins import HIGH

PER_QUANTIZATION = {"int8": 1 / 254, "int4": 1 / 14, "int2": 1.0}   # one absmax quantization's worst step
FP32_PER_RANK = 2.0 ** -18                                           # fp32 sums and norms, with room


def slack(compression: str, ranks: int) -> float:
    """The factor by which an all-reduce's output norm can exceed the exact sum's, at worst (tests/test_allreduce.py
    derives the per-element bound: ((1 + q)^W - 1) x the blocks' max; a block's max is at most its norm, so
    over the vector the excess is at most sqrt(block) times that of the inputs' norms)."""
    base = 1.0 + FP32_PER_RANK * ranks
    if compression == "none":
        return base
    if compression == "sparse":
        # A chunk sends at most K' x (11/8 mean)^2 of energy, and its K' picked values hold at least K' x mean^2
        # (Cauchy-Schwarz): every payload is at most 11/8 of its accumulator's norm (zb.collectives.sparse_twins).
        return base * HIGH
    q = PER_QUANTIZATION[compression]
    return base + ((1.0 + q) ** ranks - 1.0) * math.sqrt(SCHEMES[compression].block)


def bound(part: Sequence[int], weights: Sequence[float], scales: Sequence[float], norms: Sequence[float],
          residual: float = 0.0) -> float:
    """The largest norm the sum of `part`'s contributions can have if each node's stated norm is true, plus
    `residual` (the error-feedback residuals the ring adds, in the same units)."""
    return sum(weights[r] * scales[r] * norms[r] for r in part) + residual


def credible_residuals(residuals: Sequence[float], k: float | None) -> list[float]:
    """The residual norms the check's bound adds: each rank's stated one, at most k x their (lower) median, so one
    rank cannot widen the bound for its own contribution by stating a huge residual."""
    stated = [r for r in residuals if r > 0]
    if k is None or len(stated) < 2:
        return list(residuals)
    cap = k * statistics.median_low(stated)
    return [min(r, cap) for r in residuals]


def passes(norm_sq: float, limit: float, factor: float) -> bool:
    """A part's sum (its squared norm) is finite and within `factor` x `limit` (a tiny floor for all-zero sums)."""
    return math.isfinite(norm_sq) and math.sqrt(norm_sq) <= factor * limit + 1e-30


def halves(part: Sequence[int]) -> list[list[int]]:
    """A failed part's two halves, in rank order (the same on every node)."""
    mid = len(part) // 2
    return [list(part[:mid]), list(part[mid:])]
