"""The background half of a checkpoint: one thread that turns staged tensors into durable copies.

Per job, in order: copy the outer state (it does not change during inner steps) -> write the part
into the RAM directory (frees the staging buffers for the next save) -> copy it to ckpt.path and
commit -> prune older parts there (topk) -> upload it to ckpt.remote.path -> drop older RAM copies.
Every stage is retried with backoff and reported; a failure never reaches the training loop and
never leaves anything that lists as committed. It is remembered, though: the manager's
check_durable() turns newest checkpoints that never reached ckpt.path into a failed end of the run.
A final checkpoint of a step already committed on disk is not written again. No torch.distributed
call happens on this thread: the local process group belongs to the training loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zb.ckpt.durable.copies import copy_part, describe_failure, retry
from zb.ckpt.durable.layout import drop_if_empty, part_name, prune_own_parts
from zb.ckpt.durable.lineage import Origin, origin_of
from zb.ckpt.durable.ramdir import claim
from zb.ckpt.durable.remote import prune_remote, upload_part
from zb.ckpt.durable.state import OUTER, Staging
from zb.ckpt.format.catalog import check_quick
from zb.ckpt.format.manifest import snapshot_name
from zb.ckpt.format.snapshot import write_snapshot
from zb.errors import InvalidInput
from zb.events import Checkpoint, Upload, emit

log = logging.getLogger("zb.ckpt")


@dataclass
class Job:
    step: int
    outer_step: int | None
    tensors: dict[str, dict[str, torch.Tensor]]      # staged (private) copies
    outer: dict[str, torch.Tensor] | None            # live outer state, copied by the worker
    meta: dict[str, Any]
    fingerprint: str
    final: bool
    blocking_s: float
    release: threading.Event                          # set once the staging buffers may be reused
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Targets:
    ram_root: Path | None      # RAM staging directory of this node, None to write straight to disk
    disk_root: Path | None     # ckpt.path
    remote: str | None         # ckpt.remote.path/<node id> (fsspec URL)
    remote_interval: int | None
    topk: int                  # 0: keep every checkpoint
    local_rank: int
    attempts: int = 3
    retry_delay: float = 1.0


class Worker:
    def __init__(self, targets: Targets, sink: Any):
        self.t, self.sink = targets, sink
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._outer_staging = Staging()
        self._uploaded: list[int] = []  # steps uploaded by this worker, oldest first
        self.durable: dict[int, Path] = {}  # step -> part committed on ckpt.path by this worker
        self.last_durable: int | None = None
        self.not_durable: list[tuple[int, str]] = []  # (step, why) of checkpoints since last_durable
        self.ever_failed: list[int] = []  # steps that never reached ckpt.path
        self._claimed = False
        self.ram_only: Path | None = None  # the RAM copy of the newest checkpoint that never reached ckpt.path
        self.current: Job | None = None    # the job being processed, for the message of a stop that cannot wait
        self._thread = threading.Thread(target=self._run, name="zb-ckpt", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._pending == 0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(job)

    def wait(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float | None) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self.current = job
            try:
                self._process(job)
            except Exception:  # noqa: BLE001 - a bug here must not kill training; log it loudly
                log.exception("checkpoint of step %d failed", job.step)
            finally:
                self.current = None
                job.release.set()
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    # -- stages ------------------------------------------------------------------------------
    def _process(self, job: Job) -> None:
        if job.final and self._already_durable(job):
            return
        tensors = dict(job.tensors)
        if job.outer is not None:
            tensors[OUTER] = self._outer_staging.fill({OUTER: job.outer})[OUTER]
        first, error = self._write_first(job, tensors)
        job.release.set()
        if first is None:
            self._record(job.step, None, error)
            self._report_checkpoint(job, None, 0)
            return
        durable: Path | None = first
        if self.t.disk_root is not None and not _is_under(first, self.t.disk_root):
            disk_root = self.t.disk_root
            durable, error = retry(f"checkpoint step {job.step}: copy to disk",
                                   lambda: copy_part(first, disk_root / snapshot_name(job.step)),
                                   self.t.attempts, self.t.retry_delay)
            if durable is None:
                drop_if_empty(disk_root / snapshot_name(job.step))  # no empty step directory after a full disk
                log.error("checkpoint of step %d is only in RAM (%s): %s", job.step, first,
                          describe_failure(error, disk_root))
        self._record(job.step, durable, error, first)
        origin = origin_of(job.meta)
        if durable is not None and self.t.disk_root is not None and _is_under(durable, self.t.disk_root):
            self._prune(self.t.disk_root, origin, self.t.topk)  # only now that a newer checkpoint is committed
        nbytes = sum(p.stat().st_size for p in first.iterdir() if p.is_file())
        self._report_checkpoint(job, durable, nbytes)
        if self.t.remote is not None and (job.final or not self.t.remote_interval
                                          or job.step % self.t.remote_interval == 0):
            self._upload(job, durable or first, nbytes, origin)
        if self.t.ram_root is not None and _is_under(first, self.t.ram_root):
            # With ckpt.path the RAM copies only feed it: the newest stays. Without, they are the checkpoints.
            self._prune(self.t.ram_root, origin, 1, keep_tips=self.t.disk_root is None)

    def _already_durable(self, job: Job) -> bool:
        """A final checkpoint of a step the interval already saved is not written again (rewriting
        the same step only risks the good copy); only a missing upload is made up for."""
        path = self.durable.get(job.step)
        if path is None or self.last_durable != job.step:
            return False
        try:
            check_quick(path)
        except (InvalidInput, OSError):
            return False
        job.release.set()
        log.info("final checkpoint: step %d is already committed at %s; not writing it again", job.step, path)
        if self.t.remote is not None and job.step not in self._uploaded:
            self._upload(job, path, sum(p.stat().st_size for p in path.iterdir() if p.is_file()), origin_of(job.meta))
        return True

    def _record(self, step: int, path: Path | None, error: Exception | None, first: Path | None = None) -> None:
        """Durability bookkeeping for the end of the run: the newest step committed on ckpt.path, the
        checkpoints since then that did not get there, and the RAM copy of the newest such one."""
        if self.t.disk_root is None:
            return
        if path is not None and _is_under(path, self.t.disk_root):
            self.durable[step], self.last_durable, self.not_durable, self.ram_only = path, step, [], None
        else:
            why = describe_failure(error, self.t.disk_root)
            self.not_durable = [(s, w) for s, w in self.not_durable if s != step] + [(step, why)]  # a final retry
            self.ever_failed = [s for s in self.ever_failed if s != step] + [step]
            self.ram_only = first if first is not None and self.t.ram_root is not None else self.ram_only

    def _write_first(self, job: Job, tensors: dict[str, dict[str, torch.Tensor]]
                     ) -> tuple[Path | None, Exception | None]:
        roots = [r for r in ([self.t.disk_root] if job.final else []) + [self.t.ram_root, self.t.disk_root]
                 if r is not None]
        disk_error = None
        for root in dict.fromkeys(roots):  # a final checkpoint goes straight to disk: one copy, not two
            if root == self.t.ram_root and self.t.disk_root is not None and not self._claimed:
                # The owner file lets a later run remove these RAM copies if this process dies. Without
                # ckpt.path the RAM copies are the checkpoints (a restart resumes from them): not claimed.
                try:
                    claim(root, self.t.disk_root)
                    self._claimed = True
                except OSError as e:
                    log.warning("cannot use the RAM directory %s: %s", root, e)
            def write(root: Path = root) -> Path:
                return write_snapshot(root / snapshot_name(job.step), tensors, job.meta, job.step,
                                      outer_step=job.outer_step, fingerprint=job.fingerprint,
                                      name=part_name(self.t.local_rank))
            path, error = retry(f"checkpoint step {job.step}: write to {root}", write, self.t.attempts,
                                self.t.retry_delay)
            if path is not None:
                return path, disk_error
            if root == self.t.disk_root:
                disk_error = error
            drop_if_empty(root / snapshot_name(job.step))  # a full disk must not leave an empty step behind
            log.error("checkpoint of step %d could not be written to %s: %s", job.step, root,
                      describe_failure(error, root))
        return None, disk_error or error

    def _prune(self, root: Path, origin: Origin, keep: int, *, keep_tips: bool = True) -> None:
        if not keep:
            return
        try:
            removed = prune_own_parts(root, self.t.local_rank, origin, keep, keep_tips=keep_tips)
        except OSError as e:
            log.warning("pruning %s failed: %s", root, e)
            return
        for step, why in removed:
            log.info("pruned checkpoint step %d under %s: %s", step, root, why)

    def _upload(self, job: Job, src: Path, nbytes: int, origin: Origin) -> None:
        remote = self.t.remote
        assert remote is not None  # uploads happen only with ckpt.remote.path
        url = f"{remote.rstrip('/')}/{snapshot_name(job.step)}/{part_name(self.t.local_rank)}"
        t0 = time.perf_counter()
        sent, error = retry(f"upload of step {job.step} to {url}", lambda: upload_part(src, url),
                            self.t.attempts, self.t.retry_delay)
        seconds = time.perf_counter() - t0
        emit(self.sink, Upload(step=job.step, target=url, seconds=round(seconds, 3), bytes=sent or 0,
                               ok=error is None))
        if error is not None:
            log.error("upload of checkpoint step %d to %s failed for good: %s (training continues)", job.step,
                      url, error)
            return
        log.info("checkpoint step %d uploaded to %s: %s bytes in %.1f s", job.step, url, f"{nbytes:,}", seconds)
        self._uploaded.append(job.step)
        if self.t.topk and self.t.local_rank == 0:
            pruned, _ = retry("pruning the remote", lambda: prune_remote(remote, origin, self.t.topk), 1, 0.0)
            for step, why in pruned or []:
                log.info("pruned checkpoint step %d under %s: %s", step, remote, why)

    def _report_checkpoint(self, job: Job, path: Path | None, nbytes: int) -> None:
        background = time.perf_counter() - job.started
        emit(self.sink, Checkpoint(step=job.step, path=str(path) if path else None,
                                   blocking_s=round(job.blocking_s, 4), bytes=nbytes,
                                   background_s=round(background, 3), ok=path is not None, final=job.final))
        if path is not None:
            log.info("checkpoint step %d committed at %s: %s bytes, %.2f s blocking, %.1f s in the background",
                     job.step, path, f"{nbytes:,}", job.blocking_s, background)


def _is_under(path: Path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except ValueError:
        return False
