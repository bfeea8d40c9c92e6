"""TensorBoard event files in <log.dir>/tensorboard (log.backends = tensorboard).

View them with `tensorboard --logdir <log.dir>/tensorboard`. Each scalar is plotted against the
training step of its event (an event without one, such as `recovery`, takes the last step seen).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from zb.monitor.scalars import scalars

SUBDIR = "tensorboard"


class TensorboardBackend:
    name = "tensorboard"

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        _quiet_writer_thread()
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


def _quiet_writer_thread() -> None:
    """TensorBoard writes from a thread of its own; when a write fails (a full disk) that thread dies
    with a traceback on stderr, and the error comes back at the next add_scalar, where MetricsSink
    reports it in one line and drops the backend. The traceback is left out; other threads' are not."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "zb_quiet_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not isinstance(args.thread, _AsyncWriterThread):
            previous(args)

    hook.zb_quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook
