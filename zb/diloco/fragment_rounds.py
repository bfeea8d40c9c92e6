"""diloco.round_seconds under streaming: rounds that end by time, shared among the fragments.

A round of diloco.round_seconds holds P fragment boundaries, one every round_seconds / P (a round
clock of P parts, zb.diloco.rounds). Each boundary is an outer step, and the fragment it syncs is the
run's outer step mod P: every node counts the same outer steps (joiners receive the count), so every
node picks the same fragment with nothing said. Within a part, a node launches the fragment's
all-reduce when its clock expects the part to end within tau steps (tau = diloco.fragment_delay: the
round clock's decision with a lead of tau steps), and its boundary falls exactly tau steps later, or at
the run's last step. Nodes of unlike speed launch and apply at steps of their own: a slow node trains
fewer. The run's step after a boundary is the furthest contributor's (zb.diloco.algorithm.adaptive_plan).

How the average is weighted: by the tokens each node trained since it last launched that fragment.
That is the span of the fragment's pseudo-gradient up to its launch, and every step counts once per
fragment (the tau steps after a launch move the model too, and what the merge keeps of them enters the
fragment's next launch). The tokens travel with the pseudo-gradient: the background thread sums them
first (one value) and each node sends tokens / total of its share (zb.diloco.background), so nothing
has to be agreed at a check-in before the launch. A node that received the run's state counts from
its hand-over; a node restarted from a checkpoint counts from its restart (the counts are weights, not
state: a whole-run restart resets them on every node alike).
"""

from __future__ import annotations

from zb.diloco.rounds import RoundClock


class FragmentRounds:
    """Decides, after every inner step, whether a fragment launches or applies (see the module doc)."""

    def __init__(self, clock: RoundClock, fragments: int, delay: int):
        self.clock, self.fragments, self.delay = clock, fragments, delay
        self.fragment = 0                      # the fragment of this part's boundary
        self.after_launch: int | None = None   # steps since this part's launch; None before it
        self.steps = 0                         # inner steps this node took through the clock
        self.launched_at = [0] * fragments     # self.steps at each fragment's last launch

    def begin(self, outer_step: int, launched: bool) -> None:
        """A part starts: the loop begins, or an outer step just ended (`outer_step`: the run's next one).
        `launched`: its fragment is in flight already (a restart from a checkpoint that kept its average):
        the boundary comes tau steps from here."""
        self.fragment = outer_step % self.fragments
        self.after_launch = 0 if launched else None

    def sync_points(self, step: int) -> tuple[int | None, int | None]:
        """(fragment to launch, fragment to apply) after inner step `step` (this node's counter)."""
        self.steps += 1
        launch = None
        if self.after_launch is None:
            if not self.clock.over(step, lead=self.delay):
                return None, None
            launch, self.after_launch = self.fragment, 0
        else:
            self.clock.tick()
            self.after_launch += 1
        if self.after_launch < self.delay and step < self.clock.total_steps:
            return launch, None
        return launch, self.fragment

    def take_tokens(self, fragment: int) -> int:
        """The tokens behind `fragment`'s launch now (since its last one); its count starts again."""
        steps, self.launched_at[fragment] = self.steps - self.launched_at[fragment], self.steps
        return steps * self.clock.tokens_per_step

    def restart_counts(self) -> None:
        """This node took the run's state: its pseudo-gradients start from there."""
        self.launched_at = [self.steps] * self.fragments
