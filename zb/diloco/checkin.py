"""The check-in at the start of every outer sync: who sends a real pseudo-gradient, who applies
the update, who must receive the full state.

Each rank of the replica group states its role and its outer-step counter in one tiny all-reduce;
every rank then derives the same Plan from the same numbers (a pure function, tested alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zb.collectives import PeerFailure

CONTRIBUTOR = 0   # trained the inner steps: sends its pseudo-gradient
NEEDS_STATE = 1   # joined (blocking join) or drifted: sends zeros, then receives the full state
RECOVERED = 2     # loaded the run's outer state from a live snapshot: sends zeros, applies the update


@dataclass(frozen=True)
class Plan:
    contributors: list[int]     # ranks whose pseudo-gradients are averaged
    appliers: list[int]         # ranks that apply the averaged update to their outer params
    receivers: list[int]        # ranks that receive the state from `donor` after the step
    donor: int | None
    run_outer_step: int = 0     # the run's position (the first contributor's counters)
    run_step: int = 0

    def role_of(self, rank: int) -> str:
        return "contributor" if rank in self.contributors else "applier" if rank in self.appliers else "receiver"


def make_plan(roles: list[int], outer_steps: list[int], steps: list[int] | None = None) -> Plan:
    n = len(roles)
    contributors = [r for r in range(n) if roles[r] == CONTRIBUTOR]
    if not contributors:
        # Nobody trained with the run yet (every earlier node is gone): those holding recovered state
        # carry the run on; with none, this is a fresh start from identical seeded weights.
        contributors = [r for r in range(n) if roles[r] == RECOVERED] or list(range(n))
    run_step = outer_steps[contributors[0]]
    appliers = sorted(set(contributors) | {r for r in range(n) if roles[r] == RECOVERED and outer_steps[r] == run_step})
    receivers = [r for r in range(n) if r not in appliers]
    steps = steps or [0] * n
    return Plan(contributors, appliers, receivers, contributors[0] if receivers else None, run_step,
                steps[contributors[0]])


def check_in(pg: dist.ProcessGroup, rank: int, size: int, role: int, outer_step: int, step: int,
             deadline_s: float) -> Plan:
    """All-reduce every rank's (role, outer step, step) and derive the plan; PeerFailure if a peer is missing."""
    table = torch.zeros(3 * size, dtype=torch.int64)
    table[rank], table[size + rank], table[2 * size + rank] = role, outer_step, step
    try:
        pg.allreduce([table]).wait(timedelta(seconds=deadline_s))
    except Exception as e:  # noqa: BLE001 - gloo names an address; the retry resolves the world anyway
        raise PeerFailure(f"outer-step check-in failed: {str(e).splitlines()[0]}", rank=None) from None
    values = table.tolist()
    return make_plan(values[:size], values[size:2 * size], values[2 * size:])
