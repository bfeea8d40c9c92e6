"""sha256 of a file that is being written out of order, computed while it is written."""

from __future__ import annotations

import hashlib
import os
import threading

_HASH_PIECE = 8 << 20


class PrefixHasher:
    """sha256 of a file written out of order, hashed by its own thread as the completed prefix grows.

    Chunks are handed out in file order, so the prefix advances steadily and hashing overlaps the
    transfer instead of re-reading the whole file at the end (30 s for 40 GB at 1.3 GB/s). Workers
    only record finished chunks; they never wait for the hashing.
    """

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.digest = hashlib.sha256()
        self.hashed = 0
        self.frontier = 0
        self.finished: dict[int, int] = {}   # start -> stop of completed chunks beyond the frontier
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="zb-fetch-hash", daemon=True)
        self.thread.start()

    def add(self, start: int, stop: int) -> None:
        with self.cond:
            self.finished[start] = stop
            while self.frontier in self.finished:
                self.frontier = self.finished.pop(self.frontier)
            self.cond.notify()

    def _run(self) -> None:
        while self.hashed < self.size:
            with self.cond:
                while self.frontier == self.hashed and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                frontier = self.frontier
            while self.hashed < frontier:  # hashlib releases the GIL: workers keep downloading
                data = os.pread(self.fd, min(_HASH_PIECE, frontier - self.hashed), self.hashed)
                self.digest.update(data)
                self.hashed += len(data)

    def result(self) -> str | None:
        """The file's sha256 once every byte is in, else None; stops the thread either way."""
        with self.cond:
            self.stopped = self.frontier < self.size
            self.cond.notify()
        self.thread.join()
        return self.digest.hexdigest() if self.hashed == self.size else None
