"""Transfer progress: a rich bar when a human watches stderr, plain log lines otherwise.

Thread-safe: download workers call `advance` concurrently.
"""

from __future__ import annotations

import logging
import threading
import time

from zb.progress import byte_bar, wants_bar

log = logging.getLogger("zb.ckpt.fetch")

_LOG_EVERY_S = 5.0


class TransferProgress:
    def __init__(self, total: int, label: str, rich: bool | None = None):
        self.total, self.label = total, label
        self.done = 0
        self._lock = threading.Lock()
        self._start = self._last_log = time.monotonic()
        self._bar = None
        if rich if rich is not None else wants_bar():
            self._bar = byte_bar()
            self._task = self._bar.add_task(self.label, total=self.total)
            self._bar.start()

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done)
            elif now - self._last_log >= _LOG_EVERY_S:
                self._last_log = now
                self._log_line(now)

    def _log_line(self, now: float) -> None:
        rate = self.done / max(now - self._start, 1e-9)
        log.info("%s: %.0f%% %.1f/%.1f MB at %.1f MB/s", self.label, 100 * self.done / max(self.total, 1),
                 self.done / 1e6, self.total / 1e6, rate / 1e6)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
