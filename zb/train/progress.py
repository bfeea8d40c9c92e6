"""What a person sees while training: a rich progress bar on a terminal, plain log lines otherwise.

Every logged step also becomes one fixed-field log line (node and rank are in the log prefix), so
logs stay greppable whichever display is on.
"""

from __future__ import annotations

import logging
import statistics
import sys
from collections import deque

from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn

from zb.log import retarget_stream
from zb.progress import count_bar, wants_bar

log = logging.getLogger("zb.train")


def format_step_line(step: int, total: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
                     run_tokens_per_s: float, run_tokens: int, *, step_s: float, eta_s: float | None) -> str:
    """The plain log line of a step: what the rich bar shows (step time, ETA) too, and the run's rate
    only when other nodes add to it (on one node it would repeat this node's)."""
    run = f" | run tok/s {run_tokens_per_s:,.0f}" if round(run_tokens_per_s) != round(tokens_per_s) else ""
    eta = f" | ETA {format_duration(eta_s)}" if eta_s is not None and step < total else ""
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.3f} | {step_s:.3g} s/step | "
            f"tok/s {tokens_per_s:,.0f}{run} | run tokens {run_tokens:,}{eta}")


def format_duration(seconds: float) -> str:
    """h:mm:ss, as the rich bar shows time."""
    whole = max(0, int(round(seconds)))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class StepClock:
    """Seconds per step for the ETA: the median of the last 20 steps, so a slow first step (warm-up,
    compilation) or an outer step now and then does not swing it."""

    def __init__(self, window: int = 20) -> None:
        self._recent: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)

    def eta(self, steps_left: int) -> float | None:
        return steps_left * statistics.median(self._recent) if self._recent else None


class TrainingDisplay:
    """Context manager; `mode` is log.progress (auto/rich/plain); only the node's head (local rank 0) shows a bar."""

    def __init__(self, total_steps: int, start_step: int, mode: str, enabled: bool):
        self._progress = None
        if enabled and wants_bar(mode):
            self._progress = count_bar(TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                       TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False)
            self._task = self._progress.add_task("[bold]train", total=total_steps, completed=start_step, loss="-",
                                                 tps="-")

    def __enter__(self) -> TrainingDisplay:
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
