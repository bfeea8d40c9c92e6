"""Parallel ranged download of snapshot files from several peers, with fallback.

Files are cut into chunks; every peer gets a few worker threads (one connection each) that take the
next chunk any of their peer's files needs. Faster peers thus take more chunks, and the total rate
approaches the sum of the peers' uplinks. A chunk whose transfer breaks goes back to the board with
its progress kept, and the next worker resumes it with a Range request from where it stopped. A
peer that fails repeatedly, rejects the token or lost the snapshot is dropped; when no live peer
can serve what is left, the download fails naming every peer and its last error.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from zb.ckpt.recovery.peer import PeerClient, PeerError
from zb.ckpt.recovery.prefix_hash import PrefixHasher
from zb.ckpt.recovery.progress import TransferProgress

log = logging.getLogger("zb.ckpt.fetch")

_BUF = 1 << 20
MAX_PEER_FAILURES = 3
MIN_SPLIT = 1 << 20           # never split the tail into pieces smaller than this


class DownloadFailed(Exception):
    """No live peer can serve what is left; `gone` when every peer lost the snapshot (pruned)."""

    def __init__(self, errors: dict[str, str], gone: bool, expired: bool = False):
        detail = "; ".join(e for _, e in sorted(errors.items())) or "no peer to ask"
        super().__init__(f"no peer could serve the rest of the snapshot ({detail})")
        self.errors, self.gone, self.expired = errors, gone, expired


@dataclass
class FilePlan:
    size: int
    sha256: str
    sources: list[str]          # peers that hold this exact file


@dataclass
class Chunk:
    file: str
    start: int
    stop: int
    done: int = 0               # bytes already written from `start` (a retry resumes there)
    # `stop` may shrink while the chunk is in flight (Board._split_inflight); bytes written past the
    # new stop are the same bytes the new chunk writes, since every source holds the same file.


@dataclass
class Report:
    contributors: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    bytes_by_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sha256: dict[str, str | None] = field(default_factory=dict)


class Board:
    """The shared queue of chunks, the peers' health, and the first fatal error."""

    def __init__(self, plans: dict[str, FilePlan], chunk_bytes: int, deadline: float = float("inf")):
        self.plans = plans
        self.deadline = deadline            # time.monotonic() after which nobody takes or reads a chunk
        self.pending = [Chunk(f, s, min(s + chunk_bytes, p.size)) for f, p in plans.items()
                        for s in range(0, p.size, chunk_bytes)]
        self.inflight: list[Chunk] = []
        self.failures: dict[str, int] = defaultdict(int)
        self.errors: dict[str, str] = {}
        self.gone: set[str] = set()         # peers that answered 404/409: the snapshot left them
        self.dead: set[str] = set()
        self.cond = threading.Condition()
        self.report = Report()

    def _serves(self, peer: str, chunk: Chunk) -> bool:
        return peer in self.plans[chunk.file].sources and peer not in self.dead

    def take(self, peer: str) -> Chunk | None:
        """The next chunk this peer can serve; None when there is nothing left for it."""
        with self.cond:
            while peer not in self.dead and not self.stuck() and not self.expired():
                chunk = next((c for c in self.pending if self._serves(peer, c)), None)
                if chunk is not None:
                    self.pending.remove(chunk)
                    self.inflight.append(chunk)
                    return chunk
                if not any(self._serves(peer, c) for c in self.inflight):
                    return None
                stolen = self._split_inflight(peer)
                if stolen is not None:
                    return stolen
                self.cond.wait(0.5)  # a chunk in flight elsewhere may fail and come back to us
            return None

    def _split_inflight(self, peer: str) -> Chunk | None:
        """At the tail, take the second half of the largest chunk still in flight, so an idle
        connection helps instead of waiting for the slowest one (its owner stops at the new end)."""
        candidates = [c for c in self.inflight if self._serves(peer, c)]
        chunk = max(candidates, key=lambda c: c.stop - c.start - c.done, default=None)
        if chunk is None or chunk.stop - chunk.start - chunk.done < 2 * MIN_SPLIT:
            return None
        mid = chunk.start + chunk.done + (chunk.stop - chunk.start - chunk.done) // 2
        stolen = Chunk(chunk.file, mid, chunk.stop)
        chunk.stop = mid
        self.inflight.append(stolen)
        return stolen

    def finish(self, chunk: Chunk, peer: str) -> None:
        with self.cond:
            self.inflight.remove(chunk)
            self.failures[peer] = 0
            self.report.contributors[chunk.file].add(peer)
            self.cond.notify_all()

    def fail(self, chunk: Chunk, peer: str, error: PeerError) -> None:
        with self.cond:
            self.inflight.remove(chunk)
            self.pending.insert(0, chunk)
            self.failures[peer] += 1
            self.errors[peer] = str(error)
            if error.status in (404, 409):
                self.gone.add(peer)
            if error.fatal or self.failures[peer] >= MAX_PEER_FAILURES:
                if peer not in self.dead:
                    log.warning("dropping peer %s: %s", peer, error)
                self.dead.add(peer)
            else:
                log.warning("%s (the rest of that chunk goes back in the queue)", error)
            self.cond.notify_all()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def stuck(self) -> bool:
        """True when some pending chunk has no live peer left to serve it."""
        return any(not any(self._serves(p, c) for p in self.plans[c.file].sources) for c in self.pending)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _fetch_chunk(client: PeerClient, name: str, chunk: Chunk, board: Board, fd: int,
                 progress: TransferProgress) -> None:
    """Copy the rest of `chunk` from the peer into `fd`; progress survives a failure."""
    plan, report = board.plans[chunk.file], board.report
    response = client.open_range(name, chunk.file, chunk.start + chunk.done, chunk.stop, plan.sha256)
    buf = bytearray(_BUF)
    view = memoryview(buf)
    try:
        while chunk.done < chunk.stop - chunk.start:
            want = min(_BUF, chunk.stop - chunk.start - chunk.done)
            n = response.readinto(view[:want])
            if n == 0:
                raise http.client.IncompleteRead(b"")
            if board.expired():
                raise TimeoutError("the live-recovery deadline passed")
            _write_all(fd, view[:n], chunk.start + chunk.done)
            chunk.done += n
            report.bytes_by_peer[client.peer] += n
            progress.advance(n)
        if response.length:  # the chunk was split while in flight: its old tail is not ours to read
            client.close()
    except (OSError, http.client.HTTPException) as e:
        client.close()
        raise PeerError(client.peer, f"transfer of {chunk.file} broke at byte {chunk.start + chunk.done}: "
                        f"{e or type(e).__name__}") from None


