"""Which ordered pairs `zb iperf-mesh` measures when: rounds in which no node is in two measurements.

Pure functions, no I/O; tests/test_iperf_mesh.py checks them for world sizes 1..7.

A node that sends and receives at once, or receives from two peers, shares its link between
measurements and reports each a fraction of the truth. The circle method (round-robin tournament)
splits the unordered pairs into W-1 rounds (W even) or W rounds (W odd, one node idle per round)
of disjoint pairs; each round is measured in two phases, a -> b for every pair, then b -> a.
`serial` measures one ordered pair per phase instead: slower, but no two links share a switch
or an uplink either (a shared bottleneck elsewhere in the network).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """Ordered pairs (sender, receiver) measured at the same time, and a label for progress lines."""

    label: str
    pairs: tuple[tuple[int, int], ...]


def round_robin(world: int) -> list[list[tuple[int, int]]]:
    """Circle method: rounds of disjoint unordered pairs (a < b) that cover every pair once."""
    nodes: list[int | None] = list(range(world))
    if world % 2:
        nodes.append(None)  # the idle slot: whoever meets it sits the round out
    n = len(nodes)
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = nodes[i], nodes[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        nodes = [nodes[0], nodes[-1], *nodes[1:-1]]  # node 0 stays, the others rotate one place
    return [r for r in rounds if r]


def mesh_phases(world: int, serial: bool = False) -> list[Phase]:
    """Every ordered pair exactly once; within a phase no node appears twice."""
    rounds = round_robin(world)
    if serial:
        ordered = [p for pairs in rounds for a, b in pairs for p in ((a, b), (b, a))]
        return [Phase(f"pair {i + 1}/{len(ordered)}", (p,)) for i, p in enumerate(ordered)]
    phases = []
    for i, pairs in enumerate(rounds):
        label = f"round {i + 1}/{len(rounds)}"
        phases.append(Phase(label, tuple(pairs)))
        phases.append(Phase(label, tuple((b, a) for a, b in pairs)))
    return phases
