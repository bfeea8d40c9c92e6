"""Serving until SIGINT/SIGTERM, for commands that only wait (`zb store`, `zb status --serve`), and the
process-wide record of a stop signal that waits deep in zb poll (`requested`).

The handler only sets a flag. A handler that takes a lock, as threading.Event.set does, deadlocks
when the signal lands while the main thread holds that same lock inside Event.wait: the process
then ignores every later signal (seen as a `zb store` that never exits on SIGTERM).
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any, Callable, Optional, Union

POLL_S = 0.1

# What signal.signal takes and returns: a function, SIG_DFL / SIG_IGN, or None (installed outside Python).
SignalHandler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]

_received: str | None = None   # the first stop signal this process got, whichever handler caught it


def note(name: str) -> None:
    """Record a stop signal (called by every zb handler of SIGINT/SIGTERM; sets a flag only)."""
    global _received
    _received = _received or name


def requested() -> str | None:
    """The name of the first stop signal this process received, or None: a wait that cannot finish
    on its own (a store that never answers) polls it and ends at once."""
    return _received


class StopSignals:
    """Installs the handlers on enter and restores the previous ones on exit."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, SignalHandler] = {}

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
        note(self.received)

    def wait(self) -> str:
        """Block until a stop signal arrives; its name."""
        while self.received is None:
            time.sleep(POLL_S)
        return self.received
