"""TensorBoard event files in <log.dir>/tensorboard (log.backends = tensorboard).

View them with `tensorboard --logdir <log.dir>/tensorboard`. Each scalar is plotted against the
training step of its event (an event without one, such as `recovery`, takes the last step seen).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zb.monitor.scalars import scalars

SUBDIR = "tensorboard"


class TensorboardBackend:
    name = "tensorboard"

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.path = Path(log_dir) / SUBDIR
        self._writer = SummaryWriter(log_dir=str(self.path))
        self._step = 0

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        step = int(values.pop("step", self._step))
        self._step = max(self._step, step)
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step, walltime=record.get("time"))

    def close(self) -> None:
        self._writer.close()
