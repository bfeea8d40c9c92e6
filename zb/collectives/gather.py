"""The sparse exchange: every rank's payload to every rank over a ring, the bytes forwarded as they are.

Steps, as rank r of W sees them: at step t (0 .. W-2) it sends rank (r - t)'s payload to its right neighbour
(its own at step 0, then what it received at step t - 1) and receives rank (r - t - 1)'s from its left. So
every link carries each payload once: a rank sends (W - 1) payloads a call, however it is cut. Once all are
in, the caller decodes them in rank order, so every rank adds the same bytes in the same order and ends with
the same bits (zb.collectives.allreduce).

Failures are the quantized ring's (zb.collectives.ring): each receive has a deadline from its size, its step
and the minimum bandwidth (TransferDeadlines); a watchdog sends a FAILED header naming the suspect as this
rank's next message when one passes, so the ranks downstream raise at once with the same suspect; gloo errors
become PeerFailure naming the peer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zb.collectives.peer_failure import PeerFailure
from zb.collectives.pieces import FAILED, HEADER, OK, POOL
from zb.collectives.ring import TransferDeadlines, drive, failure_names, guarded_wait
from zb.collectives.sender import Sender
from zb.collectives.watchdog import Watchdog


class GatherPart:
    """One ring all-gather of this rank's `payload` (uint8) over `pg`; every rank's payload has the same size."""

    def __init__(self, payload: torch.Tensor, pg: dist.ProcessGroup, deadlines: TransferDeadlines,
                 watchdog: Watchdog) -> None:
        self.pg, self.deadlines, self.watchdog = pg, deadlines, watchdog
        self.rank, self.world = pg.rank(), pg.size()
        self.left, self.right = (self.rank - 1) % self.world, (self.rank + 1) % self.world
        self.nbytes = HEADER + payload.numel()
        own = torch.empty(self.nbytes, dtype=torch.uint8)
        own[:HEADER].view(torch.int32).fill_(OK)
        own[HEADER:].copy_(payload)
        self._bufs: dict[int, torch.Tensor] = {self.rank: own}   # by owner rank, with the header
        self.gathered: list[torch.Tensor] = []                   # after finish(): every rank's payload, by rank
        self.recvs: dict[int, tuple[torch.Tensor, dist.Work]] = {}
        self.sent_upto = 0
        self.notified = False
        self.wire_bytes = 0
        self.sender = Sender(pg, self.right, 2, POOL, self._send_deadline, self._names)
        self._post()

    @property
    def total(self) -> int:
        """Messages this rank sends (and receives): one a step, W - 1 steps."""
        return self.world - 1

    def _owner(self, step: int, incoming: bool) -> int:
        return (self.rank - step - (1 if incoming else 0)) % self.world

    def _names(self, peer: int, what: str):
        return failure_names(peer, what, self.rank)

    def _send_deadline(self, step: int, nbytes: int) -> float:
        return 2 * self.deadlines.for_bytes(nbytes, step=step) + self.deadlines.margin(nbytes)

    def _post(self) -> None:
        """Post every receive at once: the payloads are small and all of them are kept until the decode."""
        for step in range(self.total):
            buf = torch.empty(self.nbytes, dtype=torch.uint8)
            with self._names(self.left, "receive from"):
                self.recvs[step] = (buf, self.pg.recv([buf], self.left, step))

    def advance(self, step: int) -> None:
        """Send this step's payload (received at the step before, or this rank's own), keeping what arrives."""
        if step >= self.total:
            return
        self.sender.check()
        if step > 0:
            self._receive(step - 1)
        owner = self._owner(step, incoming=False)
        buf = self._bufs[owner]
        # the sender hands sent buffers back to the pool: send a copy of a payload this rank keeps
        out = POOL.get(self.nbytes)
        out.copy_(buf)
        self.sender.send(step, out)
        self.wire_bytes += self.nbytes
        self.sent_upto = step + 1

    def finish(self) -> None:
        """The last receive, every send done: `gathered` holds every rank's payload, by rank."""
        if self.total:
            self._receive(self.total - 1)
        self.sender.close(timeout=self._send_deadline(self.total, self.nbytes) * 2)
        self.gathered = [buf[HEADER:] for _, buf in sorted(self._bufs.items())]

    def _receive(self, step: int) -> None:
        buf, work = self.recvs.pop(step)
        deadline = self.deadlines.for_bytes(self.nbytes, first=(step == 0), step=step)
        guarded_wait(work, deadline, self.deadlines.margin(self.nbytes), self.watchdog,
                     lambda: self.notify_failure(self.left), self._names(self.left, "receive from"))
        if self.notified:
            raise PeerFailure(f"sparse exchange: receive from rank {self.left} did not finish within {deadline:.1f} s",
                              rank=self.left, observer=self.rank)
        header = buf[:HEADER].view(torch.int32)
        if int(header[0]) != OK:
            suspect = int(header[1]) if int(header[0]) == FAILED else self.left
            raise PeerFailure(f"sparse exchange: rank {self.left} reported a failed transfer with rank {suspect}",
                              rank=None if suspect < 0 else suspect, observer=self.rank)
        self._bufs[self._owner(step, incoming=True)] = buf

    def notify_failure(self, suspect: int | None) -> None:
        """Best effort: this rank's next message becomes a FAILED header so the right neighbour stops now."""
        if self.notified:
            return
        self.notified = True
        if self.sent_upto < self.total:
            buf = torch.zeros(self.nbytes, dtype=torch.uint8)
            header = buf[:HEADER].view(torch.int32)
            header[0], header[1] = FAILED, -1 if suspect is None else suspect
            self.sender.send(self.sent_upto, buf)
        try:
            self.sender.close(timeout=self.deadlines.margin(self.nbytes))
        except PeerFailure:
            pass  # the right neighbour may be the one that is gone


def run_gathers(parts: list[tuple[torch.Tensor, dist.ProcessGroup]],
                deadlines: TransferDeadlines) -> tuple[list[list[torch.Tensor]], int]:
    """All-gather each (payload, group) as its own ring, driven round-robin in this thread (ring.drive): every
    part's payloads by rank, and the bytes this rank sent. Raises PeerFailure."""
    gathers = drive(lambda watchdog: [GatherPart(payload, pg, deadlines, watchdog) for payload, pg in parts])
    return [g.gathered for g in gathers], sum(g.wire_bytes for g in gathers)
