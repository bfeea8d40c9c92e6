"""The quantized ring all-reduce (int8, int4, int2): reduce-scatter accumulating in fp32, then
all-gather of bytes.

Numbered steps, as rank r of W sees them (chunk indices mod W, m pieces per chunk):
1. Message k = (step t = k // m, piece p = k % m) goes to the right neighbour and always holds
   piece p of chunk r - t; message k from the left neighbour holds piece p of chunk r - t - 1.
2. Step 0: quantize our own piece of chunk r and send it.
3. Reduce-scatter steps 0 .. W-3: for each received piece, add our fp32 values and re-quantize
   the partial sum in one fused kernel (`reduce_quantize`), send it on (message k + m).
4. Step W-2 (we own chunk r + 1): same, divided by W for AVG, and we keep exactly the values we
   send (`write_back`): the owner fixes the chunk's final quantized form once.
5. All-gather steps W-1 .. 2W-4: dequantize the received piece into our tensor and forward the
   very same bytes; the last step only dequantizes. So every rank holds identical bits.
Error feedback (`residual`, one fp32 value per value of the slice, kept by the caller across calls):
every quantization this rank performs, of its own piece at step 0 and of each partial sum it
re-quantizes at steps 1 .. W-2, adds this rank's residual for those values and keeps what it
dropped. So every value of the rank's slice passes through exactly one of its quantizations, and the
mass any of them dropped is sent again at the next call: across calls the ring loses nothing but
the residuals still held (BENCHMARKS.md, "Fewer bits", measured this against an all-to-all shape).
Receives are posted `window` messages ahead and a sender thread keeps up to `window` sends in
flight, so quantizing piece k+1 overlaps the transfer of piece k. Each receive is bounded by a
deadline from its size and the minimum bandwidth; when it passes, the watchdog sends a FAILED
header naming the suspect as our next message, so the right neighbour raises at once with the
same suspect (and so on around the ring) instead of timing out and blaming us.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from zb.collectives import kernels
from zb.collectives.kernels import Scheme
from zb.collectives.peer_failure import PeerFailure
from zb.collectives.pieces import FAILED, OK, POOL, Layout, Piece, views
from zb.collectives.sender import Sender
from zb.collectives.watchdog import Watchdog


@dataclass
class TransferDeadlines:
    """How long a transfer may take: floor + size / minimum bandwidth, plus per-step slack.

    The slack grows with the message's ring step so that, when a peer hangs, the rank right after
    it times out first and its FAILED notice reaches the ranks further down before their own
    deadlines (a rank d hops downstream waits on a message d steps later).
    """

    min_bandwidth_mbps: float
    floor_s: float  # per transfer, on top of size / bandwidth
    start_s: float  # for the first message: peers may enter the all-reduce late

    def transfer_s(self, nbytes: int) -> float:
        return nbytes * 8 / (self.min_bandwidth_mbps * 1e6)

    def for_bytes(self, nbytes: int, first: bool = False, step: int = 0) -> float:
        seconds = self.floor_s + self.transfer_s(nbytes) + step * (1.0 + self.transfer_s(nbytes))
        return max(seconds, self.start_s) if first else seconds

    def margin(self, nbytes: int) -> float:
        """Extra time gloo waits beyond the deadline, for the FAILED notice to leave first."""
        return 2.0 + self.transfer_s(nbytes)


@contextmanager
def failure_names(peer: int, what: str, observer: int) -> Iterator[None]:
    """gloo errors (peer gone, pair closed, timeout) become PeerFailure naming that peer."""
    try:
        yield
    except PeerFailure:
        raise
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError/DistError variants
        raise PeerFailure(f"quantized all-reduce: {what} rank {peer} failed: {str(e).splitlines()[0]}",
                          rank=peer, observer=observer) from e


def guarded_wait(work: dist.Work, deadline_s: float, margin_s: float, watchdog: Watchdog,
                 on_deadline: Callable[[], None], names: AbstractContextManager[object]) -> None:
    """Wait for a receive up to its deadline plus `margin_s`; at the deadline itself the watchdog calls
    `on_deadline` (the FAILED notice leaves before gloo gives up); `names` turns gloo errors into PeerFailure."""
    watchdog.arm(deadline_s, on_deadline)
    try:
        with names:
            work.wait(timedelta(seconds=deadline_s + margin_s))
    finally:
        watchdog.disarm()


class RingPart:
    """One ring over one process group for one contiguous fp32 slice; driven by advance(k)."""

    def __init__(self, flat: torch.Tensor, pg: dist.ProcessGroup, avg: bool, deadlines: TransferDeadlines,
                 piece_values: int, window: int, watchdog: Watchdog, scheme: Scheme,
                 residual: torch.Tensor | None = None) -> None:
        self.flat, self.pg, self.avg, self.deadlines, self.watchdog = flat, pg, avg, deadlines, watchdog
        self.scheme, self.residual = scheme, residual
        self.rank, self.world = pg.rank(), pg.size()
        self.left, self.right = (self.rank - 1) % self.world, (self.rank + 1) % self.world
        self.layout = Layout(flat.numel(), self.world, piece_values, scheme)
        self.window = window
        self.recvs: dict[int, tuple[torch.Tensor, dist.Work]] = {}
        self.next_post = 0
        self.sent_upto = 0  # messages [0, sent_upto) are handed to the sender
        self.notified = False  # our FAILED notice has been sent
        self.wire_bytes = 0
        self.sender = Sender(pg, self.right, window, POOL, self._send_deadline, self._names)

    @property
    def total(self) -> int:
        return self.layout.messages

    def _piece(self, k: int, incoming: bool) -> Piece:
        step, p = divmod(k, self.layout.m)
        return self.layout.chunks[(self.rank - step - (1 if incoming else 0)) % self.world][p]

    def _names(self, peer: int, what: str):
        return failure_names(peer, what, self.rank)

    def _send_deadline(self, k: int, nbytes: int) -> float:
        # a send also waits for the receiver to get there: give it the receive's time twice over
        return 2 * self.deadlines.for_bytes(nbytes, step=k // self.layout.m) + self.deadlines.margin(nbytes)

    # receives --------------------------------------------------------------------------------
    def _post_recvs(self, upto: int) -> None:
        while self.next_post < min(upto, self.total):
            k, self.next_post = self.next_post, self.next_post + 1
            piece = self._piece(k, incoming=True)
            if piece.numel:
                buf = POOL.get(piece.nbytes)
                with self._names(self.left, "receive from"):
                    self.recvs[k] = (buf, self.pg.recv([buf], self.left, k))

    def _wait_recv(self, k: int, piece: Piece) -> torch.Tensor:
        buf, work = self.recvs.pop(k)
        deadline = self.deadlines.for_bytes(piece.nbytes, first=(k == 0), step=k // self.layout.m)
        guarded_wait(work, deadline, self.deadlines.margin(piece.nbytes), self.watchdog,
                     lambda: self.notify_failure(self.left), self._names(self.left, "receive from"))
        if self.notified:  # the watchdog gave up on this transfer: data arriving later is too late
            raise PeerFailure(f"quantized all-reduce: receive from rank {self.left} did not finish within "
                              f"{deadline:.1f} s", rank=self.left, observer=self.rank)
        header = views(buf, piece)[0]
        if int(header[0]) == FAILED:
            suspect = int(header[1])
            raise PeerFailure(f"quantized all-reduce: rank {self.left} reported a failed transfer with rank {suspect}",
                              rank=None if suspect < 0 else suspect, observer=self.rank)
        return buf

    # the pipeline ----------------------------------------------------------------------------
    def advance(self, k: int) -> None:
        """Produce and send message k (k < total), consuming received message k - m."""
        if k >= self.total:
            return
        self.sender.check()
        self._post_recvs(k + self.window)
        piece = self._piece(k, incoming=False)
        if piece.numel:
            buf = self._quantize_own(piece) if k < self.layout.m else self._combine(k - self.layout.m, piece)
            self.sender.send(k, buf)
            self.wire_bytes += buf.numel()
        self.sent_upto = k + 1

    def finish(self) -> None:
        """Consume the last all-gather step, then wait for every send."""
        self._post_recvs(self.total)
        for j in range(self.total - self.layout.m, self.total):
            piece = self._piece(j, incoming=True)
            if piece.numel:
                buf = self._wait_recv(j, piece)
                _, scales, codes = views(buf, piece)
                kernels.dequantize(codes, scales, self.flat[piece.start:piece.stop], scheme=self.scheme)
                POOL.put(buf)
        self.sender.close(timeout=self._send_deadline(self.total, self.layout.chunks[0][0].nbytes) * 2)

    def _residual(self, piece: Piece) -> torch.Tensor | None:
        return self.residual[piece.start:piece.stop] if self.residual is not None else None

    def _quantize_own(self, piece: Piece) -> torch.Tensor:
        buf = POOL.get(piece.nbytes)
        header, scales, codes = views(buf, piece)
        header.fill_(OK)
        kernels.quantize(self.flat[piece.start:piece.stop], codes, scales, scheme=self.scheme,
                         residual=self._residual(piece))
        return buf

    def _combine(self, j: int, piece: Piece) -> torch.Tensor:
        """Turn received message j into our message j + m (same piece, one step on)."""
        inbuf = self._wait_recv(j, piece)
        _, in_scales, in_codes = views(inbuf, piece)
        own = self.flat[piece.start:piece.stop]
        step = j // self.layout.m
        if step >= self.world - 1:  # all-gather: keep the bytes and forward them as they are
            kernels.dequantize(in_codes, in_scales, own, scheme=self.scheme)
            return inbuf
        out = POOL.get(piece.nbytes)
        header, scales, codes = views(out, piece)
        header.fill_(OK)
        owner = step == self.world - 2
        kernels.reduce_quantize(in_codes, in_scales, own, codes, scales, scheme=self.scheme,
                                divisor=float(self.world) if (owner and self.avg) else 1.0, write_back=owner,
                                residual=self._residual(piece))
        POOL.put(inbuf)
        return out

    # failure ---------------------------------------------------------------------------------
    def notify_failure(self, suspect: int | None) -> None:
        """Best effort: our next message becomes a FAILED header so the right neighbour stops now."""
        if self.notified:
            return
        self.notified = True
        for k in range(self.sent_upto, self.total):
            piece = self._piece(k, incoming=False)
            if piece.numel:
                buf = torch.zeros(piece.nbytes, dtype=torch.uint8)
                header = views(buf, piece)[0]
                header[0], header[1] = FAILED, -1 if suspect is None else suspect
                self.sender.send(k, buf)
                break
        try:
            self.sender.close(timeout=self.deadlines.margin(self.layout.chunks[0][0].nbytes))
        except PeerFailure:
            pass  # the right neighbour may be the one that is gone


class Hops(Protocol):
    """A ring's part as `drive` runs it (RingPart, zb.collectives.gather.GatherPart)."""

    @property
    def total(self) -> int: ...
    def advance(self, k: int) -> None: ...
    def finish(self) -> None: ...
    def notify_failure(self, suspect: int | None) -> None: ...


