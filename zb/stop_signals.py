"""Serving until SIGINT/SIGTERM, for commands that only wait (`zb store`, `zb status --serve`).

The handler only sets a flag. A handler that takes a lock, as threading.Event.set does, deadlocks
when the signal lands while the main thread holds that same lock inside Event.wait: the process
then ignores every later signal (seen as a `zb store` that never exits on SIGTERM).
"""

from __future__ import annotations

import signal
import time

POLL_S = 0.1


class StopSignals:
    """Installs the handlers on enter and restores the previous ones on exit."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name

    def wait(self) -> str:
        """Block until a stop signal arrives; its name."""
        while self.received is None:
            time.sleep(POLL_S)
        return self.received
