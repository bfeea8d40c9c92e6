"""A thread that hands the ring's messages to gloo, so compute never waits on a send.

gloo's send() writes part of a large message inline on the calling thread; on the main thread
that would serialize quantizing piece k+1 behind sending piece k. Here the main thread only
enqueues; this thread sends, keeps up to `window` sends in flight, waits for the oldest with a
deadline, and returns finished buffers to the pool. The first failure is kept and re-raised on
the main thread by check().
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from zb.collectives.peer_failure import PeerFailure
from zb.collectives.pieces import BufferPool

_STOP = None


class Sender:
    """send(k, buf) enqueues message k for the right neighbour; close() waits for all of them."""

    def __init__(self, pg: dist.ProcessGroup, peer: int, window: int, pool: BufferPool,
                 deadline: Callable[[int, int], float],
                 wrap: Callable[[int, str], AbstractContextManager[object]]) -> None:
        self.pg, self.peer, self.window, self.pool = pg, peer, window, pool
        self._deadline, self._wrap = deadline, wrap  # (k, nbytes) -> seconds; gloo errors -> PeerFailure
        self._queue: queue.Queue = queue.Queue()
        self.error: PeerFailure | None = None
        self._thread = threading.Thread(target=self._loop, name=f"zb-send-{peer}", daemon=True)
        self._thread.start()

    def send(self, k: int, buf: torch.Tensor) -> None:
        self._queue.put((k, buf))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, timeout: float) -> None:
        """Wait until every queued message is sent (or failed); raise the failure if any."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive() and self.error is None:
            self.error = PeerFailure(f"quantized all-reduce: sends to rank {self.peer} did not finish within "
                                     f"{timeout:.1f} s", rank=self.peer)
        self.check()

    def _loop(self) -> None:
        inflight: collections.deque = collections.deque()
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                k, buf = item
                if self.error is None:
                    with self._wrap(self.peer, "send to"):
                        inflight.append((k, buf, self.pg.send([buf], self.peer, k)))
                while len(inflight) > self.window:
                    self._finish(*inflight.popleft())
            while inflight:
                self._finish(*inflight.popleft())
        except PeerFailure as e:
            self.error = e

    def _finish(self, k: int, buf: torch.Tensor, work: dist.Work) -> None:
        from datetime import timedelta

        with self._wrap(self.peer, "send to"):
            work.wait(timedelta(seconds=self._deadline(k, buf.numel())))
        self.pool.put(buf)
