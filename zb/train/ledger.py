"""Where a training loop stands, and the events that say so: one `Ledger` for both loops, `TrainingRun`
(zb.train.run) and the DiLoCo-SWARM stage workers (zb.swarm).

The run position (zb.position.RunPosition) moves in three ways, each one method here: after an inner
step, after an outer step, and to a position taken over (a resume, a joiner's received state, a
restarted stage); the LR schedule moves with the step. The ledger builds and emits the `step`, `eval`,
`outer_step` and `run_start` events (zb.events) from that position, so both loops write the same
fields alike. A new `outer_step` field is one edit, to `OuterReport` (what the node measured) or to
`OuterStep` (a loop's own figure), both in zb.events, plus its display.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from zb import __version__
from zb.config import non_default_settings
from zb.config_schema import Config
from zb.events import Eval, OuterStep, RunStart, Sink, Step, emit
from zb.position import RunPosition
from zb.train.lr_schedule import set_schedule_position
from zb.train.progress import format_step_line

if TYPE_CHECKING:
    import torch

    from zb.events import OuterReport


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy); inf past what a float holds (metrics.jsonl writes it as a string)."""
    return math.inf if loss > 709 else math.exp(loss)


def emit_run_start(sink: Sink, cfg: Config, *, local_world_size: int, device: str) -> None:
    """Where a run starts in a file that may hold several (every run of a log.dir appends to it)."""
    emit(sink, RunStart(version=__version__, host=socket.gethostname(), pid=os.getpid(),
                        local_world_size=local_world_size, device=device,
                        settings={key: value for key, value, _ in non_default_settings(cfg)}))


class Ledger:
    """A loop's run position, the nodes training with it, and its step, eval and outer_step events.

    `tokens_per_step` are this worker's tokens per inner step (0 where it reads no data: a later stage);
    `mfu` turns tokens per second into MFU, None without a FLOPs model (a stage): the step's mfu is then
    null and outer steps report no rates. `stage` goes on a stage worker's events."""

    def __init__(self, sink: Sink, scheduler: torch.optim.lr_scheduler.LambdaLR, *, tokens_per_step: int,
                 mfu: Callable[[float], float | None] | None = None, stage: int | None = None) -> None:
        self.sink, self.scheduler = sink, scheduler
        self.tokens_per_step, self.mfu, self.stage = tokens_per_step, mfu, stage
        self.position = RunPosition()
        self.nodes = 1   # nodes training this run: the run's tokens per step are this node's times these
        self._round = (time.perf_counter(), self.position)   # (time, position) where the current round began

    @property
    def round_start(self) -> RunPosition:
        """The position after the last outer step (or where the loop started)."""
        return self._round[1]

    # -- moves ------------------------------------------------------------------------------------
    def inner_step(self) -> RunPosition:
        p = self.position
        self.position = RunPosition(p.step + 1, p.outer_step, p.tokens + self.tokens_per_step,
                                    p.run_tokens + self.tokens_per_step * self.nodes)
        return self.position

    def move_to(self, position: RunPosition, *, own_tokens: bool = False) -> None:
        """Take over a position, the LR schedule with it. A joiner keeps its own token count (the position
        came from another node); a resume (`own_tokens`) takes it back too."""
        tokens = position.tokens if own_tokens else self.position.tokens
        self.position = dataclasses.replace(position, tokens=tokens)
        set_schedule_position(self.scheduler, position.step)

    def start_round(self, now: float | None = None) -> None:
        """The loop starts training (after a resume): outer-step rates count from here."""
        self._round = (time.perf_counter() if now is None else now, self.position)

    def outer_step(self, report: OuterReport, *, received: RunPosition | None = None,
                   closing: bool | None = None, round_micro_batches: int | None = None) -> OuterStep:
        """After an outer step: a joiner takes the run's position it `received` (as of the step's start);
        after an adaptive round every node moves to the run's step and counts the tokens every node
        reported instead of its estimate. Then the outer step counts, and its event is emitted."""
        if received is not None:
            self.move_to(received)
        elif report.run_step is not None:
            self.move_to(dataclasses.replace(self.position, step=report.run_step,
                                             run_tokens=self.round_start.run_tokens + (report.round_tokens or 0)))
        self.position = dataclasses.replace(self.position, outer_step=self.position.outer_step + 1)
        self.nodes = report.global_world_size
        now = time.perf_counter()
        rate, mfu = self._round_rates(now)
        record = OuterStep(outer_step=self.position.outer_step, step=self.position.step, stage=self.stage,
                           report=report, outer_tokens_per_s=rate, outer_mfu=mfu, closing=closing,
                           run_tokens=self.position.run_tokens, round_micro_batches=round_micro_batches)
        self.start_round(now)
        emit(self.sink, record)
        return record

    def _round_rates(self, now: float) -> tuple[float | None, float | None]:
        """Prime's outer_tokens_per_second and outer_mfu: this node's tokens since the previous outer step
        over the wall time, all-reduce included (what DiLoCo costs against training alone); (None, None)
        without a FLOPs model."""
        if self.mfu is None:
            return None, None
        started, then = self._round
        rate = (self.position.tokens - then.tokens) / max(now - started, 1e-9)
        return round(rate, 1), self.mfu(rate)

    # -- events -----------------------------------------------------------------------------------
    def step(self, *, loss: float, lr: float, grad_norm: float, z_loss: float | None, seconds: float,
             micro_batches: int | None = None) -> Step:
        """The event of the inner step just counted, `seconds` long."""
        p = self.position
        rate, run_rate = self._rates(seconds)
        record = Step(step=p.step, outer_step=p.outer_step, loss=loss, lr=lr, grad_norm=grad_norm, z_loss=z_loss,
                      tokens=p.tokens, tokens_per_s=round(rate, 1), run_tokens=p.run_tokens,
                      run_tokens_per_s=round(run_rate, 1), perplexity=perplexity(loss),
                      mfu=self.mfu(rate) if self.mfu is not None else None, stage=self.stage,
                      micro_batches=micro_batches)
        emit(self.sink, record)
        return record

    def step_line(self, record: Step, total: int, *, seconds: float, eta_s: float | None) -> str:
        """The plain log line of that step (zb.train.progress), at the rates before rounding."""
        rate, run_rate = self._rates(seconds)
        return format_step_line(record.step, total, record.loss, record.lr, record.grad_norm, rate, run_rate,
                                record.run_tokens, step_s=seconds, eta_s=eta_s)

    def _rates(self, seconds: float) -> tuple[float, float]:
        """This node's and the run's tokens per second over a step of `seconds`."""
        rate = self.tokens_per_step / seconds
        return rate, rate * self.nodes

    def eval(self, loss: float) -> Eval:
        """The event of a held-out evaluation at the current position."""
        p = self.position
        record = Eval(step=p.step, outer_step=p.outer_step, loss=loss, perplexity=perplexity(loss))
        emit(self.sink, record)
        return record
