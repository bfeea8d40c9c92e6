"""The quantized recursive halving-doubling all-reduce (int8, int4, int2): a reduce-scatter by recursive
halving accumulating in fp32, then an all-gather of bytes by recursive doubling (Rabenseifner). About
2 log2(W) message steps where the ring (ring.py) takes 2 (W - 1): on long links with many nodes the
latency grows like log W.

The cut: W = P + e with P the largest power of two <= W. The tensor's quantization blocks are split into P
near-equal chunks (pieces.split_blocks), so every rank derives every boundary from (numel, W, scheme, piece
size) alone. In the first 2e ranks, the even rank of each pair folds into the odd one; the odd ones and the
ranks from 2e on are the P active ranks, numbered v = rank // 2 (rank < 2e) or rank - e.

Numbered steps, as rank r of W sees them (each message cut into pieces of about piece_values values, whole
blocks each; a piece of step t goes with gloo tag t * stride + its index):
0. Fold (only when e > 0). A folded rank quantizes its whole tensor (with its residual) and sends it to
   rank r + 1; that partner adds it into its tensor in fp32 (`dequantize_add`). The folded rank then only
   waits for step 4. (With a fold, the steps below are numbered one on: t = s + 1, t = k + j + 1.)
1. Reduce-scatter, steps s = 0 .. k - 1 (P = 2^k), distance d = P / 2^(s + 1), partner v XOR d: the active
   rank holds chunks [lo, lo + 2d) (lo = v rounded down to a multiple of 2d); it keeps the half holding chunk
   v, quantizes the other half of its fp32 tensor (with its residual) and sends it to the partner, and adds
   what the partner sends for the kept half into its tensor (`dequantize_add`). The halves sent at
   successive steps are disjoint, and what is left at the end is chunk v alone.
2. The last reduce-scatter step (s = k - 1) makes rank v the owner of chunk v: the received piece, our fp32
   values and our residual go through one `reduce_quantize`, divided by W for AVG, with `write_back`: the
   owner keeps exactly the values of the bytes it will send, and those bytes are the chunk's final form.
3. All-gather, steps j = 0 .. k - 1, distance 2^j, partner v XOR 2^j: send every final byte held (the
   aligned run of 2^j chunks holding chunk v), receive the partner's run, keep its bytes and dequantize
   them into our tensor. The bytes are forwarded as they are, so every rank holds identical bits. (An
   active rank keeps the final form of the whole tensor for this: codes and scales, a quarter of the fp32
   bytes for int8.)
4. Unfold (only when e > 0): the partner sends the whole final form to its folded rank, which dequantizes it.
Error feedback (`residual`, one fp32 value per value, kept by the caller across calls): a folded rank
quantizes every value once, at step 0; an active rank quantizes each value once, in the half it sends at
one of the steps of 1 or in the chunk it owns at 2 (a partner's fold is in its fp32 values by then). So
every value of the tensor passes through exactly one of this rank's quantizations, and across calls
nothing is lost but the residuals still held.
Messages use the ring's wire format (pieces.views: header, scales, codes) and buffers (pieces.POOL).
Pipelining is within a step only: a step's pieces are quantized one after the other while a Sender thread
per peer keeps up to `window` of them in flight, and receives are posted up to `window` pieces ahead of
the one being consumed (across steps); a step's sends need the previous step's receives in full.
Failures are the ring's: every receive has a deadline from its size and its step (TransferDeadlines; the
first receive may wait the start timeout); at a deadline, or on a PeerFailure, this rank sends a FAILED
header naming the suspect to every peer it still owes a message, as that message, so those peers raise
at once naming the same rank instead of timing out and blaming this one; gloo errors become PeerFailure
naming the peer. A notice to a peer that has not reached that message yet stays queued in its Sender
until the send's own deadline (best effort, as in the ring).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zb.collectives import kernels
from zb.collectives.kernels import Scheme, code_bytes, num_blocks
from zb.collectives.peer_failure import PeerFailure
from zb.collectives.pieces import FAILED, OK, POOL, Piece, split_blocks, views
from zb.collectives.ring import TransferDeadlines, drive, failure_names, guarded_wait
from zb.collectives.sender import Sender
from zb.collectives.watchdog import Watchdog

# What a message does: sent, the values quantized from our tensor (QUANTIZE) or final bytes we hold (STORED);
# received, added into our tensor (ADD), reduced into our owned chunk (OWN), kept and dequantized (GATHER), or
# only dequantized (FINAL: a folded rank's unfold).
QUANTIZE, STORED, ADD, OWN, GATHER, FINAL = "quantize", "stored", "add", "own", "gather", "final"


@dataclass(frozen=True)
class Message:
    step: int  # global step: 0 the fold (when there is one), then k halving, k doubling, then the unfold
    peer: int  # group rank of the other end
    piece: Piece
    tag: int
    kind: str


class Plan:
    """Every message rank `rank` of `world` sends and receives, in order, for a tensor of n values.

    Derived from (n, world, rank, piece_values, scheme) alone, so both ends of a message agree on it.
    """

    def __init__(self, n: int, world: int, rank: int, piece_values: int, scheme: Scheme) -> None:
        if world < 2:
            raise ValueError("halving-doubling needs at least 2 ranks")
        self.n, self.world, self.rank, self.scheme = n, world, rank, scheme
        self.block = scheme.block
        self.nblocks = num_blocks(n, self.block)
        self.p2 = 1 << (world.bit_length() - 1)  # active ranks
        self.extra = world - self.p2  # folded ranks
        self.k = self.p2.bit_length() - 1  # halving steps (and doubling steps)
        self.chunk_blocks = split_blocks(self.nblocks, self.p2)
        self.per_piece = max(1, piece_values // self.block)
        self.stride = max(1, -(-self.nblocks // self.per_piece))  # tags: step * stride + piece index
        self.fold = 1 if self.extra else 0
        self.steps = 2 * self.k + 2 * self.fold
        self.sends: list[Message] = []
        self.recvs: list[Message] = []
        self.vrank = self.virtual(rank)
        self.owned: tuple[int, int] | None = None  # values of the chunk this rank owns (active ranks)
        if self.vrank is None:  # folded: step 0 and the unfold only
            whole = (0, self.nblocks)
            self._add(self.sends, 0, rank + 1, whole, QUANTIZE)
            self._add(self.recvs, self.steps - 1, rank + 1, whole, FINAL)
            return
        v = self.vrank
        if self.fold and rank < 2 * self.extra:
            self._add(self.recvs, 0, rank - 1, (0, self.nblocks), ADD)
        for s in range(self.k):
            d = self.p2 >> (s + 1)
            lo = v & ~(2 * d - 1)
            keep, give = ((lo + d, lo + 2 * d), (lo, lo + d)) if v & d else ((lo, lo + d), (lo + d, lo + 2 * d))
            peer = self.actual(v ^ d)
            self._add(self.sends, self.fold + s, peer, self._blocks(*give), QUANTIZE)
            self._add(self.recvs, self.fold + s, peer, self._blocks(*keep), OWN if s == self.k - 1 else ADD)
        for j in range(self.k):
            d = 1 << j
            mine, theirs = v & ~(d - 1), (v ^ d) & ~(d - 1)
            peer = self.actual(v ^ d)
            step = self.fold + self.k + j
            self._add(self.sends, step, peer, self._blocks(mine, mine + d), STORED)
            self._add(self.recvs, step, peer, self._blocks(theirs, theirs + d), GATHER)
        if self.fold and rank < 2 * self.extra:
            self._add(self.sends, self.steps - 1, rank - 1, (0, self.nblocks), STORED)
        a, b = self._blocks(v, v + 1)
        self.owned = (min(a * self.block, n), min(b * self.block, n))

    def virtual(self, rank: int) -> int | None:
        """The active number of a group rank, None for a folded one."""
        if rank < 2 * self.extra:
            return rank // 2 if rank % 2 else None
        return rank - self.extra

    def actual(self, v: int) -> int:
        """The group rank of active number v."""
        return 2 * v + 1 if v < self.extra else v + self.extra

    def _blocks(self, lo: int, hi: int) -> tuple[int, int]:
        """Block offsets of chunks [lo, hi)."""
        return self.chunk_blocks[lo], self.chunk_blocks[hi]

    def _add(self, out: list[Message], step: int, peer: int, blocks: tuple[int, int], kind: str) -> None:
        """The messages of one step with one peer: blocks [a, b) cut into near-equal pieces (empty pieces
        are never sent: both ends skip them)."""
        a, b = blocks
        if b <= a:
            return
        cuts = split_blocks(b - a, -(-(b - a) // self.per_piece))
        for i, (x, y) in enumerate(zip(cuts, cuts[1:])):
            piece = Piece(min((a + x) * self.block, self.n), min((a + y) * self.block, self.n), self.scheme)
            if piece.numel:
                out.append(Message(step, peer, piece, step * self.stride + i, kind))


class HalvingPart:
    """One halving-doubling all-reduce over one process group for one contiguous fp32 slice.

    Driven by ring.drive: advance(t) consumes the receives of step t - 1 and sends those of step t; finish()
    consumes the last step's receives and waits for every send.
    """

    def __init__(self, flat: torch.Tensor, pg: dist.ProcessGroup, avg: bool, deadlines: TransferDeadlines,
                 piece_values: int, window: int, watchdog: Watchdog, scheme: Scheme,
                 residual: torch.Tensor | None = None) -> None:
        self.flat, self.pg, self.avg, self.deadlines, self.watchdog = flat, pg, avg, deadlines, watchdog
        self.scheme, self.residual, self.window = scheme, residual, max(1, window)
        self.rank, self.world = pg.rank(), pg.size()
        self.plan = Plan(flat.numel(), self.world, self.rank, piece_values, scheme)
        # The final quantized form of the whole tensor, filled by our owned chunk and the all-gather
        # (a folded rank needs none: it only dequantizes what its partner sends).
        self.final_scales: torch.Tensor | None = None
        self.final_codes: torch.Tensor | None = None
        if self.plan.vrank is not None:
            self.final_scales = torch.empty(self.plan.nblocks, dtype=torch.float32)
            self.final_codes = torch.empty(code_bytes(flat.numel(), scheme), dtype=torch.uint8)
        self.recvs: dict[int, tuple[torch.Tensor, dist.Work]] = {}  # by index into plan.recvs
        self.next_post = 0
        self.consumed = 0  # plan.recvs[:consumed] are consumed
        self.sent_upto = 0  # plan.sends[:sent_upto] are handed to their sender
        self.notified = False
        self.wire_bytes = 0
        peers = sorted({m.peer for m in self.plan.sends})
        self.senders = {p: Sender(pg, p, self.window, POOL, self._send_deadline, self._names) for p in peers}

    @property
    def total(self) -> int:
        return self.plan.steps

    def _names(self, peer: int, what: str):
        return failure_names(peer, what, self.rank)

    def _send_deadline(self, tag: int, nbytes: int) -> float:
        # a send also waits for the receiver to get there: give it the receive's time twice over
        return 2 * self.deadlines.for_bytes(nbytes, step=tag // self.plan.stride) + self.deadlines.margin(nbytes)

    # receives --------------------------------------------------------------------------------
    def _post_recvs(self) -> None:
        """Keep the next `window` receives posted, from the one consumed next."""
        upto = min(self.consumed + self.window, len(self.plan.recvs))
        while self.next_post < upto:
            i, self.next_post = self.next_post, self.next_post + 1
            msg = self.plan.recvs[i]
            buf = POOL.get(msg.piece.nbytes)
            with self._names(msg.peer, "receive from"):
                self.recvs[i] = (buf, self.pg.recv([buf], msg.peer, msg.tag))

    def _wait_recv(self, i: int) -> torch.Tensor:
        msg = self.plan.recvs[i]
        self._post_recvs()
        buf, work = self.recvs.pop(i)
        nbytes = msg.piece.nbytes
        deadline = self._deadline(i)
        guarded_wait(work, deadline, self.deadlines.margin(nbytes), self.watchdog,
                     lambda: self.notify_failure(msg.peer), self._names(msg.peer, "receive from"))
        if self.notified:  # the watchdog gave up on this transfer: data arriving later is too late
            raise PeerFailure(f"quantized all-reduce: receive from rank {msg.peer} did not finish within "
                              f"{deadline:.1f} s", rank=msg.peer, observer=self.rank)
        header = views(buf, msg.piece)[0]
        if int(header[0]) == FAILED:
            suspect = int(header[1])
            raise PeerFailure(f"quantized all-reduce: rank {msg.peer} reported a failed transfer with rank {suspect}",
                              rank=None if suspect < 0 else suspect, observer=self.rank)
        return buf

    def _deadline(self, i: int) -> float:
        """Seconds receive i may take once we wait for it: one piece at its step (TransferDeadlines), except
        the first receive, which may also wait the start timeout, and for the transfers it waits behind: a
        folded rank's unfold comes after the whole all-reduce of the active ranks (the fold, then the tensor
        about twice over), and an active rank's first halving message may come from a partner that first
        takes in a fold."""
        msg = self.plan.recvs[i]
        seconds = self.deadlines.for_bytes(msg.piece.nbytes, step=msg.step)
        if i > 0:
            return seconds
        whole = Piece(0, self.plan.n, self.scheme).nbytes
        behind = 3 * whole if msg.kind == FINAL else whole if self.plan.fold and msg.step == 1 else 0
        return max(seconds + self.deadlines.transfer_s(behind), self.deadlines.start_s)

    def _consume(self, upto_step: int) -> None:
        """Consume every received message of steps < upto_step."""
        recvs = self.plan.recvs
        while self.consumed < len(recvs) and recvs[self.consumed].step < upto_step:
            i = self.consumed
            msg = recvs[i]
            buf = self._wait_recv(i)
            self.consumed = i + 1
            self._post_recvs()
            piece = msg.piece
            _, scales, codes = views(buf, piece)
            own = self.flat[piece.start:piece.stop]
            if msg.kind == ADD:
                kernels.dequantize_add(codes, scales, own, scheme=self.scheme)
            elif msg.kind == OWN:  # we own these values: fix their final form once
                out_scales, out_codes = self._final(piece)
                kernels.reduce_quantize(codes, scales, own, out_codes, out_scales, scheme=self.scheme,
                                        divisor=float(self.world) if self.avg else 1.0, write_back=True,
                                        residual=self._residual(piece))
            elif msg.kind == GATHER:
                out_scales, out_codes = self._final(piece)
                out_scales.copy_(scales)
                out_codes.copy_(codes)
                kernels.dequantize(codes, scales, own, scheme=self.scheme)
            else:  # FINAL
                kernels.dequantize(codes, scales, own, scheme=self.scheme)
            POOL.put(buf)

    # sends -----------------------------------------------------------------------------------
    def _final(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, codes) of a block-aligned piece inside the final form we hold."""
        assert self.final_scales is not None and self.final_codes is not None
        b0 = piece.start // self.scheme.block
        c0 = piece.start // self.scheme.per_byte  # blocks hold a whole number of bytes of codes
        return (self.final_scales[b0:b0 + num_blocks(piece.numel, self.scheme.block)],
                self.final_codes[c0:c0 + code_bytes(piece.numel, self.scheme)])

    def _residual(self, piece: Piece) -> torch.Tensor | None:
        return self.residual[piece.start:piece.stop] if self.residual is not None else None

    def _produce(self, msg: Message) -> torch.Tensor:
        piece = msg.piece
        buf = POOL.get(piece.nbytes)
        header, scales, codes = views(buf, piece)
        header.fill_(OK)
        if msg.kind == QUANTIZE:
            kernels.quantize(self.flat[piece.start:piece.stop], codes, scales, scheme=self.scheme,
                             residual=self._residual(piece))
        else:  # STORED: final bytes, forwarded as they are
            held_scales, held_codes = self._final(piece)
            scales.copy_(held_scales)
            codes.copy_(held_codes)
        return buf

    def _send_step(self, step: int) -> None:
        sends = self.plan.sends
        while self.sent_upto < len(sends) and sends[self.sent_upto].step <= step:
            msg = sends[self.sent_upto]
            buf = self._produce(msg)
            self.senders[msg.peer].send(msg.tag, buf)
            self.wire_bytes += buf.numel()
            self.sent_upto += 1

    def _check_senders(self) -> None:
        for sender in self.senders.values():
            sender.check()

    # the steps -------------------------------------------------------------------------------
    def advance(self, t: int) -> None:
        """Consume the receives of step t - 1 (and before), then produce and send those of step t."""
        if t >= self.total:
            return
        self._check_senders()
        self._post_recvs()
        self._consume(t)
        self._send_step(t)

    def finish(self) -> None:
        """Consume the last step's receives, then wait for every send."""
        self._post_recvs()
        self._consume(self.total)
        biggest = max((m.piece.nbytes for m in self.plan.sends), default=0)
        timeout = self._send_deadline(self.total * self.plan.stride, biggest) * 2
        for sender in self.senders.values():
            sender.close(timeout=timeout)

    # failure ---------------------------------------------------------------------------------
    def notify_failure(self, suspect: int | None) -> None:
        """Best effort: the next message we owe each peer becomes a FAILED header, so it stops now."""
        if self.notified:
            return
        self.notified = True
        told: set[int] = set()
        for msg in self.plan.sends[self.sent_upto:]:
            if msg.peer in told:
                continue
            told.add(msg.peer)
            buf = torch.zeros(msg.piece.nbytes, dtype=torch.uint8)
            header = views(buf, msg.piece)[0]
            header[0], header[1] = FAILED, -1 if suspect is None else suspect
            self.senders[msg.peer].send(msg.tag, buf)
        biggest = max((m.piece.nbytes for m in self.plan.sends), default=0)
        end = time.monotonic() + self.deadlines.margin(biggest)  # one margin for all: they send at once
        for sender in self.senders.values():
            try:
                sender.close(timeout=max(0.0, end - time.monotonic()))
            except PeerFailure:
                pass  # that peer may be the one that is gone, or not at that message yet


def run_halving(flat_parts: list[tuple[torch.Tensor, dist.ProcessGroup, torch.Tensor | None]], avg: bool,
                deadlines: TransferDeadlines, piece_values: int, window: int, scheme: Scheme) -> int:
    """All-reduce each (slice, group, residual slice or None) by halving-doubling, the parts driven round-robin
    in this thread (ring.drive). Returns the bytes this rank sent; raises PeerFailure."""
    parts = drive(lambda watchdog: [HalvingPart(flat, pg, avg, deadlines, piece_values, window, watchdog, scheme,
                                                residual) for flat, pg, residual in flat_parts])
    return sum(p.wire_bytes for p in parts)
