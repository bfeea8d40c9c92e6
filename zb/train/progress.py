"""What a person sees while training: a rich progress bar on a terminal, plain log lines otherwise.

Every logged step also becomes one fixed-field log line (node and rank are in the log prefix), so
logs stay greppable whichever display is on.
"""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from zb.log import retarget_stream

log = logging.getLogger("zb.train")


def format_step_line(step: int, total: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
                     run_tokens_per_s: float, run_tokens: int) -> str:
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.3f} | "
            f"tok/s {tokens_per_s:,.0f} | run tok/s {run_tokens_per_s:,.0f} | run tokens {run_tokens:,}")


class TrainingDisplay:
    """Context manager; `mode` is log.progress (auto/rich/plain); only the node's leader shows a bar."""

    def __init__(self, total_steps: int, start_step: int, mode: str, enabled: bool):
        rich_wanted = mode == "rich" or (mode == "auto" and sys.stderr.isatty())
        self._progress = None
        if enabled and rich_wanted:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(stderr=True), redirect_stderr=True, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, loss="-", tps="-")

    def __enter__(self) -> "TrainingDisplay":
        if self._progress is not None:
            self._progress.start()
            retarget_stream(sys.stderr)  # log lines print above the bar instead of through it
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            retarget_stream(sys.stderr)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")
