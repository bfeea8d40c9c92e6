"""Metric sinks: `<log dir>/metrics.jsonl`, one JSON object per line.

Every line has `event`, `time` (unix seconds) and `node` (unique id), then the fields of one of the
records of zb.events (`zb.events.emit(sink, record)` writes one through `log`, which every sink,
wrapper and test recorder has); field names are part of the interface: add, don't rename. Each line
is written with a single write() and flushed, so a killed process leaves a file whose every complete
line parses. A file another running zb process writes too (two nodes given one log.dir) is warned
about once: the lines interleave.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("zb.metrics")


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsSink:
    """Appends events to metrics.jsonl. Safe to call from several threads (heartbeat, uploader)."""

    def __init__(self, log_dir: str | Path | None, node: str, enabled: bool = True, *, jsonl: bool = True,
                 backends: Sequence[Any] = ()):
        self.node = node
        self._lock = threading.Lock()
        self._file = None
        self.path: Path | None = None
        self.backends = list(backends) if enabled else []
        if enabled and jsonl and log_dir is not None:
            self.path = Path(log_dir) / "metrics.jsonl"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
            self._warn_if_shared()

    def _warn_if_shared(self) -> None:
        """Hold an advisory lock on the file while writing: a second writer cannot take it."""
        assert self._file is not None  # called right after opening it
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("another running zb process writes %s too: its lines and this node's interleave (each "
                        "names its node); give each node its own log.dir", self.path)
        except OSError:
            pass  # a file system without locks (some network mounts): nothing to tell

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": round(time.time(), 3), "node": self.node}
        record.update({k: _clean(v) for k, v in fields.items()})
        if self._file is not None:
            line = json.dumps(record, separators=(",", ":")) + "\n"
            with self._lock:
                self._file.write(line)
                self._file.flush()
        if self.backends:
            with self._lock:  # the backends' own clients are not all thread-safe
                self._forward(record)
        return record

    def _forward(self, record: dict[str, Any]) -> None:
        for backend in list(self.backends):
            try:
                backend.write(record)
            except Exception as e:  # a third-party client: whatever it raises, training goes on
                log.warning("metrics backend %s failed (%s: %s); it gets no more events this run", backend.name,
                            type(e).__name__, e)
                self.backends.remove(backend)
                self._close_quietly(backend)

    @staticmethod
    def _close_quietly(backend: Any) -> None:
        try:
            backend.close()
        except Exception as e:
            log.warning("metrics backend %s did not close cleanly (%s: %s)", backend.name, type(e).__name__, e)

    def close(self) -> None:
        with self._lock:
            backends, self.backends = self.backends, []
            for backend in backends:
                self._close_quietly(backend)
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


def read_metrics(path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """All complete records of a metrics file (optionally one event type); for tests and scripts."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if event is None or record.get("event") == event:
                records.append(record)
    return records
