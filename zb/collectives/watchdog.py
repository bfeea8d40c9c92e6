"""Fires a callback when a wait outlives its deadline, while the waiting thread stays blocked.

Why: a gloo timeout on one transfer closes every pair of the group's context, so a rank that
times out can no longer tell its right neighbour whom it suspects; that neighbour would only see
"connection closed" and blame the wrong rank. The ring therefore waits in gloo with a margin
beyond the deadline, and this thread sends the FAILED notice at the deadline itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    """One daemon thread; arm(deadline, fn) before a blocking wait, disarm() after it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._fn: Callable[[], None] | None = None
        self._stopped = False
        self.fired = False
        self._thread = threading.Thread(target=self._loop, name="zb-allreduce-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float, fn: Callable[[], None]) -> None:
        with self._cond:
            self._deadline, self._fn = time.monotonic() + seconds, fn
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline, self._fn = None, None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                fn, self._deadline, self._fn = self._fn, None, None
                self.fired = True
                if fn is not None:
                    fn()  # runs under the lock: the main thread cannot re-arm meanwhile