def _worker(board: Board, peer: str, name: str, token: str, timeout: float, fds: dict[str, int],
            hashers: dict[str, PrefixHasher], progress: TransferProgress) -> None:
    client = PeerClient(peer, token, timeout)
    try:
        while (chunk := board.take(peer)) is not None:
            try:
                _fetch_chunk(client, name, chunk, board, fds[chunk.file], progress)
            except PeerError as e:
                board.fail(chunk, peer, e)
                time.sleep(min(0.2 * board.failures[peer], 1.0))  # back off before retrying this peer
            else:
                board.finish(chunk, peer)
                hashers[chunk.file].add(chunk.start, chunk.stop)
    finally:
        client.close()


def _run_workers(board: Board, names: dict[str, str], token: str, timeout: float, conns_per_peer: int,
                 fds: dict[str, int], hashers: dict[str, PrefixHasher], progress: TransferProgress) -> None:
    peers = list(dict.fromkeys(p for plan in board.plans.values() for p in plan.sources))
    threads = [threading.Thread(target=_worker, args=(board, p, names[p], token, timeout, fds, hashers, progress),
                                name=f"zb-fetch-{p}-{i}", daemon=True)
               for p in peers for i in range(conns_per_peer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def download(plans: dict[str, FilePlan], names: dict[str, str], dest: Path, token: str, *, timeout: float,
             conns_per_peer: int, chunk_bytes: int, progress: TransferProgress,
             deadline: float = float("inf")) -> Report:
    """Download every planned file into `dest/<file>`; DownloadFailed names the peers if it cannot finish
    (by `deadline`, a time.monotonic() value).

    `names` maps each peer to its own name of the snapshot (the URL path component).
    """
    board = Board(plans, chunk_bytes, deadline)
    fds = {f: os.open(dest / f, os.O_RDWR | os.O_CREAT, 0o644) for f in plans}
    hashers: dict[str, PrefixHasher] = {}
    try:
        for f, plan in plans.items():
            os.ftruncate(fds[f], plan.size)
            hashers[f] = PrefixHasher(fds[f], plan.size)
        _run_workers(board, names, token, timeout, conns_per_peer, fds, hashers, progress)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        board.report.sha256 = {f: h.result() for f, h in hashers.items()}  # stops the hash threads
        for fd in fds.values():
            os.close(fd)
    if board.pending or board.inflight:
        raise DownloadFailed(dict(board.errors), gone=bool(board.gone) and board.gone >= board.dead,
                             expired=board.expired())
    return board.report