P = TypeVar("P", bound=Hops)


def drive(build: Callable[[Watchdog], list[P]]) -> list[P]:
    """The parts `build` makes over one watchdog, driven round-robin in this thread: message k of every part, then
    each part's finish. On PeerFailure every part tells its right neighbour whom it suspects, then it raises."""
    watchdog = Watchdog()
    parts: list[P] = []
    try:
        parts = build(watchdog)
        for k in range(max(p.total for p in parts)):
            for part in parts:
                part.advance(k)
        for part in parts:
            part.finish()
    except PeerFailure as failure:
        for part in parts:
            part.notify_failure(failure.rank)
        raise
    finally:
        watchdog.stop()
    return parts


def run_ring(flat_parts: list[tuple[torch.Tensor, dist.ProcessGroup, torch.Tensor | None]], avg: bool,
             deadlines: TransferDeadlines, piece_values: int, window: int, scheme: Scheme) -> int:
    """All-reduce each (slice, group, residual slice or None) as its own ring, driven round-robin in this
    thread. Returns the bytes this rank sent; raises PeerFailure.
    """
    parts = drive(lambda watchdog: [RingPart(flat, pg, avg, deadlines, piece_values, window, watchdog, scheme,
                                             residual) for flat, pg, residual in flat_parts])
    return sum(p.wire_bytes for p in parts)
