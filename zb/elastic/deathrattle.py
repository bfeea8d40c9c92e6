"""The deathrattle: on every exit path it can catch, a node marks itself gone at once.

Peers then drop it at their next resolution instead of waiting for the heartbeat timeout. Paths
covered: normal interpreter exit and uncaught exceptions (atexit), SIGTERM and SIGINT (a handler
that rattles, then hands the signal to whatever handler was there before). Every local rank of a
node installs it, so a node counts as gone when any of its local ranks dies. SIGKILL and power loss
cannot be caught: the heartbeat timeout covers those.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from zb.elastic import keys
from zb.elastic.tcpstore import store_errors

if TYPE_CHECKING:
    from zb.stop_signals import SignalHandler
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Deathrattle:
    """Writes "<uid> <token>" to keys.GONE once; `connect` gives it a client of its own."""

    def __init__(self, uid: str, token: str, connect: Callable[[], StoreClient]) -> None:
        self.uid, self.token = uid, token
        self._connect = connect
        self._sent = False
        self._lock = threading.Lock()
        self._previous: dict[int, SignalHandler] = {}

    def install(self) -> None:
        atexit.register(self.rattle, "exit")
        if threading.current_thread() is not threading.main_thread():
            log.warning("deathrattle: not on the main thread, SIGTERM/SIGINT handlers not installed")
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        atexit.unregister(self.rattle)
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, handler)
        self._previous.clear()

    def rattle(self, reason: str = "exit") -> None:
        """Mark this node gone (idempotent; never raises: it runs on the way out)."""
        with self._lock:
            if self._sent:
                return
            self._sent = True
        try:
            store = self._connect()
            store.append(keys.GONE, f"{self.uid} {self.token}\n")
            log.info("deathrattle sent (%s)", reason)
        except store_errors() as e:
            log.warning("deathrattle not delivered (%s): peers will wait for the heartbeat timeout",
                        str(e).splitlines()[0][:120])
        except Exception:  # noqa: BLE001 - exiting anyway; a bug here must not mask the real exit
            log.exception("deathrattle failed")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.rattle(signal.Signals(signum).name)
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        # Default action: restore it and re-deliver, so the exit status says "killed by SIGTERM".
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
