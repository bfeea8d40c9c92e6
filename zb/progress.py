"""How long work shows progress, decided in one place: a rich bar when a person watches stderr,
plain lines otherwise, so logs and scripts get stable text. Training, checkpoint transfers,
`zb subset-data` and `zb iperf-mesh` all ask here.
"""

from __future__ import annotations

import sys

MODES = ("auto", "rich", "plain")


def wants_bar(mode: str = "auto") -> bool:
    """`log.progress` semantics: rich (always a bar), plain (never), auto (a bar on a terminal)."""
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r} is not one of {', '.join(MODES)}")
    return mode == "rich" or (mode == "auto" and sys.stderr.isatty())


def count_bar(*columns, console=None, transient: bool = True):
    """A rich bar over a count of items (steps, links): description, bar, n/total, then `columns`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *columns,
                    console=console or _stderr(), transient=transient)


def byte_bar(console=None, transient: bool = True):
    """A rich bar over bytes moved: description, bar, bytes, speed, time left."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console or _stderr(), transient=transient)


def _stderr():
    from rich.console import Console

    return Console(stderr=True)
