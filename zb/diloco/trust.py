"""diloco.clip and diloco.evict_clipped over a run: which nodes were discredited in how many outer steps in a
row, which the run evicted, and what that means for this node. A node is discredited in an outer step when
its claims did not hold (Plan.discredited): clipped as outsized (zb.diloco.clip), ahead of the run's position,
a non-finite norm, or a contribution the checked average left out (zb.diloco.verify). zb.diloco.clip and zb.diloco.checkin have the rules for one round; this class keeps the
state across rounds.

Every decision is a pure function of the check-in tables every node saw (clip.clipped_in_a_row,
clip.to_evict), so every node takes it alike: an evicted node counts for nothing from the next outer
step on (the check-in leaves its rank out), the leader leaves it out of the next world and never admits
its id again (keys.EVICTED, written by the node's claims), and an evicted node leaves after it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from zb.diloco import clip
from zb.diloco.checkin import Plan
from zb.errors import InvalidInput

log = logging.getLogger("zb.diloco")

CLIPPED_REPORT_AFTER = 3     # outer steps in a row a node is discredited (clipped over clip.OUTSIZED x the median, or
                             # a claim that did not hold) before it is reported (and with diloco.evict_clipped, evicted)


class Nodes(Protocol):
    """The world a plan's ranks index (zb.elastic.WorldView)."""

    @property
    def nodes(self) -> list[str]: ...


class ClipTrust:
    """The clipped-in-a-row counts and the evicted ids of one node's run (the same on every node)."""

    def __init__(self, k: float | None, evict: bool, *, speaks: bool):
        self.k, self.evict, self.speaks = k, evict, speaks   # speaks: this rank logs for the node (its head)
        self.clipped_rounds: dict[str, int] = {}   # node id -> outer steps in a row it was discredited
        self.counted = -1                           # the outer step those counts include
        self.evicted: set[str] = set()              # node ids the run evicted
        self.evicted_now: list[str] = []            # ... at this outer step (for its report)
        self.unlisted: set[str] = set()             # ... not written to the store's list of evicted ids yet

    def evicted_ranks(self, view: Nodes) -> list[int]:
        """The ranks of `view` whose node the run evicted (the check-in leaves them out)."""
        return [r for r, uid in enumerate(view.nodes) if uid in self.evicted]

    def note(self, view: Nodes, plan: Plan, outer_step: int) -> None:
        """One check-in's discredited nodes: counted once per outer step however many attempts checked in; a
        node discredited CLIPPED_REPORT_AFTER outer steps in a row is evicted (with diloco.evict_clipped)."""
        if outer_step != self.counted:
            self.counted = outer_step
            self.clipped_rounds = clip.clipped_in_a_row(self.clipped_rounds,
                                                        (view.nodes[r] for r in plan.discredited()))
            if self.evict:
                self._evict(clip.to_evict(self.clipped_rounds, CLIPPED_REPORT_AFTER, self.evicted))
        if self.speaks:
            self._say(view, plan)

    def _evict(self, uids: Iterable[str]) -> None:
        for uid in uids:
            self.evicted.add(uid)
            self.unlisted.add(uid)
            self.evicted_now.append(uid)
            if self.speaks:
                log.error("diloco.evict_clipped: node %s is evicted from the run: it was discredited in %d outer "
                          "steps in a row (clipped over diloco.clip = %g x the round's median, or claims the others "
                          "did not back); from the next outer step it counts for nothing, and its id is not admitted "
                          "again", uid, self.clipped_rounds[uid], self.k)

    def _say(self, view: Nodes, plan: Plan) -> None:
        contributing = sorted(plan.norms[r] for r in plan.contributors)
        for uid, in_a_row in self.clipped_rounds.items():
            if in_a_row >= CLIPPED_REPORT_AFTER and uid not in self.evicted:
                log.error("diloco.clip: node %s was discredited in %d outer steps in a row: a diverged or hostile "
                          "node? (its updates count for at most diloco.clip x the median)", uid, in_a_row)
        outsized = set(plan.outsized())
        for r in plan.clipped():   # a mild clip (with K under clip.OUTSIZED, of honest nodes too) is no warning
            log.log(logging.WARNING if r in outsized else logging.INFO,
                    "diloco.clip: node %s's pseudo-gradient norm %.4g is over %g x the round's median %.4g: scaled "
                    "down by %.3g", view.nodes[r], plan.norms[r], self.k,
                    contributing[(len(contributing) - 1) // 2], plan.scales[r])
        for ranks, claim in ((plan.ahead, "claims a position past the one most contributors hold: it receives the "
                                          "run's state instead of donating it"),
                             (plan.non_finite, "states a non-finite pseudo-gradient norm: it is left out of the "
                                               "average and applies the others'"),
                             (plan.failed_check, "failed the checked average (non-finite, or larger than the norm "
                                                 "it stated): its contribution is left out of this outer step")):
            for r in ranks:
                log.warning("node %s %s", view.nodes[r], claim)
        for r in plan.overweight:   # bounded, not discredited: an honest fast node trains more than the median too
            log.info("node %s claims a token count for its round over diloco.clip = %g x the round's median: it weighs "
                     "as %d tokens", view.nodes[r], self.k, plan.round_tokens[r])

    def take_evicted_now(self) -> list[str]:
        """The ids evicted at this outer step, for its report (once)."""
        now, self.evicted_now = self.evicted_now, []
        return now

    def listed(self) -> None:
        """The store's list of evicted ids holds every id evicted so far."""
        self.unlisted.clear()

    def refuse_if_evicted(self, me: str) -> None:
        """An evicted node leaves (exit 2), on every local rank alike (the caller agrees on it)."""
        if me in self.evicted:
            raise InvalidInput(f"this node ({me}) was evicted by diloco.evict_clipped after {CLIPPED_REPORT_AFTER} "
                               "discredited outer steps in a row: its pseudo-gradient norm was over diloco.clip = "
                               f"{self.k:g} x the round's median, non-finite or not what it sent, or it claimed a "
                               "position or token count the others did not back (a diverged node? check its data "
                               "and settings); the run does not admit its id again")
