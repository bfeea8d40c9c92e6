"""Metric sinks: `<log dir>/metrics.jsonl`, one JSON object per line.

Every line has `event`, `time` (unix seconds) and `node` (unique id), then the fields of one of the
records of zb.events (`zb.events.emit(sink, record)` writes one through `log`, which every sink,
wrapper and test recorder has); field names are part of the interface: add, don't rename. Each line
is written with a single write() and flushed, so a killed process leaves a file whose every complete
line parses. A file another running zb process writes too (two nodes given one log.dir) is warned
about once: the lines interleave.

A disk that fills (or any other write error) never stops training: the part of a line that did fit is
taken back, so the file holds only whole lines, and an event that does not fit is dropped (the next
one is tried again: lines are written as soon as there is room). The first failure is one warning
naming the file and its disk's free space; the count of events dropped is one more, at the end.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zb.errors import free_space

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
        self._failing: OSError | None = None   # the last write error (said once, at the first)
        self._dropped = 0                      # events not written: said once more, at the end
        if enabled and jsonl and log_dir is not None:
            self.path = Path(log_dir) / "metrics.jsonl"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: a line goes out in one write() or is taken back, never left half in a buffer.
            self._file = open(self.path, "ab", buffering=0)
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
            line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
            with self._lock:
                self._append(line)
        if self.backends:
            with self._lock:  # the backends' own clients are not all thread-safe
                self._forward(record)
        return record

    def _append(self, line: bytes) -> None:
        """Write one whole line, or nothing: a write the disk cut short is taken back (ftruncate to where
        the line began), so every line of the file parses; the event is then dropped and counted."""
        assert self._file is not None  # only called with a file
        fd = self._file.fileno()
        start = written = 0
        try:
            start = os.fstat(fd).st_size
            while written < len(line):
                written += os.write(fd, line[written:])
        except OSError as e:
            self._take_back(fd, start, written)
            self._dropped += 1
            if self._failing is None:
                log.warning("cannot write metrics to %s (%s; %s): events that do not fit are dropped (counted at "
                            "the end) until it has room again; training goes on", self.path, e.strerror or e,
                            free_space(self.path))
            self._failing = e

    def _take_back(self, fd: int, start: int, written: int) -> None:
        """Remove the part of a line written before the error (unless another process wrote after it:
        cutting there would take that process's line too)."""
        if not written:
            return
        try:
            if os.fstat(fd).st_size == start + written:
                os.ftruncate(fd, start)
        except OSError as e:
            log.warning("could not remove a partly written line from %s (%s)", self.path, e.strerror or e)

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
                self._close_file(self._file)
                self._file = None

    def _close_file(self, file) -> None:
        if self._failing is not None:
            log.warning("%d metrics event(s) were not written to %s (%s); every line it holds is whole",
                        self._dropped, self.path, self._failing.strerror or self._failing)
        try:
            os.fsync(file.fileno())
        except OSError as e:   # a disk that reports its lack of space only now; the lines written stay
            log.warning("could not sync %s (%s): its last lines may not be on disk", self.path, e.strerror or e)
        file.close()


def read_metrics(path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """All complete records of a metrics file (optionally one event type); for tests and scripts."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if event is None or record.get("event") == event:
                records.append(record)
    return records
