"""Ring order from measured links: the cycle through every node whose slowest hop is fastest.

A ring all-reduce sends every byte along every hop i -> i+1, so its time is set by the slowest
directed link on the cycle: this is the bottleneck travelling-salesman problem on the measured
Mbit/s matrix (directed: uplinks and downlinks differ). Prime solved it with a Held-Karp DP that
refuses n > 30 and needs 2^n * n memory; here:

1. The candidate bottlenecks are the distinct link rates. A cycle with bottleneck >= t exists iff
   the graph of links >= t has a Hamiltonian cycle, which is monotone in t: binary search on t.
2. Each check is a depth-first search for a Hamiltonian cycle from the smallest node, trying first
   the successor with the fewest onward choices (Warnsdorff's rule, which finds cycles in dense
   graphs almost without backtracking) and pruning a branch as soon as an unvisited node has no
   way in or no way out left. A complete search proves the answer; a search that exceeds its
   node budget counts as "no cycle found", so the result is then a lower bound (`exact` False).
   Budgets count search nodes, not seconds, so every machine derives the same order from the
   same matrix.

Unknown or failed links are 0 Mbit/s: usable only when nothing better exists. Ties go to the first
cycle in the search's deterministic order, so the result is a pure function of the matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Search nodes per threshold check. About 2 us each in CPython: a 32-node matrix with nine
# checks stays far below a second even when every check exhausts its budget.
SEARCH_BUDGET = 20_000


@dataclass(frozen=True)
class RingOrder:
    order: list[int]          # node indices; node order[i] sends to order[i + 1] (and the last to the first)
    bottleneck_mbps: float    # the slowest hop of that cycle
    exact: bool               # True: proved the best possible bottleneck; False: a lower bound


def hops(order: Sequence[int]) -> list[tuple[int, int]]:
    return [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]


def bottleneck(matrix: Sequence[Sequence[float | None]], order: Sequence[int]) -> float:
    if len(order) < 2:
        return float("inf")
    return min(_rate(matrix, a, b) for a, b in hops(order))


def _rate(matrix: Sequence[Sequence[float | None]], a: int, b: int) -> float:
    value = matrix[a][b]
    return float(value) if value is not None and value == value and value > 0 else 0.0  # None, NaN, <= 0: unusable


def solve(matrix: Sequence[Sequence[float | None]], budget: int = SEARCH_BUDGET, backward: bool = False) -> RingOrder:
    """The cycle through all n nodes maximizing its slowest hop; starts at node 0. With backward,
    data flows from order[i + 1] to order[i] (gloo's own ring), so the transposed links count."""
    n = len(matrix)
    if backward:
        matrix = [[matrix[b][a] for b in range(n)] for a in range(n)]
    if n <= 2:
        order = list(range(n))
        return RingOrder(order, bottleneck(matrix, order), True)
    rates = sorted({_rate(matrix, a, b) for a in range(n) for b in range(n) if a != b})
    best, exact = list(range(n)), True
    lo, hi = 0, _upper_index(matrix, rates)      # rates[lo] always feasible (0: the complete graph)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found, complete = _hamiltonian_cycle(_adjacency(matrix, rates[mid]), budget)
        if found is not None:
            best, lo = found, mid
        else:
            exact = exact and complete
            hi = mid - 1
    if lo == 0:
        best = _hamiltonian_cycle(_adjacency(matrix, rates[0]), budget)[0] or best
    return RingOrder(best, bottleneck(matrix, best), exact)


def _upper_index(matrix, rates: list[float]) -> int:
    """Index of the largest rate no cycle can beat: every node needs one link out and one in."""
    n = len(matrix)
    bound = min(min(max(_rate(matrix, a, b) for b in range(n) if b != a) for a in range(n)),
                min(max(_rate(matrix, a, b) for a in range(n) if a != b) for b in range(n)))
    return max(i for i, r in enumerate(rates) if r <= bound)


def _adjacency(matrix, threshold: float) -> tuple[list[int], list[int]]:
    n = len(matrix)
    out = [0] * n
    into = [0] * n
    for a in range(n):
        for b in range(n):
            if a != b and _rate(matrix, a, b) >= threshold:
                out[a] |= 1 << b
                into[b] |= 1 << a
    return out, into


def _hamiltonian_cycle(adj: tuple[list[int], list[int]], budget: int) -> tuple[list[int] | None, bool]:
    """(cycle from node 0, True) / (None, True): proved there is none / (None, False): budget spent."""
    out, into = adj
    n = len(out)
    everyone = (1 << n) - 1
    if any(out[v] == 0 or into[v] == 0 for v in range(n)):
        return None, True
    path, left = [0], [budget]

    def dead_end(visited: int, here: int) -> bool:
        free = everyone & ~visited
        rest = free
        while rest:
            v = (rest & -rest).bit_length() - 1
            rest &= rest - 1
            # v must be entered from here or another free node, and must leave to a free node or back to 0.
            if not into[v] & (free | (1 << here)) or not out[v] & (free | 1):
                return True
        return False

    def extend(visited: int, here: int) -> bool | None:
        if visited == everyone:
            return bool(out[here] & 1)
        left[0] -= 1
        if left[0] < 0:
            return None
        if dead_end(visited, here):
            return False
        free = everyone & ~visited
        options = []
        rest = out[here] & free
        while rest:
            v = (rest & -rest).bit_length() - 1
            rest &= rest - 1
            options.append((bin(out[v] & free).count("1"), v))
        gave_up = False
        for _, v in sorted(options):
            path.append(v)
            result = extend(visited | (1 << v), v)
            if result:
                return True
            path.pop()
            gave_up = gave_up or result is None
            if left[0] < 0:
                return None
        return None if gave_up else False

    result = extend(1, 0)
    return (list(path), True) if result else (None, result is not None)


def rotate_to(order: Sequence[int], first: int) -> list[int]:
    """The same cycle, starting at `first` (a ring has no start; zb keeps the leader at rank 0)."""
    i = list(order).index(first)
    return list(order[i:]) + list(order[:i])
