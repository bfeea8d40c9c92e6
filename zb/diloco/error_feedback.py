"""Error feedback (diloco.error_feedback): what this rank's quantizations dropped from the values it sent,
kept and sent again at the next outer step.

The quantized ring (zb.collectives.ring) adds the residual to every value this rank quantizes (its own
pseudo-gradient, and the partial sums it re-quantizes on the way) and keeps what that quantization
dropped, so across outer steps the run loses nothing but what the residuals still hold (the outputs
summed plus every residual equal the pseudo-gradients summed, to fp32 rounding). Why it matters at 4
and 2 bits: one int4 quantization of a heavy-tailed block drops ~30% of its norm and an int2 one
~70%; with error feedback the error of 20 rounds summed falls from 8% to 2% (int4) and from 53% to
36% (int2), and int2's held-out loss from +19% against fp32 to -5% (BENCHMARKS.md, "Fewer bits on the
wire").

The residual is this node's own state, like its model params: its checkpoint keeps it, a node that
takes the run's state (a joiner, a lagging node) starts it at zero, and an attempt that fails restores
it (a retried or skipped average must not count the dropped mass twice or lose it). A residual that
turns non-finite (a NaN pseudo-gradient: every node skips that average) starts again at zero.

Its layout is the algorithm's buffer: the params in order (blocking, eager), or fragment after fragment
(streaming). A checkpoint names it, so a resume under the other layout drops it with one line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger("zb.diloco")

PREFIX = "feedback/"


def enabled(compression: str, setting: bool | None) -> bool:
    """diloco.error_feedback as it applies: on by default at 4 and 2 bits and sparse (which cannot do without it:
    zb.config_checks refuses it off), never without compression."""
    if compression == "none":
        return False
    return setting if setting is not None else compression in ("int4", "int2", "sparse")


class ErrorFeedback:
    """This rank's residual (`layout`: "params" or "fragments"), and its copy for a failed attempt."""

    def __init__(self, numel: int, layout: str):
        self.layout = layout
        self.residual = torch.zeros(numel)
        self._saved = torch.zeros(numel)

    @property
    def nbytes(self) -> int:
        """Host bytes held: the residual and its copy (8 bytes a value of this rank's stripe)."""
        return 2 * 4 * self.residual.numel()

    @contextmanager
    def attempt(self, start: int = 0, stop: int | None = None) -> Iterator[torch.Tensor]:
        """The residual of values [start, stop) for one all-reduce: restored if it raises, started again at
        zero if it turned non-finite."""
        residual, saved = self.residual[start:stop], self._saved[start:stop]
        saved.copy_(residual)
        try:
            yield residual
        except BaseException:
            residual.copy_(saved)
            raise
        if not bool(torch.isfinite(residual).all()):
            residual.zero_()
            log.warning("error feedback: a non-finite pseudo-gradient reached the residual; it starts again at zero")

    def reset(self) -> None:
        """This node took the run's state: what it dropped before belongs to params it no longer has."""
        self.residual.zero_()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {PREFIX + self.layout: self.residual}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        mine = tensors.get(PREFIX + self.layout)
        if mine is not None and mine.numel() == self.residual.numel() and mine.dtype == torch.float32:
            self.residual.copy_(mine.reshape(-1))
            return
        kept = [k[len(PREFIX):] for k in tensors if k.startswith(PREFIX)]
        if kept or mine is not None:
            log.warning("the checkpoint's error-feedback residual (%s) does not fit this run's settings: it is "
                        "dropped and starts at zero", ", ".join(kept) or "another size")
        else:
            log.info("error feedback: the checkpoint holds no residual (written without it); it starts at zero")


def drop_unused(tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint's residual, loaded by a run without error feedback: one line."""
    if any(k.startswith(PREFIX) for k in tensors):
        log.warning("the checkpoint holds an error-feedback residual; with diloco.error_feedback off (or no "
                    "diloco.compression) it is dropped")
