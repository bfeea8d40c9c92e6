"""SIGINT/SIGTERM become a polite request to stop after the current step.

A node's local ranks decide together (the flag rides on the per-step local all-reduce), so one rank
never leaves while the others wait in a collective. A second signal aborts, except within a short
window of the first: a terminal's Ctrl-C reaches every rank and torchrun then sends its own SIGTERM,
and that pair is one request, not two.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

from zb import stop_signals

log = logging.getLogger("zb.train")

SAME_REQUEST_WINDOW_S = 3.0


@dataclass
class Ended:
    """What a training loop returns to `zb train` (both loops): the signal that stopped it early, if any
    (the exit code is 128 + it), and the step it ended at."""
    stop_signal: int | None = None
    step: int = 0


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, stop_signals.SignalHandler] = {}

    def install(self) -> StopRequest:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.requested:
            self.requested, self._first_at = True, now
            self.signum, self.signal_name = signum, signal.Signals(signum).name
            stop_signals.note(self.signal_name)
            log.warning("%s received: stopping after this step (send it again to abort)", self.signal_name)
        elif now - self._first_at > SAME_REQUEST_WINDOW_S:
            raise stop_signals.Interrupted(signum)   # the CLI's line names it and exits 128 + its number
