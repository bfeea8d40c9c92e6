"""A node's role in the next outer step, and the one place it changes.

A node contributes its pseudo-gradient when it trained with the run. It joined a running run and
needs the run's state (blocking join), or it holds the run's state recovered from a live snapshot
and only applies the next update (non-blocking join); a node the run evicted while it was alive and
admitted again needs the state too, since its params are stale. Every way back to contributing goes
through `caught_up`: the node applied the run's update, or received the run's state.
"""

from __future__ import annotations

import logging

from zb.diloco.checkin import Role

log = logging.getLogger("zb.diloco")


class RoleKeeper:
    """This node's `Role` (the value it states at the check-in); every change goes through a method."""

    def __init__(self) -> None:
        self.role = Role.CONTRIBUTOR

    @property
    def contributing(self) -> bool:
        return self.role == Role.CONTRIBUTOR

    @property
    def recovered(self) -> bool:
        return self.role == Role.RECOVERED

    @property
    def joining(self) -> bool:
        """This node joined a running run: it takes part in the current outer step right away."""
        return self.role != Role.CONTRIBUTOR

    def joined(self, *, recovered: bool) -> None:
        """The node was admitted into a run other nodes already train."""
        self.role = Role.RECOVERED if recovered else Role.NEEDS_STATE

    def readmitted(self) -> None:
        """The run dropped this node while it was away (frozen, partitioned) and admitted it again: its
        params are stale, so it receives the run's state instead of contributing them."""
        if self.role == Role.CONTRIBUTOR:
            log.warning("this node was dropped from the run while it was away and is admitted again: it receives "
                        "the run's state at this outer step instead of contributing its stale params")
            self.role = Role.NEEDS_STATE

    def caught_up(self) -> None:
        """The node stands where the run stands (it applied the run's update or received its state)."""
        self.role = Role.CONTRIBUTOR

    def joining_note(self) -> str:
        """How the start line describes a joiner."""
        if self.role == Role.NEEDS_STATE:
            return ", joining a running run: the state comes from a live node at the next outer step"
        if self.role == Role.RECOVERED:
            return ", joining a running run with its recovered outer state (non-blocking join)"
        return ""
