"""One place for what the CLI shows: data to stdout, diagnostics to stderr.

Rich styling and progress bars only when stderr is a terminal; plain lines otherwise, so logs and
scripts get stable text.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

from rich.console import Console

from zb.progress import wants_bar

stderr = Console(stderr=True, highlight=False, soft_wrap=True)
stdout = Console(highlight=False, soft_wrap=True)


def interactive() -> bool:
    """True when a human is watching stderr (progress bars and colours are welcome)."""
    return wants_bar("auto")


def abort(message: str, code: int = 1) -> NoReturn:
    """Print one `error:` line to stderr and exit with `code`."""
    stderr.print(f"[bold red]error:[/] {message}" if interactive() else f"error: {message}", markup=interactive())
    sys.exit(code)


def warn(message: str) -> None:
    stderr.print(f"[yellow]warning:[/] {message}" if interactive() else f"warning: {message}", markup=interactive())


def print_json(document: Any) -> None:
    """One JSON document on stdout, for scripts."""
    sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    sys.stdout.flush()
