"""The one exception a failed all-reduce raises, whatever the compression or backend."""

from __future__ import annotations

from zb.errors import EnvironmentFailure


class PeerFailure(EnvironmentFailure):
    """A transfer with a peer failed (it died, hung past its deadline, or reported a failure).

    rank:     group rank of the suspect peer, or None when it cannot be identified (gloo's own
              collectives only name an address). In the int8 ring it is the ring neighbour whose
              transfer failed, or the rank a neighbour reported as failed (failures are forwarded
              along the ring, so survivors name the same rank when the failure is a dead peer).
    observer: group rank of the process raising it.
    After a PeerFailure the tensor's content is undefined and the group must be rebuilt.
    """

    def __init__(self, message: str, *, rank: int | None, observer: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.observer = observer
