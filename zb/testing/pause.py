"""`zb` with one function made to stop and wait, so that a test can send a signal at that point.

    python -m zb.testing.pause zb.export.source:verify_snapshot -- export CKPT OUT

replaces `verify_snapshot` in module zb.export.source by a function that prints PAUSED (below) and the
target on stderr, then waits, in whatever thread called it, until the process receives a stop signal,
and then calls the original; the rest of the command line runs as `zb ...` does. A test reads stderr
until the line comes and signals the process: the command is then at that point of its life, every
time (a signal sent after a guessed delay lands anywhere). In the main thread the signal's handler
runs inside the wait; a worker thread goes on with its work after it, as one busy when the signal
came would. A target imported by name into another module is replaced where it is looked up
(`module:name` of the user). Nothing of zb knows of this: it is the checkout's test harness.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from zb import stop_signals

PAUSED = "zb-testing: paused in"


POLL_S = 0.01


def pausing(target: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for `target` that says so once called, waits for a stop signal, then does its work."""

    def paused(*args: Any, **kwargs: Any) -> Any:
        sys.stderr.write(f"{PAUSED} {target} ({threading.current_thread().name})\n")
        sys.stderr.flush()
        while stop_signals.requested() is None:
            time.sleep(POLL_S)
        return original(*args, **kwargs)

    return paused


def install(target: str) -> None:
    """Replace `module:attribute` (or `module:Class.method`) by its pausing stand-in."""
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    setattr(owner, name, pausing(target, getattr(owner, name)))


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == 0:
        sys.exit("usage: python -m zb.testing.pause MODULE:NAME [MODULE:NAME ...] -- ZB ARGS...")
    split = argv.index("--")
    for target in argv[:split]:
        install(target)
    from zb.cli import main as zb_main

    zb_main(argv[split + 1:])


if __name__ == "__main__":
    main(sys.argv[1:])
