"""Speed-adaptive rounds (diloco.round_seconds): when a node's round ends, and how the run weighs the
pseudo-gradients of nodes that trained different numbers of steps in it.

When a round ends. Each node measures its budget on its own monotonic clock from the end of the
last outer step. The outer step is a collective (check-in, all-reduce), so it ends within a
transfer's skew at the same moment on every node: that shared event is the round's agreed start,
and no wall-clock time ever crosses the network, so skewed or stepping clocks change nothing. A
node starts another inner step only if that step is expected to end within the budget (elapsed +
step <= budget, the step time an average of this node's recent steps). So no node overshoots (but
by an estimate's error): the fast nodes, which carry most of the run's tokens, end within one of
their short steps of the budget, and the waiting at the check-in falls on the slow node, which
idles for less than one of its own steps. (Stopping at the step nearest the budget instead lets
the slow node overshoot by up to half its step while every fast node waits; the benchmark on a busy
2-core machine could not separate the two, BENCHMARKS.md.) Every round has at least one step: a node
slower than the budget still contributes. The local ranks of a node agree on every decision (one
tiny all-reduce on the control group), since FSDP needs them to take the same steps.

How the average is weighted: by tokens. Node i's pseudo-gradient is multiplied by w_i = tokens_i /
sum(tokens) before the SUM all-reduce (the tokens come from the check-in table, so every node
knows the total before it sends), and the sum is the run's update. This is SWARM's token weighting:
every token the run trained on counts once, as in one data-parallel step over all of them; a node
that trained three times the tokens moved its copy three times as far on three times the data, and
its pseudo-gradient is the less noisy one. A node with no step weighs 0 and still applies the update.
FedNova (update normalised by each node's step count, then scaled by an effective count) corrects
the objective bias of non-IID local data; zb's nodes read IID shards of one data set, where that
bias is small (RESEARCH.md, section 3), and FedNova's normalisation assumes SGD-like updates that
grow linearly with the step count, which Adam's do not. A uniform average (HALoS's "DynUpd"
baseline) would give a slow node's short trajectory the weight of a long one and dilute the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zb.elastic import localsync
from zb.errors import InvalidInput

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

log = logging.getLogger("zb.diloco")

EARLY_ROUNDS = 3      # a budget shorter than one step this early in a node's run is a config mistake: refused
STEP_EMA = 0.5        # weight of the newest step time in the estimate (recent speed matters: a node can slow down)


@dataclass(frozen=True)
class RoundWork:
    """What this node trained in the round that ends: its steps and tokens."""

    steps: int
    tokens: int


class RoundClock:
    """Decides, after every inner step, whether this node's round is over (see the module doc)."""

    def __init__(self, budget_s: float, total_steps: int, tokens_per_step: int,
                 local_group: ProcessGroup | None = None,
                 clock: Callable[[], float] = time.perf_counter, parts: int = 1):
        self.budget_s, self.total_steps, self.tokens_per_step = budget_s, total_steps, tokens_per_step
        self.local_group, self.clock = local_group, clock
        # Streaming (zb.diloco.fragment_rounds): a round holds one boundary per fragment, each ending a part.
        self.parts = parts
        self.part_s = budget_s / parts
        self.step_s: float | None = None   # this node's step time estimate, kept across rounds
        self.round_budget_s = self.part_s  # this round's (part's) budget: shorter in the run's last round
        self.started: float | None = None
        self.last: float = 0.0
        self.steps = 0
        self.rounds = 0
        self.overruns = 0                  # consecutive rounds whose budget did not hold their shortest round
        self._warned = False

    def start(self, run_step: int | None = None, last_max_steps: int = 0, *, carry: bool = False) -> None:
        """A round starts now (the loop begins, or an outer step just ended at `run_step`, the furthest
        node having trained `last_max_steps` steps in the round that ended). When the run's end is nearer
        than the furthest node's last round, the budget shrinks in proportion, on every node alike (the
        inputs come from the check-in): else the node that reaches the last step ends its round early
        and the others train on to the full budget while it waits. `carry`: the outer step was skipped, so the
        next one's pseudo-gradient covers this round's steps too: they keep counting (the round's work, and
        where the node started it, stay what the check-in compares)."""
        self.started = self.last = self.clock()
        if not carry:
            self.steps = 0
        self.round_budget_s = self.part_s
        if run_step is not None and last_max_steps > 0 and run_step + last_max_steps > self.total_steps:
            self.round_budget_s = self.part_s * max(0, self.total_steps - run_step) / last_max_steps

    def over(self, step: int, lead: int = 0) -> bool:
        """Called after each inner step (`step`: this node's step counter): True when the round ends here,
        or, with a `lead` of n steps (streaming's fragment_delay), when it ends n steps from here (those
        steps then call `tick`)."""
        elapsed = self._measure()
        assert self.step_s is not None  # _measure estimated it
        mine = step + lead >= self.total_steps or elapsed + (lead + 1) * self.step_s > self.round_budget_s
        # FSDP needs every local rank to take the same steps: the round ends when any rank says so.
        over = not localsync.all_ok(self.local_group, not mine)
        if over:
            self._check_budget(elapsed, lead)
        return over

    def tick(self) -> None:
        """An inner step after the round's end was decided (`over` with a lead): timed and counted."""
        self._measure()

    def _measure(self) -> float:
        """The step that just ended: counted, its time folded into the estimate; the round's elapsed time."""
        if self.started is None:
            self.start()  # a loop that did not announce its start: time from the first step's end
        assert self.started is not None  # start() set it
        now = self.clock()
        took = now - self.last
        self.last = now
        self.steps += 1
        self.step_s = took if self.step_s is None else STEP_EMA * took + (1 - STEP_EMA) * self.step_s
        return now - self.started

    def work(self) -> RoundWork:
        return RoundWork(self.steps, self.steps * self.tokens_per_step)

    def _check_budget(self, elapsed: float, lead: int) -> None:
        """A round that ended after its first step with no room for its `lead` steps, twice in a row: the
        budget is too short for this node (refused early in the run, when it is a config mistake)."""
        self.rounds += 1
        short = self.steps == 1 and elapsed + lead * (self.step_s or 0.0) > self.part_s
        short = not localsync.all_ok(self.local_group, not short)
        self.overruns = self.overruns + 1 if short else 0
        if self.overruns < 2:
            return
        assert self.step_s is not None  # over() estimated it before it asked
        steps = lead + 1
        if self.parts == 1 and steps == 1:
            what = f"diloco.round_seconds = {self.budget_s:g} is shorter than one inner step on this node"
            now = f"now takes longer than diloco.round_seconds ({self.budget_s:g} s): it trains one step per round"
        else:
            what = (f"diloco.round_seconds = {self.budget_s:g} gives each of its {self.parts} fragment boundaries "
                    f"{self.part_s:.3g} s, shorter than diloco.fragment_delay + 1 = {steps} inner steps on this node")
            now = (f"now takes longer than {self.part_s:.3g} s (diloco.round_seconds / diloco.fragments) over "
                   f"{steps} steps (diloco.fragment_delay + 1): it trains {steps} steps per fragment boundary")
        if self.rounds <= EARLY_ROUNDS:
            at_least = max(1.0, 4 * self.parts * steps * self.step_s)
            raise InvalidInput(f"{what} ({self.step_s:.2f} s each): give a budget of several steps (at least "
                               f"{at_least:.0f} s here), or unset it for rounds of diloco.inner_steps")
        if not self._warned:
            self._warned = True
            log.warning("this node's inner step (%.2f s) %s, and the other nodes wait for it at each outer step",
                        self.step_s, now)


def token_weight(tokens: list[int], contributors: list[int], rank: int) -> float:
    """This rank's share of the run's update: its tokens over the contributors' total (0 when it does not
    contribute, or when no contributor trained at all)."""
    total = sum(tokens[r] for r in contributors)
    if rank not in contributors or total <= 0:
        return 0.0
    return tokens[rank] / total


def weighted_average(deltas: list[torch.Tensor], tokens: list[int]) -> torch.Tensor | None:
    """The reference rule, in one process: sum_i tokens_i * delta_i / sum_i tokens_i (tests hold the
    all-reduce path against it). None when no node trained."""
    total = sum(tokens)
    if total <= 0:
        return None
    out = deltas[0] * 0.0
    for delta, t in zip(deltas, tokens):
        out = out + delta * (t / total)
    return out
