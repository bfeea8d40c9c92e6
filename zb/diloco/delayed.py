"""diloco.overlap = delayed: the naive one-round delay (PCCL's "async DiLoCo", the baseline of the eager
paper, arXiv 2502.12996). The average of round r is applied at the end of round r + 1, and nothing of a
node's own pseudo-gradient is applied before that: every node trains each round from the shared params.

At each round boundary:
  1. the average launched at the previous boundary arrives (the wait is the stall);
  2. this node's pseudo-gradient of the round ending now: the shared params the round started from
     minus the model's params;
  3. the shared outer params and momentum step with the average that arrived, only when the check-in
     found it arrived whole on every contributor (else every node skips it alike);
  4. the pseudo-gradient's all-reduce starts behind the next round's inner steps;
  5. the model takes the shared params, and the next round trains from there.

It is eager overlap without the eager term (zb.diloco.eager_overlap's buffers, with no own term), so
everything eager's boundary agrees on (what arrived, late joiners, checkpoints of the average in flight,
the run's close on the shared params) holds here too.
"""

from __future__ import annotations

from zb.diloco.algorithm import Applied, NodeContext, Step, warn_non_finite_own
from zb.diloco.arrival import apply_arrived
from zb.diloco.eager_overlap import EagerAlgorithm
from zb.diloco.outer import OuterState
from zb.elastic import localsync
from zb.overlap_modes import Delayed


class DelayedAlgorithm(EagerAlgorithm):
    mode = Delayed

    def __init__(self, ctx: NodeContext, outer: OuterState):
        super().__init__(ctx, outer, own_term=False)

    def apply(self, step: Step) -> Applied:
        """2-3: this round's pseudo-gradient, then the shared step with the average that arrived."""
        ov, plan, me = self.state, step.plan, step.me
        contributing = me in plan.contributors and not step.closing
        finite = localsync.all_ok(self.ctx.local_group, ov.take_fresh(contributing))
        step.report.applied = apply_arrived(self.ctx, self.outer, ov, step.view, plan, step.arrival)
        if contributing and not finite:
            warn_non_finite_own()   # it still travels, so every node skips that average; the launch resets the params
            self.ctx.optimizer.state.clear()
        return Applied(joined_run=me in plan.appliers, caught_up=step.was_recovered and me in plan.appliers)


