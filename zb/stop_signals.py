"""Stop signals: serving until SIGINT/SIGTERM, for commands that only wait (`zb store`, `zb status
--serve`); the process-wide record of a stop signal that waits deep in zb poll (`requested`); and
what every other moment of every command does on one (`raise_on_stop`, installed by `zb`'s main).

A waiting handler only sets a flag. A handler that takes a lock, as threading.Event.set does,
deadlocks when the signal lands while the main thread holds that same lock inside Event.wait: the
process then ignores every later signal (seen as a `zb store` that never exits on SIGTERM).

Elsewhere (a command with no stop of its own, or `zb train` before its loop takes over) SIGINT and
SIGTERM alike raise `Interrupted` in the main thread: `with` blocks and `finally` clauses remove
temporary files on the way out, the CLI prints one line (`error: interrupted by SIGTERM ...`) and
exits 128 + the signal's number without waiting for threads (zb.process_exit). Work in other threads
that could outlast the command (hashing a large file) polls `interrupted()` and stops. A second
signal while the first one unwinds leaves at once: a stuck cleanup never holds the process.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import FrameType
from typing import Any

POLL_S = 0.1

# What signal.signal takes and returns: a function, SIG_DFL / SIG_IGN, or None (installed outside Python).
SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

_received: str | None = None   # the first stop signal this process got, whichever handler caught it


def note(name: str) -> None:
    """Record a stop signal (called by every zb handler of SIGINT/SIGTERM; sets a flag only)."""
    global _received
    _received = _received or name


def requested() -> str | None:
    """The name of the first stop signal this process received, or None: a wait that cannot finish
    on its own (a store that never answers) polls it and ends at once."""
    return _received


class Interrupted(KeyboardInterrupt):
    """A stop signal where the command has no stop of its own. A KeyboardInterrupt, so that SIGTERM ends
    whatever Ctrl-C ends (`except KeyboardInterrupt` catches both); `context` says what the stop left
    (set by `when`), for the one line the CLI prints."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.context: str | None = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def message(self) -> str:
        return f"interrupted by {self.name}" + (f" {self.context}" if self.context else "")


_interrupted: Interrupted | None = None   # raised by _raise_once, on its way out of the command


def interrupted() -> Interrupted | None:
    """The Interrupted this process is unwinding, or None: a worker thread polls it and gives up its work
    (nothing will use it), so that the main thread's wait for it ends at once."""
    return _interrupted


def raise_on_stop() -> None:
    """Make SIGINT and SIGTERM raise Interrupted in the main thread (a command's own handlers, installed
    later, take over while they are in place). Called once by `zb`'s main, before anything else."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _raise_once)


_held = 0                   # inside `held()` blocks: a signal waits for the outermost one's end
_pending: int | None = None  # the signal that waits
_exiting = False             # the command is over: nothing is left to clean up


def exiting() -> None:
    """The command has ended (its line, if any, is out): a stop signal from now on leaves at once, in one
    line, instead of raising into the interpreter's own shutdown (which would report any signal as SIGINT)."""
    global _exiting
    _exiting = True


def _leave_now(signum: int, why: str) -> None:
    os.write(2, f"error: {signal.Signals(signum).name} {why}\n".encode())
    os._exit(128 + signum)


def _raise_once(signum: int, frame: FrameType | None) -> None:
    global _interrupted, _pending
    if _exiting:
        _leave_now(signum, "as zb was exiting, its command done")
    if _interrupted is not None:
        # The first one's cleanup is still running: a second signal asks not to wait for it.
        _leave_now(signum, "again: leaving without finishing the cleanup")
    if _held:
        _pending = _pending or signum
        return
    _interrupted = Interrupted(signum)
    note(_interrupted.name)
    raise _interrupted


@contextmanager
def held() -> Iterator[None]:
    """A step that a stop signal must not cut in two (renames that put a directory in place): a signal
    that arrives inside takes effect as the block ends."""
    global _held, _pending
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending is not None:
            signum, _pending = _pending, None
            _raise_once(signum, None)


@contextmanager
def worker_pool(threads: int, name: str) -> Iterator[ThreadPoolExecutor]:
    """A ThreadPoolExecutor whose `with` waits for its work only when the block ends normally: left by
    an Interrupted, it drops what has not started and leaves what runs (a download, which cannot poll
    `interrupted()`) to the process's exit, which does not wait for it."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
    try:
        yield pool
    except Interrupted:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    except BaseException:
        pool.shutdown(wait=True)   # an error: as a plain `with`, the work in flight finishes first
        raise
    pool.shutdown(wait=True)


@contextmanager
def when(context: str | Callable[[], str]) -> Iterator[None]:
    """Say what an Interrupted leaving this block means (`before training started: ...`), unless a
    block inside it said so first; a callable is asked on the way out (what the stop left may depend
    on the moment it came)."""
    try:
        yield
    except Interrupted as e:
        e.context = e.context or (context() if callable(context) else context)
        raise


class StopSignals:
    """Installs the handlers on enter and restores the previous ones on exit."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, SignalHandler] = {}

    def __enter__(self) -> StopSignals:
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
