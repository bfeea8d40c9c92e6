"""Leaving a process that ran gloo groups without interpreter finalization.

Gloo's worker threads can still hold tensors when the interpreter tears down; destroying them
then aborts the process (SIGABRT, "terminate called without an active exception";
pytorch/pytorch#179291), even after destroy_process_group() and even when every rank finished
its work. Such a process flushes its logs and stdio and leaves with os._exit. Whoever builds a
gloo group calls uses_gloo(); everything zb owns must be closed before leave() is reached.

A command stopped by a signal leaves the same way (zb.cli's main, once its cleanup has run): a thread
still at work, a pool's hashing or a download, must not hold the exit.
"""

from __future__ import annotations

import logging
import os
import sys

_gloo_used = False


def uses_gloo() -> None:
    """This process has built (or is about to build) a gloo group: leave_if_gloo_used() exits hard."""
    global _gloo_used
    _gloo_used = True


def leave_if_gloo_used(code) -> None:
    """leave(code) if uses_gloo() was called; otherwise return for a normal exit."""
    if _gloo_used:
        leave(code)


def leave(code) -> None:
    """Flush logging and stdio, then exit with `code` (an int, None for 0, anything else 1)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)
